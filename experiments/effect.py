"""What the bug costs through SFT: per seed the same pretraining, then three SFT settings, unpatched vs patched.

Each arm is its own process with its own tree first on the import path (unpatched = the pinned release as shipped,
patched = the tree under test, by default the view: release + patch), both at once; experiments.effect_arm says what
an arm does. Every figure is measured in the run; nothing here asserts what the effect is.

    ./run effect             the short run (<= 3 min on 2 cores): 5 seeds x 3 settings, 60 SFT steps
    ./run effect --plateau   the same to 600 SFT steps (prints its time)

``run_effect(OUT, size)`` writes OUT/figures.json (format: experiments.figures) and OUT/effect.png, and keeps each
arm's raw payload and log in OUT/arms/<arm>/.
"""

import json
import math
import statistics
import time
from pathlib import Path

from experiments.effect_arm import DESCRIPTIONS
from experiments.figures import ARMS, METRICS, cite, effect_dir, interval, patch_key, run_label, summary_line
from experiments.synthetic import ROLES
from maintain.repo import VIEW, pins, release
from tinymodel.reference import loss_mass_on_masked
from tinymodel.worker import Launch, Started


TIMEOUT_S = {"small": 300, "short": 600, "plateau": 3600}  # an arm still running then is killed (the worker's rule)
THRESHOLD_FRACTION = 0.9  # steps to threshold: the step from which a metric stays at this share of the better final
STEP_ONE = (  # (label, figure, format)
    ("mtp_1 loss (logged)", "mtp_1_loss", "{:.3f}"),
    ("grad norm", "grad_norm", "{:.3f}"),
    ("LM loss", "lm_loss", "{:.3f}"),
    ("share of MTP loss mass on masked positions", "mtp_loss_mass_on_masked", "{:.3f}"),
    ("logged acceptance (mtp_1_acceptance_rate)", "logged_acceptance", "{:.3f}"),
)
TABLE_METRICS = ("teacher-forced", "speculative", "tokens-per-step", "logged", "teacher-forced-answers", "lm-top1")


def _ratio(sums: dict, hits: str, counted: str) -> float | None:
    """hits / counted; None when nothing was counted (e.g. no draft proposed: every greedy answer ended at once)."""
    return sums[hits] / sums[counted] if sums[counted] else None


def held_out_metrics(sums: dict) -> dict[str, float]:
    """METRICS from one evaluation's sums (experiments.training)."""
    return {
        "teacher-forced": _ratio(sums, "mtp_hits", "mtp_counted"),
        "speculative": _ratio(sums, "spec_accepted", "spec_proposed"),
        "tokens-per-step": _ratio(sums, "spec_tokens", "spec_steps"),
        "logged": sums["logged_acceptance"],
        "teacher-forced-answers": _ratio(sums, "mtp_answer_hits", "mtp_answer_counted"),
        "mtp-ce": _ratio(sums, "mtp_ce_sum", "mtp_counted"),
        "lm-top1": _ratio(sums, "lm_hits", "lm_counted"),
    }


def spread(values: list[float | None]) -> dict:
    """Mean and sd (n - 1) of the per-seed values that exist (n of them), with the values."""
    defined = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(defined) if defined else None,
        "sd": statistics.stdev(defined) if len(defined) > 1 else 0.0,
        "n": len(defined),
        "values": values,
    }


def paired(unpatched: list[float], patched: list[float]) -> dict:
    """Patched - unpatched per seed, with the 95 % t-interval of the mean difference (n - 1 degrees of freedom)."""
    from scipy.stats import t

    diffs = [p - u for u, p in zip(unpatched, patched) if u is not None and p is not None]
    out = {**spread(diffs), "ci95": None}  # None: fewer than 2 seeds, no interval
    if len(diffs) > 1:
        half = t.ppf(0.975, len(diffs) - 1) * out["sd"] / math.sqrt(len(diffs))
        out["ci95"] = [out["mean"] - half, out["mean"] + half]
    return out


def _settled(steps: list[int], values: list[float], threshold: float) -> int | None:
    """The first evaluation step from which every later value is at or above the threshold (None: the last is not)."""
    first = None
    for step, value in zip(steps, values):
        if value is not None:  # no value (nothing counted) neither reaches nor leaves the threshold
            first = None if value < threshold else step if first is None else first
    return first


def _to_threshold(steps: list[int], curves: dict[str, list[list[float]]]) -> dict:
    """Per arm and seed, the step from which the metric stays at or above THRESHOLD_FRACTION of the seed's better
    final value (a metric can start above it and dip: speculative acceptance before SFT is the pretrained heads'
    agreement on their own language)."""
    seeds = len(curves["patched"][0])
    finals = [[curves[arm][-1][s] for arm in ARMS if curves[arm][-1][s] is not None] for s in range(seeds)]
    thresholds = [THRESHOLD_FRACTION * max(values) if values else math.inf for values in finals]
    first = {
        arm: [_settled(steps, [row[s] for row in curves[arm]], thresholds[s]) for s in range(seeds)] for arm in ARMS
    }
    both = [s for s in range(seeds) if all(first[arm][s] is not None for arm in ARMS)]
    return {
        "threshold_fraction": THRESHOLD_FRACTION,
        "thresholds": thresholds,
        **first,
        "paired_diff": paired([first["unpatched"][s] for s in both], [first["patched"][s] for s in both])
        if len(both) > 1
        else None,
    }


def _step_one(run: dict) -> dict:
    step = run["step_one"]
    return {
        "mtp_1_loss": step["logged"]["mtp_1 loss"],
        "grad_norm": step["grad_norm"],
        "lm_loss": step["lm_loss"],
        "mtp_loss_mass_on_masked": loss_mass_on_masked(step["mtp_ce"], step["mtp_loss_weight"], step["mtp_mask"]),
        "logged_acceptance": step["logged"]["mtp_1_acceptance_rate"] / 100,  # core logs percent
    }


def _ce_by_role(run: dict) -> dict[str, float]:
    """Step 1's MTP depth-1 CE, mean over the targets of each role (before the first update: weights as loaded)."""
    step = run["step_one"]
    out = {}
    for i, role in enumerate(ROLES):
        where = step["target_role"] == i
        out[role] = float(step["mtp_ce"][where].mean()) if where.any() else None
    return out


def _conclusion(setting: str, metrics: dict) -> str:
    parts = []
    for metric in ("teacher-forced", "speculative"):
        diff = metrics[metric]["final"]["paired_diff"]
        low, high = diff["ci95"] or (-math.inf, math.inf)
        verdict = "higher patched" if low > 0 else "lower patched" if high < 0 else "no difference shown (0 inside)"
        parts.append(f"{metric} {verdict}: {interval(diff)}")
    return f"{setting}: " + "; ".join(parts)


def _setting_figures(setting: str, runs: dict[str, list[dict]], steps: list[int]) -> dict:
    """One data setting: runs[arm] are that arm's runs of this setting, one per seed, in the same seed order."""
    roles = [r["step_one"]["target_role"] for r in runs["patched"]]  # the same batches in both arms
    step_one = {arm: [_step_one(r) for r in runs[arm]] for arm in ARMS}
    by_role = {arm: [_ce_by_role(r) for r in runs[arm]] for arm in ARMS}
    metrics = {}
    for metric, label in METRICS.items():
        curves = {arm: [[held_out_metrics(r["evals"][s])[metric] for r in runs[arm]] for s in steps] for arm in ARMS}
        final = {arm: spread(curves[arm][-1]) for arm in ARMS}
        metrics[metric] = {
            "label": label,
            "steps": steps,
            **curves,
            "final": {**final, "paired_diff": paired(curves["unpatched"][-1], curves["patched"][-1])},
            "to_threshold": _to_threshold(steps, curves),
        }
    return {
        "description": DESCRIPTIONS[setting],
        "conclusion": _conclusion(setting, metrics),
        "step_one": {
            "mix": {
                name: statistics.fmean(float((role == i).float().mean()) for role in roles)
                for i, name in enumerate(ROLES)
            },
            "mtp_ce_by_role": {
                role: {arm: spread([ce[role] for ce in by_role[arm]]) for arm in ARMS} for role in ROLES
            },
            **{f: {arm: spread([x[f] for x in step_one[arm]]) for arm in ARMS} for f in step_one["patched"][0]},
        },
        "metrics": metrics,
    }


def figures_of(size: str, trees: dict[str, Path], arms: dict[str, dict]) -> dict:
    """The figures (format: experiments.figures) from each arm's raw payload."""
    plan = arms["patched"]["plan"]
    runs = {arm: arms[arm]["runs"] for arm in ARMS}
    pretrain = arms["unpatched"]["pretrain"]
    return {
        "key": patch_key(),
        "size": size,
        "plan": plan,
        "model": {
            "spec": "megatron-core GPTModel, local spec + MTP block, fp32, CPU; SFT steps via Bridge's forward_step",
            "parameters": pretrain[0]["num_parameters"],
            "mtp_num_layers": pretrain[0]["mtp_num_layers"],
            "mtp_loss_scaling_factor": pretrain[0]["mtp_loss_scaling_factor"],
        },
        "arms": {
            arm: {
                "tree": str(trees[arm]),
                "gpt_step_file": arms[arm]["gpt_step_file"],
                "pretrained_weights_sha256": [p["weights_sha256"] for p in arms[arm]["pretrain"]],
                "sft_data_sha256": [r["data_sha256"] for r in runs[arm]],
                "fine_tuned_weights_sha256": [r["weights_sha256"] for r in runs[arm]],
                **{key: arms[arm][key] for key in ("import_seconds", "pretrain_seconds", "fine_tune_seconds")},
                "peak_rss_mib": arms[arm]["peak_rss_mib"],
            }
            for arm in ARMS
        },
        "same_pretrained_weights": len({tuple(p["weights_sha256"] for p in arms[a]["pretrain"]) for a in ARMS}) == 1,
        "same_data": len(
            {(*(p["data_sha256"] for p in arms[a]["pretrain"]), *(r["data_sha256"] for r in runs[a])) for a in ARMS}
        )
        == 1,
        "pretrain": [
            {
                "seed": seed,
                "lm_loss_first": p["lm_loss_first"],
                "lm_loss_last": p["lm_loss_last"],
                "lm_top1": _ratio(p["held_out"], "lm_hits", "lm_counted"),
                "mtp_top1": _ratio(p["held_out"], "mtp_hits", "mtp_counted"),
            }
            for seed, p in zip(plan["seeds"], pretrain)
        ],
        "settings": {
            setting: _setting_figures(
                setting, {arm: [r for r in runs[arm] if r["setting"] == setting] for arm in ARMS}, plan["eval_steps"]
            )
            for setting in plan["settings"]
        },
    }


def _plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = figures["settings"]
    rows = ("teacher-forced", "speculative", "tokens-per-step")
    fig, axes = plt.subplots(len(rows), len(settings), figsize=(4.6 * len(settings), 8), squeeze=False, sharex=True)
    colors = {"unpatched": "tab:red", "patched": "tab:blue"}
    for column, (setting, data) in enumerate(settings.items()):
        for row, metric in enumerate(rows):
            ax, curves = axes[row, column], data["metrics"][metric]
            for arm in ARMS:
                means = [spread(v)["mean"] for v in curves[arm]]
                means = [math.nan if m is None else m for m in means]
                ax.plot(curves["steps"], means, marker="o", ms=3, color=colors[arm], label=arm)
                for s in range(len(curves[arm][0])):
                    seed = [math.nan if v[s] is None else v[s] for v in curves[arm]]
                    ax.plot(curves["steps"], seed, color=colors[arm], alpha=0.2, lw=0.8)
            ax.grid(alpha=0.3)
            if column == 0:
                ax.set_ylabel(metric)
            if row == 0:
                ax.set_title(f"setting: {setting}", fontsize=10)
            if row == len(rows) - 1:
                ax.set_xlabel("SFT step")
    axes[0, 0].legend(title="mean over seeds (thin: each seed)", fontsize=8)
    fig.suptitle(
        "MTP depth 1 on held-out batches through SFT, same weights and batches in both arms\n" + run_label(figures),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def citations(figures: dict) -> dict:
    """The lines a text may cite, each with its setting, size and seeds: what `pr` reads (it imports no experiment)."""
    return {
        "summary": summary_line(figures),
        **{
            setting: {m: cite(figures, setting, m) for m in ("teacher-forced", "speculative")}
            for setting in figures["settings"]
        },
    }


def run_effect(out_dir: Path, size: str, trees: dict[str, Path] | None = None) -> dict:
    """Run both arms (one process each, at once), write out_dir/figures.json and out_dir/effect.png, return the
    figures. ``trees``: unpatched and patched trees (default: the pinned release and the view)."""
    return finish_effect(start_effect(out_dir, size, trees))


def start_effect(out_dir: Path, size: str, trees: dict[str, Path] | None = None) -> tuple:
    """Both arms started, not awaited (what finish_effect takes)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trees = trees or {"unpatched": release(pins()["megatron-bridge"]).root, "patched": VIEW}
    runs = [Launch("effect", trees[arm], 1, out_dir / "arms" / arm, ("--size", size)) for arm in ARMS]
    return out_dir, size, trees, time.perf_counter(), Started(runs, timeout=TIMEOUT_S[size])


def finish_effect(started_effect: tuple) -> dict:
    """Wait for both arms; write out_dir/figures.json and out_dir/effect.png; return the figures."""
    out_dir, size, trees, started, arms = started_effect
    payloads = {arm: ranks[0] for arm, ranks in zip(ARMS, arms.wait())}
    figures = figures_of(size, trees, payloads)
    figures["wall_seconds"] = time.perf_counter() - started
    figures["citations"] = citations(figures)
    text = json.dumps(figures, indent=1)
    (out_dir / "figures.json").write_text(text)
    figures = json.loads(text)  # exactly what the file holds (tuples become lists)
    _plot(figures, out_dir / "effect.png")
    return figures


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _diff(diff: dict | None) -> str:
    return "n < 2" if diff is None else f"{interval(diff)} (n={diff['n']})"


def format_tables(figures: dict) -> str:
    """Per setting: step 1 (CE by role, the logged figures), then each metric at the last step and to threshold."""
    plan, lines = figures["plan"], [f"== {run_label(figures)}"]
    pre = figures["pretrain"]
    lines.append(
        f"pretraining ({plan['pretrain_steps']} steps per seed): LM loss "
        f"{statistics.fmean(p['lm_loss_first'] for p in pre):.3f} -> {statistics.fmean(p['lm_loss_last'] for p in pre):.3f}, "
        f"held-out top-1 LM {statistics.fmean(p['lm_top1'] for p in pre):.3f}, "
        f"MTP {statistics.fmean(p['mtp_top1'] for p in pre):.3f} (mean over seeds); same pretrained weights in both "
        f"arms: {figures['same_pretrained_weights']}, same data: {figures['same_data']}"
    )
    width = 46
    for setting, data in figures["settings"].items():
        one = data["step_one"]
        mix = ", ".join(f"{name} {share:.1%}" for name, share in one["mix"].items())
        lines += ["", f"== setting {setting}: {data['description']}"]
        lines.append(f"SFT step 1 (same weights and batch in both arms), mean over seeds; MTP targets: {mix}")
        lines.append(f"{'':{width}}  {'unpatched':>10}  {'patched':>10}")
        for role in ROLES:
            cells = [_cell(one["mtp_ce_by_role"][role][arm]["mean"]) for arm in ARMS]
            lines.append(f"{'MTP CE on ' + role + ' targets':{width}}  {cells[0]:>10}  {cells[1]:>10}")
        for label, figure, fmt in STEP_ONE:
            cells = [fmt.format(one[figure][arm]["mean"]) for arm in ARMS]
            lines.append(f"{label:{width}}  {cells[0]:>10}  {cells[1]:>10}")
        lines.append(
            f"after {plan['sft_steps']} SFT steps (held out); patched - unpatched: mean [95 % t-interval, paired by "
            f"seed]; step from which it stays at {THRESHOLD_FRACTION:.0%} of the better final value or above"
        )
        lines.append(
            f"{'':{width}}  {'unpatched':>10}  {'patched':>10}  {'patched - unpatched':>32}  "
            f"{'steps to threshold (u / p; paired diff)'}"
        )
        for metric in TABLE_METRICS:
            row = data["metrics"][metric]
            final, reach = row["final"], row["to_threshold"]
            cells = [_cell(final[arm]["mean"]) for arm in ARMS]
            reached = " / ".join(
                f"{statistics.fmean(s for s in reach[arm] if s is not None):.0f}"
                if any(s is not None for s in reach[arm])
                else "-"
                for arm in ARMS
            )
            misses = sum(s is None for arm in ARMS for s in reach[arm])
            reached += f" ({misses} not reached)" if misses else ""
            lines.append(
                f"{metric:{width}}  {cells[0]:>10}  {cells[1]:>10}  {_diff(final['paired_diff']):>32}  "
                f"{reached}; {_diff(reach['paired_diff'])}"
            )
        lines.append(f"-> {data['conclusion']}")
    arms = figures["arms"]
    lines += [
        "",
        f"(wall {figures['wall_seconds']:.0f} s for both arms at once; per arm: "
        + ", ".join(
            f"{arm} import {arms[arm]['import_seconds']:.0f} s + pretrain {arms[arm]['pretrain_seconds']:.0f} s + "
            f"SFT {arms[arm]['fine_tune_seconds']:.0f} s, peak RSS {arms[arm]['peak_rss_mib']:.0f} MiB"
            for arm in ARMS
        )
        + ")",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """`./run effect [--plateau]`: run, print the tables and where the figures went."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plateau", action="store_true", help="run to a plateau (600 SFT steps; about 15 minutes)")
    size = "plateau" if parser.parse_args(argv).plateau else "short"
    out = effect_dir(size)
    figures = run_effect(out, size)
    print(format_tables(figures))
    print()
    for setting in figures["settings"]:
        print(cite(figures, setting))
    print(f"\nwrote {out / 'figures.json'} and {out / 'effect.png'} in {figures['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
