"""Paired comparisons over seeds, Holm's correction over a family of them, and how they are worded. No torch.

An interval and a p-value are given only from at least MIN_SEEDS seeds. A difference that is exactly the same in
every seed has a zero-width interval: p = 1 where it is 0, p = 0 where it is not (experiments/PLAN.md).
"""

import math
import statistics


MIN_SEEDS = 5  # fewer paired seeds: no interval
ALPHA = 0.05  # each family's family-wise error rate
DIGITS = 3  # what the tables print


def summary(values: list[float | None]) -> dict:
    """The values (None: a seed without one), and of those that exist n, mean, sd, the two-sided t-test's p, the 95 %
    t-interval (p and ci95 None from fewer than MIN_SEEDS) and how many are above and below 0."""
    from scipy.stats import t

    defined = [v for v in values if v is not None]
    n = len(defined)
    out = {
        "values": values,
        "n": n,
        "mean": statistics.fmean(defined) if defined else None,
        "sd": statistics.stdev(defined) if n > 1 else None,
        "p": None,
        "ci95": None,
        "above": sum(v > 0 for v in defined),
        "below": sum(v < 0 for v in defined),
    }
    if n >= MIN_SEEDS:
        if out["sd"] == 0:
            out["p"] = float(out["mean"] == 0)
        else:
            out["p"] = float(2 * t.sf(abs(out["mean"]) / (out["sd"] / math.sqrt(n)), n - 1))
        out["ci95"] = t_interval(out, 0.95)
    return out


def t_interval(s: dict, confidence: float) -> list[float]:
    """The t-interval of the mean of a summary at that confidence."""
    from scipy.stats import t

    half = t.ppf(0.5 + confidence / 2, s["n"] - 1) * s["sd"] / math.sqrt(s["n"])
    return [s["mean"] - half, s["mean"] + half]


def paired(control: list[float | None], treatment: list[float | None]) -> dict:
    """Treatment - control per seed (where both exist), summarised."""
    return summary([None if c is None or t is None else t - c for c, t in zip(control, treatment)])


def holm(family: list[dict]) -> None:
    """Add to each summary of the family its Holm-adjusted p-value and the interval at the level Holm tests it at."""
    # Rank j (p ascending) is tested at ALPHA / (m - j + 1) until the first one not rejected (rank k); from there on
    # every interval is at k's level, so each adjusted interval excludes 0 exactly when Holm rejects.
    ranked = sorted(family, key=lambda s: 1.0 if s["p"] is None else s["p"])
    adjusted, stop = 0.0, None
    for rank, s in enumerate(ranked, 1):
        m = len(ranked) - rank + 1
        adjusted = max(adjusted, min(1.0, m * (1.0 if s["p"] is None else s["p"])))
        stop = stop or (rank if adjusted >= ALPHA else None)
        confidence = 1 - ALPHA / (len(ranked) - min(rank, stop or rank) + 1)
        interval = None if s["p"] is None else t_interval(s, confidence)
        s["holm"] = {"p": adjusted, "confidence": confidence, "interval": interval}


def verdict(s: dict, treatment: str) -> str:
    """'for T' / 'against T' where the Holm-adjusted interval excludes 0, 'no difference' where it holds 0."""
    if s["holm"]["interval"] is None:
        return "no interval"
    low, high = s["holm"]["interval"]
    return f"for {treatment}" if low > 0 else f"against {treatment}" if high < 0 else "no difference"


def size(s: dict, smallest: float) -> str:
    """What the Holm-adjusted interval settles about the difference's size against the smallest one cared about:
    'within +-d' (all of it smaller), 'at least d' (all of it as large or larger), '' (neither)."""
    if s["holm"]["interval"] is None:
        return ""
    low, high = s["holm"]["interval"]
    if -smallest < low and high < smallest:
        return f"within +-{smallest:g}"
    return f"at least {smallest:g}" if low >= smallest or high <= -smallest else ""


def interval(s: dict, adjusted: bool = False) -> str:
    """mean [95 % interval, or the Holm-adjusted one], or the mean with why there is none."""
    if s["mean"] is None:
        return "no value"
    bounds = s["holm"]["interval"] if adjusted else s["ci95"]
    if bounds is None:
        return f"{s['mean']:+.{DIGITS}f} (n = {s['n']} < {MIN_SEEDS}: no interval)"
    low, high = bounds
    return f"{s['mean']:+.{DIGITS}f} [{low:+.{DIGITS}f}, {high:+.{DIGITS}f}]"


def signs(s: dict, up: str = "higher", down: str = "lower") -> str:
    """How many seeds went each way."""
    same = s["n"] - s["above"] - s["below"]
    return f"{up} in {s['above']}, {down} in {s['below']}" + (f", equal in {same}" if same else "") + f" of {s['n']}"
