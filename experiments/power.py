"""The power calculations of experiments/PLAN.md, from the recorded runs in experiments/results/ only: the second
plan's table (seeds 0-9 and 50-59) and the size of the course run (its amendment).

    .venv/bin/python -m experiments.power [--table plan|course]   prints the table(s) as PLAN.md holds them

Each contrast is a two-sided paired t-test over n seeds; its power at a true difference d is exact, from the
noncentral t with n - 1 degrees of freedom and noncentrality d / (SD / sqrt n). Holm's power is bounded below by
Bonferroni's, so a family of m contrasts is powered at 0.05 / m. The SD of a contrast is pooled within the runs it
comes from (each run's own mean taken out). "Seeds for 80 %" is the smallest n with power >= 0.8, and never fewer
than experiments.stats.MIN_SEEDS (below it no interval is given).
"""

import argparse
import json
import math
import statistics
from functools import cache
from pathlib import Path

from experiments.command import seeds
from experiments.design import COURSE, COURSE_STEPS, PRIMARY, SIZES, SMALLEST
from experiments.stats import ALPHA, MIN_SEEDS


RESULTS = Path(__file__).parent / "results"
TARGET = 0.8  # the power a plan sizes its run for
OTHER = 0.05  # a smaller difference, whose power is said beside SMALLEST's
WIDER = 1.2  # the sensitivity line: the power at n if every SD were this many times the one taken


def power(n: int, difference: float, sd: float, alpha: float) -> float:
    """The chance a two-sided paired t-test over n seeds at level alpha rejects, at that true mean difference."""
    from scipy.stats import nct, t

    df, crit = n - 1, t.ppf(1 - alpha / 2, n - 1)
    noncentrality = difference / (sd / math.sqrt(n))
    below = nct.cdf(-crit, df, noncentrality)  # the far tail: nan where it underflows
    return float(nct.sf(crit, df, noncentrality) + (0.0 if math.isnan(below) else below))


def seeds_for(difference: float, sd: float, alpha: float) -> int:
    """The fewest seeds (at least MIN_SEEDS) whose power at that difference reaches TARGET."""
    n = max(MIN_SEEDS, 2)
    while power(n, difference, sd, alpha) < TARGET:
        n += 1
    return n


def pooled_sd(runs: list[list[float | None]]) -> float:
    """The SD pooled within runs: each run's squared deviations from its own mean, over their degrees of freedom."""
    runs = [[v for v in values if v is not None] for values in runs]
    squares = sum((len(v) - 1) * statistics.variance(v) for v in runs)
    return math.sqrt(squares / sum(len(v) - 1 for v in runs))


@cache
def _figures(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def differences(run: str, setting: str, contrast: str, metric: str) -> list[float | None]:
    """The per-seed paired differences a recorded run holds for one contrast on one metric."""
    contrasts = _figures(run)["settings"][setting]["contrasts"]
    return next(c for c in contrasts if c["name"] == contrast)[metric]["values"]


def _row(label: str, values: list[float] | None, sd: float, m: int, n: int) -> str:
    mean = f"{statistics.fmean(values):+.3f}" if values else ""
    powers = " | ".join(f"{power(n, d, sd, ALPHA / m):.3f}" for d in (SMALLEST, OTHER))
    return f"| {label} | {mean} | {sd:.4f} | {seeds_for(SMALLEST, sd, ALPHA / m)} | {powers} |"


# The second plan's table: (label, setting, contrast, metric, family size). Its input: seeds 0-9 and 50-59.
PLAN_RUNS = ("seeds-0-9", "seeds-50-59")
PLAN_N = len(seeds(SIZES["short"].seeds))
PLAN_ROWS = [
    ("the fix, short/first (tokens/step)", "same-language short/first", "the fix", PRIMARY, 7),
    ("the fix, long/second", "same-language long/second", "the fix", PRIMARY, 7),
    ("the fix, distinct-answers", "distinct-answers", "the fix", PRIMARY, 7),
    ("the fix, padding-only", "padding-only", "the fix", PRIMARY, 7),
    ("the fix, short/second (teacher-forced top-1)", "same-language short/second", "the fix", "teacher-forced", 7),
    ("the fix, long/first (teacher-forced top-1)", "same-language long/first", "the fix", "teacher-forced", 7),
    ("padding's part, short/first", "same-language short/first", "padding's part", PRIMARY, 6),
    ("prompt's part, short/first", "same-language short/first", "prompt's part", PRIMARY, 6),
    ("padding's part, long/second", "same-language long/second", "padding's part", PRIMARY, 6),
    ("prompt's part, long/second", "same-language long/second", "prompt's part", PRIMARY, 6),
]


def plan_table() -> list[str]:
    """The second plan's power table, recomputed; report-like (not yet run then) at the largest SD of the table."""
    lines = [
        f"| contrast (endpoint) | mean over 20 seeds | pooled SD | seeds for 80 % at {SMALLEST} | power at n = {PLAN_N}, "
        f"{SMALLEST} | at {OTHER} |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    largest = 0.0
    for label, setting, contrast, metric, m in PLAN_ROWS:
        runs = [differences(run, setting, contrast, metric) for run in PLAN_RUNS]
        sd = pooled_sd(runs)
        largest = max(largest, sd if metric == PRIMARY else 0.0)
        lines.append(_row(label, [v for values in runs for v in values if v is not None], sd, m, PLAN_N))
    lines.append(
        _row(f"the fix, report-like (no runs: SD taken as the largest, {largest:.3f})", None, largest, 7, PLAN_N)
    )
    lines.append(_row("padding's and prompt's part, report-like (the same SD)", None, largest, 6, PLAN_N))
    return lines


# The course run (the amendment): the fix on tokens per verify step in each setting at each decoded SFT step, one Holm
# family; its weight's and its positions' parts, another. Input: the SD of the fix at 50 SFT steps (seeds 100-161)
# and at 600 (seeds 100-115, the plateau run: three settings), the larger taken for every step; a part takes the
# largest of that and the SDs of the split's parts at 50 steps (which exceeded the fix's in report-like).
COURSE_RUNS = {50: "seeds-100-161", 600: "plateau-100-115"}
SPLIT_PARTS = ("padding's part", "prompt's part")


def _sd(run: str, setting: str, contrast: str) -> float | None:
    """The SD of a contrast on tokens per verify step in a recorded run (None: not run there)."""
    contrasts = _figures(run)["settings"].get(setting, {}).get("contrasts", [])
    return (
        pooled_sd([differences(run, setting, contrast, PRIMARY)])
        if any(c["name"] == contrast for c in contrasts)
        else None
    )


def course_table(settings: tuple[str, ...], steps: tuple[int, ...]) -> tuple[list[str], int]:
    """The course run's power table, and the n it sizes: the largest of its rows' seeds for 80 % at SMALLEST in the
    fix's family."""
    families = {"the fix": len(settings) * len(steps), "each part": 2 * len(settings) * len(steps)}
    fix = {setting: {step: _sd(run, setting, "the fix") for step, run in COURSE_RUNS.items()} for setting in settings}
    parts = {setting: [_sd(COURSE_RUNS[50], setting, part) for part in SPLIT_PARTS] for setting in settings}
    taken = {}
    for setting in settings:
        largest = max(sd for sd in fix[setting].values() if sd is not None)
        taken[setting] = {"the fix": largest, "each part": max([largest] + [sd for sd in parts[setting] if sd])}
    n = max(seeds_for(SMALLEST, sds["the fix"], ALPHA / families["the fix"]) for sds in taken.values())
    lines = [
        f"| setting | SD of the fix at step 50 | at step 600 | of the split's parts at step 50 | family (m) | SD taken | "
        f"seeds for 80 % at {SMALLEST} | power at n = {n}, {SMALLEST} | at {OTHER} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    shown = lambda sd: "not run" if sd is None else f"{sd:.4f}"
    for setting in settings:
        split = ", ".join(map(shown, parts[setting])) if any(parts[setting]) else "not run"
        measured = [shown(fix[setting][step]) for step in COURSE_RUNS] + [split]
        for family, m in families.items():
            sd = taken[setting][family]
            powers = " | ".join(f"{power(n, d, sd, ALPHA / m):.3f}" for d in (SMALLEST, OTHER))
            lines.append(
                f"| `{setting}` | {' | '.join(measured)} | {family} ({m}) | {sd:.4f} | "
                f"{seeds_for(SMALLEST, sd, ALPHA / m)} | {powers} |"
            )
    widest = {family: max(sds[family] for sds in taken.values()) for family in families}
    lines.append(
        f"If every SD were {WIDER:g} x the one taken, n = {n} would have power at {SMALLEST}, where it is largest: "
        + ", ".join(
            f"{power(n, SMALLEST, WIDER * widest[family], ALPHA / m):.3f} ({family}, SD {widest[family]:.4f})"
            for family, m in families.items()
        )
        + "."
    )
    return lines, n


def main(argv: list[str] | None = None) -> None:
    """Print the tables asked for."""
    parser = argparse.ArgumentParser(prog="python -m experiments.power", description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=("plan", "course"), help="only this table (default both)")
    args = parser.parse_args(argv)
    if args.table in (None, "plan"):
        print(f"the second plan's table (from {', '.join(PLAN_RUNS)}):", *plan_table(), sep="\n")
    if args.table in (None, "course"):
        lines, n = course_table(COURSE, COURSE_STEPS)
        print(f"the course run (from {', '.join(COURSE_RUNS.values())}): n = {n}", *lines, sep="\n")


if __name__ == "__main__":
    main()
