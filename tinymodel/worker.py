"""Workers for the tiny model: MODE on one or several ranks (gloo), each rank forked from a process that imported the
tree under test once.

    PYTHONPATH=TREE:REPO python -m tinymodel.worker MODE --ranks 2 --out DIR

Each rank saves what MODE returns to DIR/rank<r>.pt: raw measurements only; the tests make every assertion.
TREE (first on the import path) is the Megatron-Bridge under test. ``launch`` / ``launch_all`` run workers and wait;
``start`` returns at once (a test's own work then overlaps the workers' start-up).

In a test session the ranks of its own tree fork from a zygote: a fork of the session's process made by
tests/functional/conftest.py once that process has imported the tree, before it has run anything (no thread, no
process group). Any other run (another tree, bench, ./run effect) is a process of its own that imports its tree once
and makes its zygote the same way.
"""

import argparse
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import pickle
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from maintain.repo import REPO
from mtp_mask_fix.paths import GPT_STEP_MODULE
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
    """The tree this process imports megatron.bridge from (found without importing it); None if it has none
    (`./run effect`'s own process: both arms are then processes of their own)."""
    spec = importlib.util.find_spec("megatron.bridge")
    return Path(spec.origin).parents[2] if spec else None


class Started:
    """Worker runs under way, all at once (``start``); ``wait()`` for each run's per-rank payloads: from this
    session's zygote, or from a process of their own (`python -m tinymodel.worker`)."""

    def __init__(self, runs: list[Launch], timeout: float = 600):
        self.runs, self.timeout, self._payloads, self._handles = runs, timeout, None, []
        for run in runs:
            run.out.mkdir(parents=True, exist_ok=True)
            if ZYGOTE is not None and run.tree.resolve() == ZYGOTE.tree:
                self._handles.append(ZYGOTE.start(run))
            else:
                log = open(run.out / "worker.log", "w")
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(run.tree), str(REPO)]))
                command = [sys.executable, "-m", "tinymodel.worker", *run.argv()]
                proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                self._handles.append((proc, log))

    def stop(self) -> None:
        """End every run still going, with its ranks (a caller interrupted: nothing outlives it)."""
        for handle in self._handles:
            if isinstance(handle, ZygoteRun):
                handle.kill()
            else:
                proc, log = handle
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: the process and its ranks
                    proc.wait()
                log.close()

    def wait(self) -> list[list[dict]]:
        """Each run's per-rank payloads, once all have finished (raises if any failed)."""
        if self._payloads is None:
            failed = []
            for run, handle in zip(self.runs, self._handles):
                if isinstance(handle, ZygoteRun):
                    if error := handle.wait(self.timeout):
                        failed.append(f"{run.mode} on {run.ranks} rank(s) with {run.tree} failed: {error}")
                else:
                    proc, log = handle
                    try:
                        code = proc.wait(timeout=self.timeout)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: the process and its ranks
                        code = proc.wait()
                    log.close()
                    if code != 0:
                        tail = (run.out / "worker.log").read_text(errors="replace")[-4000:]
                        failed.append(f"{run.mode} on {run.ranks} rank(s) with {run.tree} failed ({code}):\n{tail}")
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


# ---------------------------------------------------------------- the zygote (a test session's own tree)

ZYGOTE = None  # this session's Zygote, once tests/functional/conftest.py has made it
PRELOAD = ("tinymodel.pipeline", "tinymodel.moe", "experiments.effect_arm")  # what the modes import lazily


def start_zygote() -> None:
    """Import this process's tree (and what the modes import), then fork the zygote its ranks will fork from. Only
    while this process runs no other Python thread: a fork copies the calling thread alone, and a lock another thread
    held would stay held in every rank. (The native threads torch and megatron start at import are the forkserver's
    too.) Otherwise, or with no megatron.bridge on the path, ranks keep to the forkserver."""
    global ZYGOTE
    tree = this_tree()
    if ZYGOTE is not None or tree is None:
        return
    for module in (GPT_STEP_MODULE, *PRELOAD):
        importlib.import_module(module)
    if threading.active_count() == 1:
        ZYGOTE = Zygote(tree.resolve())


class Zygote:
    """A fork of this process that forks, per worker run, a supervisor, which forks the ranks and waits for them.

    It reads runs from a pipe and exits when that pipe closes (this process ended). Nothing in it runs a test: each
    rank starts from the state this process had when the zygote was made, as a forkserver child starts from the
    forkserver's."""

    def __init__(self, tree: Path):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            _serve(read)  # never returns
        os.close(read)
        self.tree, self.pid, self._requests = tree, pid, os.fdopen(write, "wb")

    def start(self, run: Launch) -> "ZygoteRun":
        return self.submit(run.ranks, run.argv(), run.out)

    def submit(self, world: int, argv: list[str], out: Path) -> "ZygoteRun":
        for stale in ("exit.json", "supervisor.pid", *(f"rank{r}.err" for r in range(world))):
            (out / stale).unlink(missing_ok=True)
        pickle.dump((world, argv, str(out), _free_port()), self._requests)
        self._requests.flush()
        return ZygoteRun(out)


class ZygoteRun:
    """One run's supervisor, seen through the files it leaves in the run's out directory."""

    def __init__(self, out: Path):
        self.out = out

    def kill(self) -> None:
        """End the supervisor's own group, it and its ranks (if it has started)."""
        pid = (self.out / "supervisor.pid").read_text() if (self.out / "supervisor.pid").exists() else ""
        if pid:
            with contextlib.suppress(ProcessLookupError):  # it has ended
                os.killpg(int(pid), signal.SIGKILL)

    def wait(self, timeout: float) -> str | None:
        """None once every rank exited 0; else what failed (each failed rank's traceback)."""
        done, deadline, pause = self.out / "exit.json", time.monotonic() + timeout, 0.005
        while not done.exists():
            if time.monotonic() > deadline:
                self.kill()
                return f"no result in {timeout:.0f} s"
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        codes = json.loads(done.read_text())["codes"]
        if not any(codes):
            return None
        errors = [(self.out / f"rank{r}.err") for r, code in enumerate(codes) if code]
        told = [e.read_text() for e in errors if e.exists()]
        log = (self.out / "ranks.log").read_text(errors="replace")[-4000:]
        return f"exit codes {codes}\n" + "\n".join(told or [log])


def _serve(requests_fd: int) -> None:
    """The zygote: one supervisor per run read from the pipe; exits when the pipe closes."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is the session's to handle
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        requests = os.fdopen(requests_fd, "rb")
        while True:
            try:
                world, argv, out, port = pickle.load(requests)
            except EOFError:
                break
            if os.fork() == 0:
                requests.close()  # a supervisor must not keep the zygote's pipe open
                _supervise(world, argv, Path(out), port)  # never returns
            while True:  # reap the supervisors that have finished
                try:
                    if os.waitpid(-1, os.WNOHANG)[0] == 0:
                        break
                except ChildProcessError:
                    break
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _die_with_parent() -> None:
    """SIGKILL when the parent dies (Linux's PR_SET_PDEATHSIG): no rank outlives a killed supervisor or session."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _supervise(world: int, argv: list[str], out: Path, port: int) -> None:
    """Fork the ranks, wait for all; a failed rank ends the others (as torch's ProcessContext does). Leaves
    out/exit.json with each rank's exit code, and a failed rank's traceback in out/rank<r>.err."""
    code, codes = 1, {}
    try:
        _die_with_parent()  # its own process group (below): a kill of the session's group would not reach it
        os.setpgid(0, 0)
        out.mkdir(parents=True, exist_ok=True)
        (out / "supervisor.pid").write_text(str(os.getpid()))
        log = os.open(out / "ranks.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not the session's capture, if it had one
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        pids = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _die_with_parent()
                _zygote_rank(rank, world, port, argv, out)  # never returns
            pids[pid] = rank
        while len(codes) < world:
            pid, status = os.wait()
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0:
                for other, rank in pids.items():
                    if rank not in codes:
                        os.kill(other, signal.SIGKILL)
        code = 0
    finally:  # whatever happened, the waiting session learns it here (-1: the rank's end is unknown)
        try:
            tmp = out / "exit.json.tmp"
            tmp.write_text(json.dumps({"codes": [codes.get(r, -1) if code == 0 else -1 for r in range(world)]}))
            tmp.rename(out / "exit.json")
        finally:
            os._exit(code)


def _zygote_rank(rank: int, world: int, port: int, argv: list[str], out: Path) -> None:
    code = 1
    try:
        _rank(rank, world, port, argv)
        code = 0
    except BaseException:
        (out / f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _rank(rank: int, world: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    run_rank(argv)


# ---------------------------------------------------------------- modes (each returns this rank's raw data)


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def bench(args) -> dict:
    """Forward+backward step times of the mtp_num_layers=1 model (after 3 warm-up steps)."""
    cpu_runtime.init_distributed(tensor_parallel=_world())
    model = gpt.build_model(1)
    batch = gpt.make_sft_batch()
    times = []
    for _ in range(args.steps + 3):
        start = time.perf_counter()
        gpt.run_step(model, batch, record=False)
        times.append(time.perf_counter() - start)
    return {"steps": args.steps, "median_step_s": statistics.median(times[3:])}


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
        import_seconds=imported - started,  # what was not imported yet (nothing, when forked from a warm process)
        seconds=time.perf_counter() - started,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports KiB
    )
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(payload, args.out / f"rank{rank}.pt")
    cpu_runtime.shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    """A run of another tree than the caller's: this process has that tree first on its import path."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    start_zygote()  # this process imports the tree once; its ranks fork from it
    if ZYGOTE is None:
        sys.exit("no megatron.bridge on the import path: PYTHONPATH=TREE:REPO")
    if error := ZYGOTE.submit(args.ranks, argv, args.out).wait(timeout=float("inf")):
        sys.exit(error)


if __name__ == "__main__":
    sys.exit(main())
