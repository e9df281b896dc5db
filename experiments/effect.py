"""What the bug costs through SFT: the same pretraining and the same answer-only SFT, unpatched vs patched.

Each arm is its own process with its own tree first on the import path (unpatched = the pinned release as shipped,
patched = the view, release + patch), both at once; experiments.effect_arm says what an arm does. Every figure is measured
in the run; nothing here asserts what the effect is.

``run_effect(OUT, size)`` writes OUT/figures.json (and returns the same dict), OUT/effect.png (held-out true
acceptance and MTP CE on answer tokens over SFT steps, both arms, mean +- sd over seeds, one column per setting) and
keeps each arm's raw payload and log in OUT/arms/<arm>/. figures.json:

    size                      "full" | "small" | "long" | "padding"
    plan                      pretrain_steps, sft_steps, seeds, settings, eval_every, eval_steps, eval_batches,
                              batch, logged_tail, pretrain_seq, pretrain_lr, sft_lr
    model                     spec, mtp_num_layers, mtp_loss_scaling_factor, parameters
    arms.<arm>                arm = "unpatched" | "patched": tree, gpt_step_file, pretrained_weights_sha256,
                              pretrain_data_sha256, sft_data_sha256 (one per run, seed-major), import_seconds,
                              pretrain_seconds, fine_tune_seconds, peak_rss_mib
    same_pretrained_weights   the arms' pretrained weights hash equal
    same_data                 the arms' pretraining and SFT data hashes equal
    pretrain                  lm_loss_first, lm_loss_last, held_out.{lm_top1, lm_ce, mtp_top1, mtp_ce} (unpatched
                              arm's; chain-A text, every position)
    settings.<setting>        setting = "markov_prompts" | "random_prompts" (| "markov_prompts_pad64")
      description
      step_one                SFT step 1: same weights, same batch in both arms
        mix                   share of the batch's MTP depth-1 targets that are prompt / answer / padding
                              (mean over seeds)
        <metric>.<arm>        {mean, sd, values (one per seed)}; metric = mtp_1_loss (logged), grad_norm, lm_loss,
                              mtp_loss_mass_on_masked (share of the MTP loss at loss_mask = 0 positions),
                              logged_acceptance (mtp_1_acceptance_rate as a fraction)
      final                   after plan.sft_steps SFT steps
        step                  = plan.sft_steps
        <metric>.<arm>        {mean, sd, values}; <metric>.paired_diff: patched - unpatched per seed, {mean, sd,
                              values}; metric = logged_acceptance (mean of the last plan.logged_tail steps),
                              true_acceptance_answer (held-out top-1 of depth 1 where its target is an answer
                              token or the closing EOS), mtp_ce_answer, lm_top1_answer, lm_ce_answer
      curves                  steps (= plan.eval_steps), then per metric true_acceptance_answer, mtp_ce_answer:
                              <arm>.{mean, sd} lists over steps
    wall_seconds              the whole run, both arms
"""

import json
import statistics
from pathlib import Path

from experiments.synthetic import ROLES
from mtp_mask_fix.paths import VIEW, WORK
from mtp_mask_fix.targets import pins, release
from tests.support.reference import loss_mass_on_masked
from tests.support.worker import Launch, launch_all


ARMS = ("unpatched", "patched")
DESCRIPTIONS = {  # answers always continue the prompt under a new chain (the SFT task), one per seed
    "markov_prompts": "prompts from the pretraining chain (predictable)",
    "random_prompts": "uniformly random prompts (unpredictable)",
    "markov_prompts_pad64": "prompts from the pretraining chain, padded to 64 tokens",
}
STEP_ONE_ROWS = (  # (label, metric, format)
    ("mtp_1 loss (logged)", "mtp_1_loss", "{:.3f}"),
    ("grad norm", "grad_norm", "{:.3f}"),
    ("LM loss", "lm_loss", "{:.3f}"),
    ("share of MTP loss mass on masked positions", "mtp_loss_mass_on_masked", "{:.3f}"),
    ("logged acceptance (mtp_1_acceptance_rate)", "logged_acceptance", "{:.3f}"),
)
FINAL_ROWS = (
    ("logged acceptance (mtp_1_acceptance_rate), last {tail} steps", "logged_acceptance", "{:+.3f}"),
    ("true acceptance on answer tokens (held-out top-1, depth 1)", "true_acceptance_answer", "{:+.3f}"),
    ("MTP CE on answer tokens (held-out)", "mtp_ce_answer", "{:+.3f}"),
    ("LM top-1 on answer tokens (held-out)", "lm_top1_answer", "{:+.3f}"),
    ("LM CE on answer tokens (held-out)", "lm_ce_answer", "{:+.3f}"),
)


def _spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def _held_out(sums: dict) -> dict[str, float]:
    return {
        "true_acceptance_answer": sums["mtp_hits"] / sums["mtp_counted"],
        "mtp_ce_answer": sums["mtp_ce_sum"] / sums["mtp_counted"],
        "lm_top1_answer": sums["lm_hits"] / sums["lm_counted"],
        "lm_ce_answer": sums["lm_ce_sum"] / sums["lm_counted"],
    }


def _step_one_figures(step: dict) -> dict[str, float]:
    return {
        "mtp_1_loss": step["logged"]["mtp_1 loss"],
        "grad_norm": step["grad_norm"],
        "lm_loss": step["lm_loss"],
        "mtp_loss_mass_on_masked": loss_mass_on_masked(step["mtp_ce"], step["mtp_loss_weight"], step["mtp_mask"]),
        "logged_acceptance": step["logged"]["mtp_1_acceptance_rate"] / 100,  # core logs percent
    }


def _final_figures(run: dict, tail: int) -> dict[str, float]:
    logged = [entry["mtp_1_acceptance_rate"] / 100 for entry in run["trace"]["logged"][-tail:]]
    return {"logged_acceptance": statistics.fmean(logged), **_held_out(run["evals"][max(run["evals"])])}


def _setting_figures(setting: str, runs: dict[str, list[dict]], plan: dict) -> dict:
    """One data setting: runs[arm] are that arm's runs of this setting, one per seed, in the same order."""
    step_one = {arm: [_step_one_figures(r["step_one"]) for r in runs[arm]] for arm in ARMS}
    final = {arm: [_final_figures(r, plan["logged_tail"]) for r in runs[arm]] for arm in ARMS}
    roles = [r["step_one"]["target_role"] for r in runs["patched"]]  # the same batches in both arms
    mix = {name: statistics.fmean(float((role == i).float().mean()) for role in roles) for i, name in enumerate(ROLES)}
    curves = {"steps": plan["eval_steps"]}
    for metric in ("true_acceptance_answer", "mtp_ce_answer"):
        curves[metric] = {}
        for arm in ARMS:
            per_step = [[_held_out(r["evals"][s])[metric] for r in runs[arm]] for s in plan["eval_steps"]]
            spreads = [_spread(values) for values in per_step]
            curves[metric][arm] = {"mean": [s["mean"] for s in spreads], "sd": [s["sd"] for s in spreads]}
    final_metrics = {}
    for metric in final["patched"][0]:
        values = {arm: [f[metric] for f in final[arm]] for arm in ARMS}
        final_metrics[metric] = {arm: _spread(values[arm]) for arm in ARMS}
        final_metrics[metric]["paired_diff"] = _spread([p - u for u, p in zip(values["unpatched"], values["patched"])])
    return {
        "description": DESCRIPTIONS.get(setting, setting),
        "step_one": {
            "mix": mix,
            **{m: {arm: _spread([f[m] for f in step_one[arm]]) for arm in ARMS} for m in step_one["patched"][0]},
        },
        "final": {"step": plan["sft_steps"], **final_metrics},
        "curves": curves,
    }


def figures_of(size: str, trees: dict[str, Path], arms: dict[str, dict]) -> dict:
    """The figures (see the module docstring) from each arm's raw payload."""
    plan = arms["patched"]["plan"]
    runs = {arm: arms[arm]["runs"] for arm in ARMS}
    pretrain = arms["unpatched"]["pretrain"]
    return {
        "size": size,
        "plan": plan,
        "model": {
            "spec": "megatron-core GPTModel, local spec + MTP block, fp32, CPU; SFT steps via Bridge's forward_step",
            "mtp_num_layers": pretrain["mtp_num_layers"],
            "mtp_loss_scaling_factor": pretrain["mtp_loss_scaling_factor"],
            "parameters": pretrain["num_parameters"],
        },
        "arms": {
            arm: {
                "tree": str(trees[arm]),
                "gpt_step_file": arms[arm]["gpt_step_file"],
                "pretrained_weights_sha256": arms[arm]["pretrain"]["weights_sha256"],
                "pretrain_data_sha256": arms[arm]["pretrain"]["data_sha256"],
                "sft_data_sha256": [r["data_sha256"] for r in runs[arm]],
                **{key: arms[arm][key] for key in ("import_seconds", "pretrain_seconds", "fine_tune_seconds")},
                "peak_rss_mib": arms[arm]["peak_rss_mib"],
            }
            for arm in ARMS
        },
        "same_pretrained_weights": len({arms[arm]["pretrain"]["weights_sha256"] for arm in ARMS}) == 1,
        "same_data": len({(arms[a]["pretrain"]["data_sha256"], *(r["data_sha256"] for r in runs[a])) for a in ARMS})
        == 1,
        "pretrain": {
            "lm_loss_first": pretrain["lm_loss_first"],
            "lm_loss_last": pretrain["lm_loss_last"],
            "held_out": {
                "lm_top1": pretrain["held_out"]["lm_hits"] / pretrain["held_out"]["lm_counted"],
                "lm_ce": pretrain["held_out"]["lm_ce_sum"] / pretrain["held_out"]["lm_counted"],
                "mtp_top1": pretrain["held_out"]["mtp_hits"] / pretrain["held_out"]["mtp_counted"],
                "mtp_ce": pretrain["held_out"]["mtp_ce_sum"] / pretrain["held_out"]["mtp_counted"],
            },
        },
        "settings": {
            setting: _setting_figures(
                setting, {arm: [r for r in runs[arm] if r["setting"] == setting] for arm in ARMS}, plan
            )
            for setting in plan["settings"]
        },
    }


def _plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = figures["settings"]
    metrics = (("true_acceptance_answer", "true acceptance on answers"), ("mtp_ce_answer", "MTP CE on answers"))
    fig, axes = plt.subplots(len(metrics), len(settings), figsize=(5 * len(settings), 7), squeeze=False, sharex=True)
    colors = {"unpatched": "tab:red", "patched": "tab:blue"}
    seeds = len(figures["plan"]["seeds"])
    for column, (setting, data) in enumerate(settings.items()):
        steps = data["curves"]["steps"]
        for row, (metric, label) in enumerate(metrics):
            ax = axes[row, column]
            for arm in ARMS:
                curve = data["curves"][metric][arm]
                low = [m - s for m, s in zip(curve["mean"], curve["sd"])]
                high = [m + s for m, s in zip(curve["mean"], curve["sd"])]
                ax.plot(steps, curve["mean"], marker="o", ms=3, color=colors[arm], label=arm)
                ax.fill_between(steps, low, high, color=colors[arm], alpha=0.2, lw=0)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{setting}\n{data['description']}", fontsize=9)
            if row == len(metrics) - 1:
                ax.set_xlabel("SFT step")
    axes[0, 0].legend(title=f"mean ± sd over {seeds} seed(s)", fontsize=8)
    fig.suptitle(
        "MTP depth 1 on held-out answer tokens through answer-only SFT (answers under a new chain);\n"
        "tiny model, same pretrained weights and batches in both arms",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_effect(out_dir: Path, size: str) -> dict:
    """Run both arms (one process each, at once), write out_dir/figures.json and out_dir/effect.png, return the
    figures. Each arm's raw payload and log stay in out_dir/arms/<arm>/ (rank0.pt, worker.log)."""
    import time

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trees = {"unpatched": release(pins()["megatron-bridge"]).root, "patched": VIEW}
    started = time.perf_counter()
    runs = [Launch("effect", trees[arm], 1, out_dir / "arms" / arm, ("--size", size)) for arm in ARMS]
    payloads = {arm: ranks[0] for arm, ranks in zip(ARMS, launch_all(runs))}
    figures = figures_of(size, trees, payloads)
    figures["wall_seconds"] = time.perf_counter() - started
    text = json.dumps(figures, indent=1)
    (out_dir / "figures.json").write_text(text)
    figures = json.loads(text)  # exactly what the file holds (tuples become lists)
    _plot(figures, out_dir / "effect.png")
    return figures


def _cell(spread: dict, fmt: str) -> str:
    return f"{fmt.format(spread['mean'])} ± {spread['sd']:.3f}"


def format_tables(figures: dict) -> str:
    """Per data setting: the report's step-1 table with the batch's mix, and the through-SFT table."""
    plan, lines = figures["plan"], []
    seeds = len(plan["seeds"])
    pre = figures["pretrain"]
    lines.append(
        f"pretraining: {plan['pretrain_steps']} steps, LM loss {pre['lm_loss_first']:.3f} -> {pre['lm_loss_last']:.3f}; "
        f"held-out top-1 LM {pre['held_out']['lm_top1']:.3f}, MTP {pre['held_out']['mtp_top1']:.3f}; "
        f"same pretrained weights in both arms: {figures['same_pretrained_weights']}, same data: {figures['same_data']}"
    )
    for setting, data in figures["settings"].items():
        mix = ", ".join(f"{name} {share:.1%}" for name, share in data["step_one"]["mix"].items())
        width = max(len(label) for label, _, _ in STEP_ONE_ROWS + FINAL_ROWS) + 4
        lines += ["", f"== {setting}: {data['description']}"]
        lines.append(f"SFT step 1 (same weights and batch in both arms), mean ± sd over {seeds} seed(s)")
        lines.append(f"batch mix of MTP depth-1 targets: {mix}")
        lines.append(f"{'':{width}}  {'unpatched':>17}  {'patched':>17}")
        for label, metric, fmt in STEP_ONE_ROWS:
            cells = [_cell(data["step_one"][metric][arm], fmt) for arm in ARMS]
            lines.append(f"{label:{width}}  {cells[0]:>17}  {cells[1]:>17}")
        lines.append(f"after {data['final']['step']} SFT steps, mean ± sd over {seeds} seed(s)")
        lines.append(f"{'':{width}}  {'unpatched':>17}  {'patched':>17}  {'patched - unpatched':>19}")
        for label, metric, fmt in FINAL_ROWS:
            row = data["final"][metric]
            cells = [_cell(row[arm], fmt.replace("+", "")) for arm in ARMS] + [_cell(row["paired_diff"], fmt)]
            lines.append(
                f"{label.format(tail=plan['logged_tail']):{width}}  {cells[0]:>17}  {cells[1]:>17}  {cells[2]:>19}"
            )
    arms = figures["arms"]
    lines += [
        "",
        f"(wall {figures.get('wall_seconds', float('nan')):.0f} s for both arms at once; per arm: import "
        + ", ".join(
            f"{arm} {arms[arm]['import_seconds']:.0f} s + pretrain {arms[arm]['pretrain_seconds']:.0f} s + "
            f"SFT {arms[arm]['fine_tune_seconds']:.0f} s, peak RSS {arms[arm]['peak_rss_mib']:.0f} MiB"
            for arm in ARMS
        )
        + ")",
    ]
    return "\n".join(lines)


def summary_line(figures: dict) -> str:
    """One line for the PR text: answer-token MTP acceptance and CE after SFT, per setting, both arms."""
    parts = []
    for setting, data in figures["settings"].items():
        acc, ce = data["final"]["true_acceptance_answer"], data["final"]["mtp_ce_answer"]
        parts.append(
            f"{setting}: MTP acceptance on answer tokens {acc['unpatched']['mean']:.3f} unpatched vs "
            f"{acc['patched']['mean']:.3f} patched (paired {acc['paired_diff']['mean']:+.3f} ± "
            f"{acc['paired_diff']['sd']:.3f}), answer MTP CE {ce['unpatched']['mean']:.3f} vs {ce['patched']['mean']:.3f}"
        )
    plan = figures["plan"]
    return f"after {plan['sft_steps']} SFT steps, {len(plan['seeds'])} seeds: " + "; ".join(parts)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("full", "small"), default="full", help="small: the suite's quick version")
    size = parser.parse_args().size
    out = WORK / "effect"
    print(format_tables(run_effect(out, size)))
    print(f"\nwrote {out / 'figures.json'} and {out / 'effect.png'}")
