"""Print the suite's time per tier, the tiny model's peak memory per rank, and its step-time ratios.

    .venv/bin/python bench/benchmark.py [--setup] [--tiers push all] [--rounds 5] [--steps 50]
    .venv/bin/python bench/benchmark.py --effect [ARGS]   only `./run effect ARGS`: its wall time and CPU-seconds

Run it after `./run setup` (warm). Each tier is one pytest session as `./run test` runs it: its wall time, and the
CPU-seconds of its whole process tree (this process is a subreaper, so orphans count), which depend far less than
wall time on what else runs; pytest's own `--durations` names its slowest steps. The ratios come from interleaved
rounds (unpatched, patched and patched under `mtp-mask-fix watch`, each a fresh one-rank process running the median
of --steps forward+backward steps at hidden 128 on 128 positions, and of a tenth as many at hidden 256 on 1,024
positions, wall and CPU time), quoted as the median over rounds with its range. Processes differ by several per cent
whatever runs in them, so the watched process also alternates its steps with watch's wrappers taken out: the median
CPU ratio of those pairs is watch's cost per step without that difference. Nothing here fails on a figure.
"""

import argparse
import ctypes
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TIERS = {"push": (), "all": ("--all",)}
SHAPES = ((128, 128, 1), (256, 1024, 10))  # hidden size, positions, and how many times fewer steps than --steps


def _load() -> str:
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reap_orphans() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def tier(name: str) -> None:
    """Print one tier's wall time, CPU-seconds, summary line and slowest steps."""
    cpu, start = _children_cpu(), time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *TIERS[name]]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    _reap_orphans()
    lines = done.stdout.strip().splitlines()
    slowest = [line for line in lines if line.split(" ", 1)[0].endswith("s") and "::" in line]
    print(f"tier {name}: {wall:.1f} s wall, {_children_cpu() - cpu:.1f} CPU-s; {lines[-1].strip('= ')}; {_load()}")
    print("".join(f"  {line}\n" for line in slowest), end="", flush=True)


def setup() -> None:
    """Print the wall and CPU time of `./run setup` in a fresh clone of HEAD, uv's cache as it is (warm after a run)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), tmp], check=True)
        cpu, start = _children_cpu(), time.perf_counter()
        done = subprocess.run([f"{tmp}/run", "setup"], capture_output=True, text=True)
        wall = time.perf_counter() - start
        _reap_orphans()
    said = [line for line in done.stderr.splitlines() if "compiled" in line or "ready in" in line]
    print(
        f"setup of a fresh clone: {wall:.1f} s wall, {_children_cpu() - cpu:.1f} CPU-s, exit {done.returncode}; {_load()}"
    )
    print("".join(f"  {line.strip()}\n" for line in said), end="", flush=True)


def _run(mode: str, tree: Path, ranks: int, *args: str, watched: bool = False) -> list[dict]:
    """Each rank's payload of one worker run, under `mtp-mask-fix watch` if `watched`."""
    import torch

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "tinymodel.worker", mode, "--ranks", str(ranks), "--out", out, *args]
        command = [sys.executable, "-m", "mtp_mask_fix", "watch", "--", *command] if watched else command
        # TMPDIR of its own: watch's folder, where its processes report, is no one else's to clean up.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]), TMPDIR=out)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if not (Path(out) / "rank0.pt").exists():
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def memory() -> None:
    """Print the peak RSS of each rank of the PP2 proof's run and of a one-rank step."""
    from maintain.repo import VIEW

    for name, ranks in (("pipeline", 2), ("bench", 1)):
        for payload in _run(name, VIEW, ranks, *(("--steps", "3") if name == "bench" else ())):
            print(f"peak RSS, {name} on {ranks} rank(s), rank {payload['rank']}: {payload['peak_rss_mib']:.0f} MiB")


def ratios(rounds: int, steps: int) -> None:
    """Print the patched/unpatched and watched/patched step-time ratios (wall and CPU) at each of SHAPES, the arms
    interleaved round by round."""
    from maintain.repo import VIEW, pins, release

    arms = {"unpatched": (release(pins()["megatron-bridge"]).root, False), "patched": (VIEW, False)}
    arms["watched"] = (VIEW, True)
    for hidden, seq, share in SHAPES:
        found = {
            f"{pair} ({clock})": [] for pair in ("patched/unpatched", "watched/patched") for clock in ("wall", "CPU")
        }
        paired = []  # per round, the median CPU ratio of the watched process's steps with and without the wrappers
        shape = ("--steps", str(max(3, steps // share)), "--hidden", str(hidden), "--seq", str(seq))
        for round_ in range(rounds):
            order = list(arms)[round_ % 3 :] + list(arms)[: round_ % 3]  # each arm first in turn
            step = {arm: _run("bench", arms[arm][0], 1, *shape, watched=arms[arm][1])[0] for arm in order}
            for name in found:
                (top, bottom), key = (
                    name.split(" ")[0].split("/"),
                    "median_step_cpu_s" if "CPU" in name else "median_step_s",
                )
                found[name].append(step[top][key] / step[bottom][key])
            times = (
                f"{arm} {step[arm]['median_step_s'] * 1e3:.2f} ms ({step[arm]['median_step_cpu_s'] * 1e3:.2f} CPU)"
                for arm in arms
            )
            print(f"hidden {hidden} on {seq} positions, round {round_ + 1}: " + ", ".join(times), flush=True)
            paired.append(step["watched"]["paired_cpu_ratio"])
        found["watched/unwatched paired in one process (CPU)"] = paired
        for name, values in found.items():
            median = statistics.median(values)
            print(
                f"hidden {hidden} on {seq} positions, {name}: median {median:.3f} (range {min(values):.3f} to {max(values):.3f})"
            )


def effect(args: list[str]) -> None:
    """Run `./run effect ARGS` as a user does (its output passes through), its seeds kept in a folder emptied first so
    that none is reused; print its wall time, its CPU-seconds and the load."""
    keep = REPO / ".work" / "bench-effect"
    shutil.rmtree(keep, ignore_errors=True)
    cpu, start, load = _children_cpu(), time.perf_counter(), _load()
    done = subprocess.run([str(REPO / "run"), "effect", "--keep", str(keep), *args], cwd=REPO)
    wall = time.perf_counter() - start
    _reap_orphans()
    print(
        f"./run effect {' '.join(args)}: exit {done.returncode}, {wall:.0f} s wall, {_children_cpu() - cpu:.0f} CPU-s; "
        f"{load} at its start, {_load()} at its end",
        flush=True,
    )


def main() -> None:
    """Measure and print; exit 0 whatever the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup", action="store_true", help="time `./run setup` in a fresh clone of HEAD first")
    parser.add_argument("--tiers", nargs="*", choices=TIERS, default=["push"], help="the tiers to time (push)")
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds of the three arms (0: no model runs)"
    )
    parser.add_argument("--steps", type=int, default=50, help="timed steps per run (their median is its figure)")
    parser.add_argument("--effect", nargs=argparse.REMAINDER, metavar="ARGS", help="time only `./run effect ARGS`")
    args = parser.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us
    if args.effect is not None:
        effect(args.effect)
        return
    if args.setup:
        setup()
    for name in args.tiers:
        tier(name)
    if args.rounds:
        memory()
        ratios(args.rounds, args.steps)
    print(_load())


if __name__ == "__main__":
    main()
