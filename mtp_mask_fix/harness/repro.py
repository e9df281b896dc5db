"""Reproduce #6103 on the tiny model: one training step before (unpatched gpt_step.py) and after (patched view).

Each side runs the harness worker in its own process, because a process selects its gpt_step.py before it first
imports megatron.bridge. Every figure is measured in this run.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mtp_mask_fix.patch import BASE_FILE, REPO, VIEW


SIDES = ("before", "after")
ROWS = (
    ("lm loss", "lm_loss", "{:.6f}"),
    ("mtp_1 loss", "mtp_1_loss", "{:.6f}"),
    ("grad norm", "grad_norm", "{:.4f}"),
    ("MTP loss mass on masked positions", "mtp_mass_on_masked", "{:.1%}"),
)


def _run_worker(gpt_step: Path, out: Path) -> subprocess.Popen:
    if not gpt_step.is_file():
        raise FileNotFoundError(f"{gpt_step} not found (run ./run setup)")
    env = dict(os.environ, MTP_FIX_GPT_STEP=str(gpt_step))
    command = [sys.executable, "-m", "mtp_mask_fix.harness.tiny_mtp", "--mode", "repro", "--out", str(out)]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _mass_on_masked(ce: list[list[float]], weight: list[list[float]], mask: list[list[float]]) -> float:
    """Share of the MTP loss at masked positions: sum of weight * CE there over the sum everywhere.

    ``weight`` is each position's weight in the step loss as core applied it (the gradient reaching its CE), so
    with an all-ones mask this is sum(CE at masked) / sum(CE), and with the right mask it is 0.
    """
    total = masked = 0.0
    for ce_row, w_row, m_row in zip(ce, weight, mask):
        for c, w, m in zip(ce_row, w_row, m_row):
            total += w * c
            masked += w * c if m == 0 else 0.0
    return masked / total


def _side_figures(gpt_step: Path, worker: dict) -> dict:
    return {
        "gpt_step": str(gpt_step),
        "lm_loss": worker["lm_loss"],
        "mtp_1_loss": worker["mtp_losses"][0],
        "grad_norm": worker["grad_norm"],
        "mtp_mass_on_masked": _mass_on_masked(worker["mtp_ce"], worker["mtp_loss_weight"], worker["mtp_mask"]),
        "worker_seconds": worker["seconds"],
        "worker_peak_rss_mib": worker["peak_rss_mib"],
    }


def _plot(figures: dict, workers: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    mask = workers["before"]["mtp_mask"]
    rows = len(mask)
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.2 * rows + 0.6), sharex=True, squeeze=False)
    styles = {"before": ("tab:red", 0.8, "before (unpatched)"), "after": ("tab:blue", 0.4, "after (patched)")}
    for row, ax in enumerate(axes[:, 0]):
        for t, m in enumerate(mask[row]):
            if m == 0:
                ax.axvspan(t - 0.5, t + 0.5, color="0.85", lw=0)
        for side in SIDES:
            color, width, label = styles[side]
            ce, weight = workers[side]["mtp_ce"][row], workers[side]["mtp_loss_weight"][row]
            counted = [c if w != 0 else 0.0 for c, w in zip(ce, weight)]
            ax.bar(range(len(counted)), counted, width=width, color=color, alpha=0.75, label=label)
        ax.set_ylabel(f"sample {row}\nCE")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].set_title(
        "MTP depth-1 cross-entropy counted in the loss, per position (grey: loss_mask = 0)\n"
        f"masked share of MTP loss: before {figures['before']['mtp_mass_on_masked']:.1%}, "
        f"after {figures['after']['mtp_mass_on_masked']:.1%}"
    )
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("position t (target labels[t + 1])")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_repro(out_dir: Path, base_gpt_step: Path = BASE_FILE, patched_gpt_step: Path = VIEW) -> dict:
    """Measure before/after, write figures.json and mtp_ce_per_position.png into out_dir, return the figures."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"before": Path(base_gpt_step), "after": Path(patched_gpt_step)}
    with tempfile.TemporaryDirectory(prefix="mtp-repro-") as tmp:
        procs = {side: _run_worker(paths[side], Path(tmp) / side) for side in SIDES}
        workers = {}
        for side, proc in procs.items():
            _, stderr = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{side} worker failed ({proc.returncode}):\n{stderr[-4000:]}")
            workers[side] = json.loads((Path(tmp) / side / "rank0.json").read_text())
    before = workers["before"]
    figures = {
        "model": {
            "spec": "megatron-core GPTModel, get_gpt_layer_local_spec + get_gpt_mtp_block_spec, fp32, CPU",
            "mtp_num_layers": 1,
            "parameters": before["num_parameters_this_rank"],
        },
        "batch": {
            "shape": [len(before["tokens"]), len(before["tokens"][0])],
            "loss_tokens": int(sum(map(sum, before["loss_mask"]))),
            "mtp_1_positions": sum(len(row) for row in before["mtp_mask"]),
        },
        **{side: _side_figures(paths[side], workers[side]) for side in SIDES},
        "mtp_ce_per_position": {
            "mtp_mask": before["mtp_mask"],
            **{f"ce_{side}": workers[side]["mtp_ce"] for side in SIDES},
            **{f"loss_weight_{side}": workers[side]["mtp_loss_weight"] for side in SIDES},
        },
    }
    (out_dir / "figures.json").write_text(json.dumps(figures, indent=1))
    _plot(figures, workers, out_dir / "mtp_ce_per_position.png")
    return figures


def format_table(figures: dict) -> str:
    """The report's table: rows lm loss, mtp_1 loss, grad norm, MTP mass on masked positions; before/after."""
    label_width = max(len(label) for label, _, _ in ROWS)
    lines = [f"{'':{label_width}}  {'before':>12}  {'after':>12}"]
    for label, key, fmt in ROWS:
        cells = [fmt.format(figures[side][key]) for side in SIDES]
        lines.append(f"{label:{label_width}}  {cells[0]:>12}  {cells[1]:>12}")
    batch, model = figures["batch"], figures["model"]
    lines.append(
        f"(one step, tiny GPTModel with MTP, {model['parameters']} parameters; batch {batch['shape'][0]}x"
        f"{batch['shape'][1]}, {batch['loss_tokens']} loss tokens; before = unpatched gpt_step.py, after = patched)"
    )
    return "\n".join(lines)
