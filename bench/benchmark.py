"""Benchmark the functional suites and the effect run against their targets: wall time per suite, peak RSS per rank,
the effect's wall time, and the patched/unpatched step-time ratio.

Run as ``.venv/bin/python bench/benchmark.py`` (add ``--no-effect`` to skip the ~2-minute full effect run). Each
suite is one pytest session of tests/functional on the view, selected with -k. Prints each figure next to its target
and whether it is met; never fails on a miss. Timings depend on what else runs: the load average is printed too.
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SUITES = (  # (label, pytest -k selection, target seconds); the multi-rank ones start their workers themselves
    ("1 rank (in the pytest process)", "not (TensorParallel2 or pipeline or ExpertParallel2 or effect)", 30.0),
    ("TP2 (torchrun, 2 ranks)", "TensorParallel2", 45.0),
    ("PP2 (torchrun, 2 ranks)", "pipeline", 45.0),
    ("EP2 (torchrun, 2 ranks)", "ExpertParallel2", 45.0),
    ("effect, small (2 arms at once)", "effect", 45.0),
)
RSS_TARGET_MIB = 1024.0
EFFECT_TARGET_S = 180.0
RATIO_TOLERANCE = 0.10  # "about 1.0": within 10 % either way, CPU timing noise on 2 cores included


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def _load() -> str:
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _suite(selection: str, basetemp: Path) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MiB of the largest process in the session, pytest's summary line)."""
    command = [sys.executable, "-m", "pytest", "tests/functional", "-q", "-p", "no:cacheprovider", "-k", selection]
    command += ["--basetemp", str(basetemp)]
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # its rusage: the session and every process it waited for
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        lines = log.read().strip().splitlines()
    summary = lines[-1].strip("= ") if lines else f"exit {proc.returncode}"
    return seconds, usage.ru_maxrss / 1024, summary  # Linux reports KiB


def _worker_rss(basetemp: Path) -> list[str]:
    """Peak RSS of every worker rank the session ran (each saved it in its rank<r>.pt)."""
    import torch

    found = []
    for path in sorted(basetemp.rglob("rank*.pt")):
        payload = torch.load(path, weights_only=False)
        found.append((f"{path.parent.name}/rank {payload['rank']}", payload["peak_rss_mib"]))
    return found


def _print_rss(label: str, figures: list[tuple[str, float]]) -> None:
    if not figures:
        return
    text = ", ".join(f"{name} {mib:.0f} MiB" for name, mib in figures)
    met = max(mib for _, mib in figures) <= RSS_TARGET_MIB
    print(f"  {label:<32} {text}    target <= {RSS_TARGET_MIB:.0f} MiB/rank    {_verdict(met)}", flush=True)


def _effect() -> None:
    from experiments.effect import run_effect

    with tempfile.TemporaryDirectory(prefix="mtp-bench-effect-") as tmp:
        start = time.perf_counter()
        figures = run_effect(Path(tmp), "full")
        seconds = time.perf_counter() - start
    print(
        f"{'effect, full':<34} {seconds:8.1f} s    target <= {EFFECT_TARGET_S:.0f} s    "
        f"{_verdict(seconds <= EFFECT_TARGET_S)}",
        flush=True,
    )
    arms = figures["arms"]
    _print_rss("peak RSS per arm", [(arm, arms[arm]["peak_rss_mib"]) for arm in arms])


def _step_time(steps: int) -> None:
    """Median fwd+bwd step of the tiny model, patched and unpatched, one process each at once (one core each)."""
    from mtp_mask_fix.patch import VIEW
    from mtp_mask_fix.targets import pins, release
    from tests.support.worker import Launch, launch_all

    trees = {"patched": VIEW, "unpatched": release(pins()["megatron-bridge"]).root}
    with tempfile.TemporaryDirectory(prefix="mtp-bench-step-") as tmp:
        runs = [Launch("bench", tree, 1, Path(tmp) / arm, ("--steps", str(steps))) for arm, tree in trees.items()]
        median = {arm: ranks[0]["median_step_s"] for arm, ranks in zip(trees, launch_all(runs))}
    ratio = median["patched"] / median["unpatched"]
    print(
        f"{'step time patched/unpatched':<34} median of {steps} fwd+bwd: {median['patched'] * 1e3:.1f} ms / "
        f"{median['unpatched'] * 1e3:.1f} ms = {ratio:.3f}    target ~1.0 (+-{RATIO_TOLERANCE:.0%})    "
        f"{_verdict(abs(ratio - 1) <= RATIO_TOLERANCE)}",
        flush=True,
    )


def main() -> None:
    """Measure and print; exit status 0 whatever the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed forward+backward steps per tree")
    parser.add_argument("--no-effect", action="store_true", help="skip the full effect run (about 2 minutes)")
    args = parser.parse_args()
    print(f"functional suites on the view (src/); {_load()}", flush=True)
    for label, selection, target in SUITES:
        with tempfile.TemporaryDirectory(prefix="mtp-bench-") as tmp:
            seconds, session_rss, summary = _suite(selection, Path(tmp) / "pytest")
            print(
                f"{label:<34} {seconds:8.1f} s    target <= {target:.0f} s    {_verdict(seconds <= target)}  "
                f"[{summary}]",
                flush=True,
            )
            _print_rss("peak RSS per worker rank", _worker_rss(Path(tmp) / "pytest"))
            _print_rss("peak RSS, largest process", [("pytest session or one of its workers", session_rss)])
    if not args.no_effect:
        _effect()
    _step_time(args.steps)
    print(_load(), f"(this process's children used {resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime:.0f} s CPU)")


if __name__ == "__main__":
    main()
