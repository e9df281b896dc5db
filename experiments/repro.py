"""Reproduce #6103 on the tiny model: one training step before (the pinned release as shipped) and after (the view:
release + patch), each side in its own process with its own tree first on the import path, both at once. Every
figure is measured in this run.
"""

import json
import tempfile
from pathlib import Path

from maintain.repo import VIEW, WORK, pins, release
from tinymodel.reference import loss_mass_on_masked
from tinymodel.worker import Launch, launch_all


SIDES = ("before", "after")
ROWS = (
    ("lm loss", "lm_loss", "{:.6f}"),
    ("mtp_1 loss", "mtp_1_loss", "{:.6f}"),
    ("grad norm", "grad_norm", "{:.4f}"),
    ("MTP loss mass on masked positions", "mtp_mass_on_masked", "{:.1%}"),
)


def _side_figures(tree: Path, worker: dict) -> dict:
    step = worker["step"]
    return {
        "tree": str(tree),
        "lm_loss": step.lm_loss,
        "mtp_1_loss": step.mtp_losses[0],
        "grad_norm": step.grad_norm,
        "mtp_mass_on_masked": loss_mass_on_masked(worker["mtp_ce"], worker["mtp_loss_weight"], worker["mtp_mask"]),
        "worker_seconds": worker["seconds"],
        "worker_peak_rss_mib": worker["peak_rss_mib"],
    }


def _plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    per_position = figures["mtp_ce_per_position"]
    mask = per_position["mtp_mask"]
    rows = len(mask)
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.2 * rows + 0.6), sharex=True, squeeze=False)
    styles = {"before": ("tab:red", 0.8, "before (unpatched)"), "after": ("tab:blue", 0.4, "after (patched)")}
    for row, ax in enumerate(axes[:, 0]):
        for t, m in enumerate(mask[row]):
            if m == 0:
                ax.axvspan(t - 0.5, t + 0.5, color="0.85", lw=0)
        for side in SIDES:
            color, width, label = styles[side]
            ce, weight = per_position[f"ce_{side}"][row], per_position[f"loss_weight_{side}"][row]
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


def run_repro(out_dir: Path) -> dict:
    """Measure before/after, write figures.json and mtp_ce_per_position.png into out_dir, return the figures."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trees = {"before": release(pins()["megatron-bridge"]).root, "after": VIEW}
    with tempfile.TemporaryDirectory(prefix="mtp-repro-") as tmp:
        runs = [Launch("repro", trees[side], 1, Path(tmp) / side) for side in SIDES]
        workers = {side: ranks[0] for side, ranks in zip(SIDES, launch_all(runs))}  # both at once
    before = workers["before"]
    figures = {
        "model": {
            "spec": "megatron-core GPTModel, get_gpt_layer_local_spec + get_gpt_mtp_block_spec, fp32, CPU",
            "mtp_num_layers": 1,
            "parameters": before["num_parameters"],
        },
        "batch": {
            "shape": list(before["batch"]["tokens"].shape),
            "loss_tokens": int(before["batch"]["loss_mask"].sum()),
            "mtp_1_positions": before["mtp_mask"].numel(),
        },
        **{side: _side_figures(trees[side], workers[side]) for side in SIDES},
        "mtp_ce_per_position": {
            "mtp_mask": before["mtp_mask"].tolist(),
            **{f"ce_{side}": workers[side]["mtp_ce"].tolist() for side in SIDES},
            **{f"loss_weight_{side}": workers[side]["mtp_loss_weight"].tolist() for side in SIDES},
        },
    }
    (out_dir / "figures.json").write_text(json.dumps(figures, indent=1))
    _plot(figures, out_dir / "mtp_ce_per_position.png")
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


if __name__ == "__main__":
    out = WORK / "repro"
    print(format_table(run_repro(out)))
    print(f"\nwrote {out / 'figures.json'} and {out / 'mtp_ce_per_position.png'}")
