"""Benchmark the test suite against its budget (CONTRIBUTING.md: at most 120 s warm): the whole suite's wall time, each
layer's share, peak RSS per worker rank, and the patched/unpatched step-time ratio of the tiny model.

Run as ``.venv/bin/python bench/benchmark.py`` after ``./run setup`` (the environment and the view exist: "warm").
One pytest session of the whole suite, as ``./run test`` runs it; each layer's time is the sum of its tests' junit
times (setup, call and teardown, module fixtures included), which add up to the wall time since tests run one after
another. Next to the wall time, the CPU-seconds (user + sys) of the suite's whole process tree: this process is a
subreaper, so sessions, zygotes, forkservers and ranks that outlive their parent are counted too; on 2 cores, half of
it is the least wall time any schedule could reach, and it depends far less than wall time on what else runs.
``--layers`` adds each layer's CPU-seconds, measured as a session of its own (its background sessions included).
Prints each figure next to its target; never fails on a miss. Timings depend on what else runs: the load average is
printed before and after.
"""

import argparse
import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SUITE_TARGET_S = 120.0
LAYERS = (  # (label, nodeid prefix), first match wins
    ("unit (tests/unit_tests, the view)", "tests/unit_tests/"),
    ("functional, 1 rank", "tests/functional/test_mtp_loss_mask.py"),
    ("functional, PP2", "tests/functional/test_mtp_pipeline_parallel.py"),
    ("functional, MoE with EP2", "tests/functional/test_mtp_moe.py"),
    ("functional, acceptance rate", "tests/functional/test_mtp_acceptance_rate.py"),
    ("functional, effect", "tests/functional/test_mtp_effect.py"),
    ("tool (the route per release line included)", "tests/tool/"),
    ("maintain", "tests/maintain/"),
    ("red/green (the base's session)", "tests/test_red_green.py"),
    ("wrong fixes", "tests/test_wrong_fixes.py"),
    ("workflows lint", "tests/test_workflows.py"),
    ("layout", "tests/test_layout.py"),
    ("watch on the tiny model", "tests/watch/"),
)
RSS_TARGET_MIB = 1024.0
RATIO_TOLERANCE = 0.10  # "about 1.0": within 10 % either way, CPU timing noise on 2 cores included


def _load() -> str:
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


# Run as separate sessions by --layers: (label, pytest arguments). red/green's own cost is the difference between
# its session and the view's, which it reads.
LAYER_SESSIONS = (
    ("unit + functional (the view)", ("tests/unit_tests", "tests/functional")),
    ("  + red/green (base session)", ("tests/unit_tests", "tests/functional", "tests/test_red_green.py")),
    ("wrong fixes", ("tests/test_wrong_fixes.py",)),
    ("tool", ("tests/tool",)),
    ("maintain", ("tests/maintain",)),
    ("workflows lint", ("tests/test_workflows.py",)),
)


def _children_cpu() -> float:
    """user + sys of every waited-for descendant so far (orphans included: this process is their subreaper)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reap_orphans() -> None:
    """Wait for every descendant that outlived its parent (a forkserver, a zygote): their CPU then counts."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _session(args: tuple[str, ...], basetemp: Path, junit: Path | None = None) -> tuple[float, float, str]:
    """(wall s, CPU s of the whole process tree, pytest's summary line) of one pytest session."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(basetemp), *args]
    cpu, start = _children_cpu(), time.perf_counter()
    done = subprocess.run(
        [*command, *([f"--junitxml={junit}"] if junit else [])], cwd=REPO, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    _reap_orphans()
    lines = done.stdout.strip().splitlines()
    return seconds, _children_cpu() - cpu, lines[-1].strip("= ") if lines else f"exit {done.returncode}"


def _layers(junit: Path) -> dict[str, float]:
    times = defaultdict(float)
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        label = next((label for label, prefix in LAYERS if path.startswith(prefix.removesuffix(".py"))), "other")
        times[label] += float(case.get("time", 0))
    return times


def _worker_rss(basetemp: Path) -> list[tuple[str, float]]:
    """Peak RSS of every worker rank the session ran (each saved it in its rank<r>.pt)."""
    import torch

    return [
        (f"{path.parent.name}/rank {payload['rank']}", payload["peak_rss_mib"])
        for path in sorted(basetemp.rglob("rank*.pt"))
        for payload in [torch.load(path, weights_only=False)]
    ]


def _step_time(steps: int) -> None:
    """Median fwd+bwd step of the tiny model, patched and unpatched, one process each at once (one core each)."""
    from maintain.repo import VIEW, pins, release
    from tinymodel.worker import Launch, launch_all

    trees = {"patched": VIEW, "unpatched": release(pins()["megatron-bridge"]).root}
    with tempfile.TemporaryDirectory(prefix="mtp-bench-step-") as tmp:
        runs = [Launch("bench", tree, 1, Path(tmp) / arm, ("--steps", str(steps))) for arm, tree in trees.items()]
        median = {arm: ranks[0]["median_step_s"] for arm, ranks in zip(trees, launch_all(runs))}
    ratio = median["patched"] / median["unpatched"]
    print(
        f"{'step time patched/unpatched':<40} median of {steps} fwd+bwd: {median['patched'] * 1e3:.1f} ms / "
        f"{median['unpatched'] * 1e3:.1f} ms = {ratio:.3f}    target ~1.0 (+-{RATIO_TOLERANCE:.0%})    "
        f"{_verdict(abs(ratio - 1) <= RATIO_TOLERANCE)}"
    )


def main() -> None:
    """Measure and print; exit status 0 whatever the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed forward+backward steps per tree")
    parser.add_argument("--layers", action="store_true", help="also each layer's CPU-seconds, a session each")
    args = parser.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us
    print(f"the whole suite, warm, one session; {_load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mtp-bench-") as tmp:
        seconds, cpu, summary = _session((), Path(tmp) / "pytest", Path(tmp) / "junit.xml")
        print(
            f"{'suite':<40} {seconds:7.1f} s    target <= {SUITE_TARGET_S:.0f} s    {_verdict(seconds <= SUITE_TARGET_S)}"
        )
        print(f"  [{summary}]")
        print(f"  {'CPU-seconds, whole process tree':<38} {cpu:7.1f} s    (/ 2 cores = {cpu / 2:.0f} s; {_load()})")
        for label, layer in sorted(_layers(Path(tmp) / "junit.xml").items(), key=lambda item: -item[1]):
            print(f"  {label:<38} {layer:7.1f} s")
        rss = _worker_rss(Path(tmp) / "pytest")
        if rss:
            worst = max(mib for _, mib in rss)
            print(
                f"{'peak RSS, largest worker rank':<40} {worst:7.0f} MiB  of {len(rss)} ranks    "
                f"target <= {RSS_TARGET_MIB:.0f} MiB    {_verdict(worst <= RSS_TARGET_MIB)}"
            )
    if args.layers:
        print(f"each layer as a session of its own (CPU-seconds of its whole process tree, then wall); {_load()}")
        with tempfile.TemporaryDirectory(prefix="mtp-bench-layers-") as tmp:
            for index, (label, layer_args) in enumerate(LAYER_SESSIONS):
                seconds, cpu, summary = _session(layer_args, Path(tmp) / str(index))
                print(f"  {label:<38} {cpu:7.1f} CPU-s {seconds:7.1f} s    [{summary}]", flush=True)
    _step_time(args.steps)
    print(_load(), flush=True)


if __name__ == "__main__":
    main()
