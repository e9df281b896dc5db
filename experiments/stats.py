"""Paired comparisons over seeds, and how they are worded: the t-interval, sign counts and a verdict. No torch.

An interval is given only where it means something: from at least MIN_SEEDS seeds whose values differ at the printed
precision; otherwise the line says which of the two it lacks.
"""

import math
import statistics


MIN_SEEDS = 5  # fewer paired seeds: no interval
DIGITS = 3  # what the tables print: values closer than RESOLUTION are the same there (no spread, no sign)
RESOLUTION = 0.5 * 10**-DIGITS


def summary(values: list[float | None]) -> dict:
    """Mean, sd (n - 1) and the 95 % t-interval of the mean of the values that exist (n of them), with the values and
    how many are above and below zero at the printed precision. ``ci95`` None: no interval (n < MIN_SEEDS, or no
    spread)."""
    from scipy.stats import t

    defined = [v for v in values if v is not None]
    n = len(defined)
    out = {
        "values": values,
        "n": n,
        "mean": statistics.fmean(defined) if defined else None,
        "sd": statistics.stdev(defined) if n > 1 else None,
        "ci95": None,
        "above": sum(v >= RESOLUTION for v in defined),
        "below": sum(v <= -RESOLUTION for v in defined),
    }
    if n >= MIN_SEEDS and not _no_spread(defined):
        half = t.ppf(0.975, n - 1) * out["sd"] / math.sqrt(n)
        out["ci95"] = [out["mean"] - half, out["mean"] + half]
    return out


def paired(control: list[float | None], treatment: list[float | None]) -> dict:
    """Treatment - control per seed (where both exist), summarised."""
    return summary([None if c is None or t is None else t - c for c, t in zip(control, treatment)])


def _no_spread(values: list[float]) -> bool:
    return max(values) - min(values) < RESOLUTION


def interval(s: dict) -> str:
    """mean [95 % interval], or the mean with why there is none."""
    if s["mean"] is None:
        return "no value"
    mean = f"{s['mean'] if abs(s['mean']) >= RESOLUTION else 0.0:+.{DIGITS}f}"
    if s["ci95"] is not None:
        low, high = s["ci95"]
        return f"{mean} [{low:+.{DIGITS}f}, {high:+.{DIGITS}f}]"
    if s["n"] >= MIN_SEEDS:
        return f"{mean} in all {s['n']} seeds (no spread, no interval)"
    return f"{mean} (n = {s['n']} < {MIN_SEEDS}: no interval)"


def signs(s: dict, up: str = "higher", down: str = "lower") -> str:
    """How many seeds went each way."""
    same = s["n"] - s["above"] - s["below"]
    return (
        f"{up} in {s['above']}, {down} in {s['below']}"
        + (f", equal in {same}" if same else "")
        + f" of {s['n']} seeds"
    )


def verdict(s: dict, treatment: str) -> str:
    """'for T' / 'against T' where the interval excludes 0, 'no difference shown' where it holds 0; else why none."""
    if s["ci95"] is None:
        return "no interval"
    low, high = s["ci95"]
    return f"for {treatment}" if low > 0 else f"against {treatment}" if high < 0 else "no difference shown"
