"""Benchmark the functional tests and the tiny-model step: suite wall time, peak RSS per rank, patched/unpatched ratio.

Run as ``.venv/bin/python bench/benchmark.py``. Prints each figure next to its target and whether it is met; never
fails on a miss. MTP_FIX_GPT_STEP (if set) applies to the pytest runs; the step-time ratio always loads both files.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
SUITE_1_RANK_TARGET_S = 30.0
SUITE_2_RANK_TARGET_S = 45.0
RSS_TARGET_MIB = 1024.0
RATIO_TOLERANCE = 0.10  # "about 1.0": within 10 % either way, CPU timing noise on 2 cores included


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=900)
    return time.perf_counter() - start, proc


def _pytest(selection: str) -> tuple[float, str]:
    command = [sys.executable, "-m", "pytest", "tests/functional", "-q", "-p", "no:cacheprovider", "-k", selection]
    seconds, proc = _timed(command)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"exit {proc.returncode}"
    return seconds, summary.strip("= ")


def _worker(ranks: int, steps: int) -> list[dict]:
    """Harness bench mode: interleaved patched/unpatched steps; one JSON per rank."""
    with tempfile.TemporaryDirectory(prefix="mtp-bench-") as tmp:
        worker = ["-m", "mtp_mask_fix.harness.tiny_mtp", "--mode", "bench", "--steps", str(steps), "--out", tmp]
        if ranks == 1:
            command = [sys.executable, *worker]
        else:
            launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1"]
            command = [sys.executable, *launcher, "--master-port", str(_free_port()), *worker]
        _, proc = _timed(command)
        if proc.returncode != 0:
            raise RuntimeError(f"bench worker ({ranks} ranks) failed:\n{proc.stderr[-3000:]}")
        return [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def main() -> None:
    """Measure and print; exit status 0 whatever the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed forward+backward steps per variant")
    args = parser.parse_args()

    print(f"gpt_step under test for pytest: {os.environ.get('MTP_FIX_GPT_STEP') or 'patched view (default)'}")
    for label, selection, target in (
        ("functional suite, 1 rank", "not TensorParallel2", SUITE_1_RANK_TARGET_S),
        ("functional suite, 2 ranks (TP2)", "TensorParallel2", SUITE_2_RANK_TARGET_S),
    ):
        seconds, summary = _pytest(selection)
        verdict = _verdict(seconds <= target)
        print(f"{label:<34} {seconds:8.1f} s    target <= {target:.0f} s    {verdict}  [{summary}]", flush=True)

    for ranks in (1, 2):
        results = _worker(ranks, args.steps)
        rss = [r["peak_rss_mib"] for r in results]
        rss_text = ", ".join(f"rank {r['rank']} {r['peak_rss_mib']:.0f} MiB" for r in results)
        print(
            f"{f'peak RSS, TP{ranks}':<34} {rss_text}    target <= {RSS_TARGET_MIB:.0f} MiB/rank    "
            f"{_verdict(max(rss) <= RSS_TARGET_MIB)}",
            flush=True,
        )
        for r in results[:1]:  # every rank steps the same model; rank 0 speaks for the run
            medians = r["median_step_s"]
            ratio = r["ratio_patched_over_unpatched"]
            print(
                f"{f'step time patched/unpatched, TP{ranks}':<34} median of {r['steps']} fwd+bwd: "
                f"{medians['patched'] * 1e3:.2f} ms / {medians['unpatched'] * 1e3:.2f} ms = {ratio:.3f}    "
                f"target ~1.0 (+-{RATIO_TOLERANCE:.0%})    {_verdict(abs(ratio - 1) <= RATIO_TOLERANCE)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
