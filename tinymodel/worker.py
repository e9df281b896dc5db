"""Workers for the tiny model: MODE on one or several ranks (gloo), each rank a process of its own.

    PYTHONPATH=TREE:REPO python -m tinymodel.worker MODE --ranks 2 --out DIR

Each rank saves what MODE returns to DIR/rank<r>.pt: raw measurements only; the tests make every assertion.
TREE (first on the import path) is the Megatron-Bridge under test. ``launch`` / ``launch_all`` run workers and wait;
``start`` returns at once (a test's own work then overlaps the workers' start-up).
"""

import argparse
import importlib
import importlib.util
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from maintain.repo import REPO
from tinymodel import cpu_runtime, gpt


@dataclass(frozen=True)
class Launch:
    """One worker run: MODE on `ranks` ranks with TREE first on the import path."""

    mode: str
    tree: Path
    ranks: int
    out: Path
    args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        return [self.mode, "--ranks", str(self.ranks), "--out", str(self.out), *self.args]


def this_tree() -> Path | None:
    """The tree this process imports megatron.bridge from (found without importing it), or None."""
    spec = importlib.util.find_spec("megatron.bridge")
    return Path(spec.origin).parents[2] if spec else None


class Started:
    """Worker runs under way, each rank a process of its own; `wait()` gives each run's per-rank payloads."""

    def __init__(self, runs: list[Launch], timeout: float = 600):
        self.runs, self.timeout, self._payloads = runs, timeout, None
        self._ranks = [_spawn(run.tree, run.argv(), run.ranks, run.out) for run in runs]

    def stop(self) -> None:
        """End every rank still running (a caller interrupted: nothing outlives it)."""
        for ranks in self._ranks:
            _kill(ranks)

    def wait(self) -> list[list[dict]]:
        """Each run's per-rank payloads, once all have finished (raises if any failed)."""
        if self._payloads is None:
            failed = [
                f"{run.mode} on {run.ranks} rank(s) with {run.tree} failed: {error}"
                for run, ranks in zip(self.runs, self._ranks)
                if (error := _wait(ranks, run.out, self.timeout))
            ]
            if failed:
                raise RuntimeError("\n\n".join(failed))
            self._payloads = [
                [torch.load(run.out / f"rank{r}.pt", weights_only=False) for r in range(run.ranks)]
                for run in self.runs
            ]
        return self._payloads


def start(*runs: Launch) -> Started:
    """Start every run now, without waiting."""
    return Started(list(runs))


def launch_all(runs: list[Launch]) -> list[list[dict]]:
    """Start every run at once, wait for all; each run's per-rank payloads (raises if any run fails)."""
    return Started(runs).wait()


def launch(mode: str, tree: Path, ranks: int, out: Path, *args: str) -> list[dict]:
    """Run MODE on `ranks` ranks with TREE first on the import path; returns each rank's payload."""
    return launch_all([Launch(mode, Path(tree), ranks, Path(out), args)])[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rendezvous(world: int, port: int = 0) -> dict[str, str]:
    return dict(WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or _free_port()))


class _Ranks(list):
    """A run's rank processes, and the store they meet at, held by this process while they run."""

    store: torch.distributed.TCPStore


def _spawn(tree: Path, argv: list[str], world: int, out: Path) -> _Ranks:
    """One process a rank, TREE first on its import path, its output in out/rank<r>.log. The ranks meet at a store
    this process binds now and holds while they run (as torchrun's agent does), not at a port picked for rank 0 to
    bind once it has imported, which a run started at the same time can take meanwhile (EADDRINUSE)."""
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(filter(None, [str(tree), str(REPO), os.environ.get("PYTHONPATH")]))
    ranks = _Ranks()
    ranks.store = torch.distributed.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=path, **_rendezvous(world, ranks.store.port))
    env["TORCHELASTIC_USE_AGENT_STORE"] = str(True)  # every rank a client of this process's store
    for rank in range(world):
        with open(out / f"rank{rank}.log", "w") as log:
            command = [sys.executable, "-m", "tinymodel.worker", *argv]
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            ranks.append(subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    return ranks


def _kill(ranks: list[subprocess.Popen]) -> None:
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
            rank.wait()


def _wait(ranks: list[subprocess.Popen], out: Path, timeout: float) -> str | None:
    """None once every rank exited 0; else the exit codes and each failed rank's log (a failed rank ends the rest)."""
    deadline = time.monotonic() + timeout
    while any(rank.poll() is None for rank in ranks):
        if time.monotonic() > deadline or any(rank.poll() for rank in ranks):
            _kill(ranks)
            break
        time.sleep(0.05)
    codes = [rank.wait() for rank in ranks]
    if not any(codes):
        return None
    logs = [(out / f"rank{r}.log").read_text(errors="replace")[-4000:] for r, code in enumerate(codes) if code]
    return f"exit codes {codes}\n" + "\n".join(logs)


# ---------------------------------------------------------------- modes (each returns this rank's raw data)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def bench(args) -> dict:
    """Forward+backward step times, wall and CPU, of the mtp_num_layers=1 model at --hidden on an SFT batch of --seq
    positions (after 3 warm-up steps). Under `mtp-mask-fix watch`, steps alternate with watch's wrappers in place and
    taken out, so that the ratio of each pair's CPU times is the cost of watching a step, whatever the process."""
    cpu_runtime.init_distributed(tensor_parallel=_world())
    model = gpt.build_model(1, hidden=args.hidden, max_seq=args.seq)
    batch = gpt.make_sft_batch(((args.seq // 2, args.seq // 4), (args.seq - 20, 21), (8, 4)), seq=args.seq)
    wrapped = _wrapped()
    times = {True: [], False: []}  # watched (or unwatched: no wrappers), with the wrappers taken out
    for step in range(args.steps + 3):
        for on in (step % 2 == 0, step % 2 == 1) if wrapped else (True,):
            for (owner, name), function in wrapped.items():
                setattr(owner, name, function if on else function.__wrapped__)
            start = time.perf_counter(), time.process_time()
            gpt.run_step(model, batch, record=False)
            times[on].append((time.perf_counter() - start[0], time.process_time() - start[1]))
    wall, cpu = zip(*times[True][3:])
    payload = {
        "steps": args.steps,
        "median_step_s": statistics.median(wall),
        "median_step_cpu_s": statistics.median(cpu),
    }
    if wrapped:
        pairs = [on[1] / off[1] for on, off in zip(times[True][3:], times[False][3:])]
        payload["paired_cpu_ratio"] = statistics.median(pairs)
    return payload


def _wrapped() -> dict:
    """What `mtp-mask-fix watch` wrapped in this process where GPTModel reaches it: (owner, name) -> the wrapper."""
    import megatron.core.models.gpt.gpt_model as gpt_model
    from megatron.core.models.common.language_module.language_module import LanguageModule

    places = ((gpt_model, "process_mtp_loss"), (LanguageModule, "__call__"))
    return {place: getattr(*place) for place in places if hasattr(getattr(*place), "__wrapped__")}


def pipeline(args) -> dict:
    """PP = world size vs the same model unpipelined (see pipeline)."""
    from tinymodel.pipeline import measure

    return measure(_world())


def expert_parallel(args) -> dict:
    """MoE with EP = world size, every dispatcher and aux-loss case (see moe)."""
    from tinymodel.moe import CASES, measure

    return measure(_world(), CASES)


def call(args) -> dict:
    """--function (`module:name`, the caller's own) given --arg: how a room above this one runs its code on these
    ranks without this one importing it."""
    module, name = args.function.split(":")
    return getattr(importlib.import_module(module), name)(args.arg)


MODES = {
    "bench": bench,
    "pipeline": pipeline,
    "expert_parallel": expert_parallel,
    "call": call,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--ranks", type=int, default=1, help="world size")
    parser.add_argument("--out", type=Path, required=True, help="directory for rank<r>.pt")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (bench)")
    parser.add_argument("--hidden", type=int, default=gpt.HIDDEN, help="the model's hidden size (bench)")
    parser.add_argument("--seq", type=int, default=gpt.MAX_SEQ, help="the batch's sequence length (bench)")
    parser.add_argument("--function", help="module:name of the function to run (call)")
    parser.add_argument("--arg", help="its one argument, a string (call)")
    return parser


def run_rank(argv: list[str]) -> None:
    """One rank: MODE (which sets up its own parallel layout), then its payload saved to --out."""
    args = _parser().parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)  # two threads were several times slower than one on this 2-core machine
    import megatron.bridge.training.gpt_step as gpt_step

    imported = time.perf_counter()
    payload = MODES[args.mode](args)
    rank = int(os.environ.get("RANK", "0"))
    payload.update(
        rank=rank,
        world_size=_world(),
        gpt_step_file=gpt_step.__file__,
        import_seconds=imported - started,
        seconds=time.perf_counter() - started,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports KiB
    )
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(payload, args.out / f"rank{rank}.pt")
    cpu_runtime.shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    """One rank (RANK set), or every rank of a run: one in this process, more each in a process of its own."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ and args.ranks > 1:
        if error := _wait(_spawn(this_tree(), argv, args.ranks, args.out), args.out, float("inf")):
            sys.exit(error)
        return
    os.environ.setdefault("RANK", "0")
    for key, value in _rendezvous(1).items():
        os.environ.setdefault(key, value)
    run_rank(argv)


if __name__ == "__main__":
    sys.exit(main())
