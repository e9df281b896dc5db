"""What `mtp-mask-fix watch` costs a training step: the tiny MTP model's median step time (forward + backward through
Bridge's forward_step and core's schedule, on the view: one masked MTP loss call per step) with and without watch.

    .venv/bin/python bench/watch_overhead.py [--steps 50] [--rounds 5]

Each round runs both arms one after the other (alternating which goes first), each a fresh process
(`tinymodel.worker bench`: 3 warm-up steps, then the median of --steps). Prints each round's medians and ratio, the
median ratio over rounds with its range, and the load average before and after: timings depend on what else runs.
Beside them, what load hardly moves: the hook's own time per MTP loss call (median of 2,000 calls on the tiny
model's SFT batch), against the median step time without watch.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _median_step(watched: bool, steps: int) -> float:
    import torch

    from maintain.repo import VIEW

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "tinymodel.worker", "bench", "--steps", str(steps), "--out", out]
        command = [sys.executable, "-m", "mtp_mask_fix", "watch", "--", *command] if watched else command
        # TMPDIR of its own: watch's folder, where its processes report, is then no one else's to clean up
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(VIEW), str(REPO)]), TMPDIR=out)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        return torch.load(Path(out) / "rank0.pt", weights_only=False)["median_step_s"]


def _hook_seconds_per_call(calls: int = 2000) -> float:
    """The median time watched.py's wrapper adds to one MTP loss call (made as core 0.19 makes it, by keyword, on the
    tiny model's SFT batch: every check runs) around a function that only passes the hidden states on, and the backward
    hook it leaves: what watch costs each call, whatever else runs."""
    import time

    import torch

    from mtp_mask_fix import watched
    from tinymodel import gpt

    def stand_in(hidden_states, labels, loss_mask, is_training, input_ids):
        return hidden_states * 1  # a tensor of its own, as core's MTPLossAutoScaler returns

    bare, wrapped, batch = stand_in, watched._wrap(stand_in), gpt.make_sft_batch()
    hidden = torch.zeros(2 * batch["labels"].numel(), gpt.HIDDEN, requires_grad=True)
    call = dict(hidden_states=hidden, labels=batch["labels"], loss_mask=batch["loss_mask"], is_training=True)
    call.update(input_ids=batch["tokens"])
    times = {bare: [], wrapped: []}
    for _ in range(calls):
        for function in (bare, wrapped):
            start = time.perf_counter()
            function(**call).sum().backward()
            times[function].append(time.perf_counter() - start)
    return statistics.median(times[wrapped]) - statistics.median(times[bare])


def main() -> None:
    """Both arms, round after round; then the hook's own cost per call."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps per run (their median is its figure)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both arms")
    args = parser.parse_args()
    print("before: load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg()))
    ratios, no_watch = [], []
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        times = {watched: _median_step(watched, args.steps) for watched in order}
        ratios.append(times[True] / times[False])
        no_watch.append(times[False])
        print(
            f"round {round_ + 1}: median step {times[False] * 1e3:.2f} ms without watch, "
            f"{times[True] * 1e3:.2f} ms with it: ratio {ratios[-1]:.3f}"
        )
    print(
        f"watch / no watch, median of {args.steps} steps: median ratio over {args.rounds} rounds "
        f"{statistics.median(ratios):.3f} (range {min(ratios):.3f} to {max(ratios):.3f})"
    )
    hook, step = _hook_seconds_per_call(), statistics.median(no_watch)
    print(
        f"the hook's own time per MTP loss call: {hook * 1e6:.1f} us, {hook / step:.2%} of the median step without watch"
    )
    print("after: load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
