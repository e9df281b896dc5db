"""What `./run effect` and `./run repro` share: their arguments, the two trees, the arms as processes, the output.

Both refuse a bad argument in one line (exit 2) before any work, write files only under ``--out DIR`` (in one rename
each, once everything is measured), and on SIGINT, SIGTERM or SIGHUP end their arms and exit 128 + n with nothing
written there. While the arms run, each finished seed is said as it comes, and a seed slower than expected too.
"""

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from experiments.design import ARMS
from experiments.effect_arm import SEED_DONE
from maintain import printed
from maintain.repo import VIEW, pins, release
from mtp_mask_fix import cli
from mtp_mask_fix.journal import write_atomic
from mtp_mask_fix.signals import held
from tinymodel.worker import Launch, Started


MAX_SEEDS = 400  # about 4 hours of CPU per arm at `./run effect`'s size
SLOW = 2  # a seed that takes this many times the expected time is said to be slow
STALL = 10  # an arm that finishes no seed in this many times the expected time is stopped
START_S = 60  # an arm's start (imports, process group) before its first seed


def seeds(text: str) -> tuple[int, ...]:
    """--seeds: `A-B` (both included) or `A,B,...`, non-negative and distinct, at most MAX_SEEDS of them."""
    try:
        if re.fullmatch(r"\d+-\d+", text):
            low, high = map(int, text.split("-"))
            values = tuple(range(low, high + 1)) if high - low < MAX_SEEDS else ()
        else:
            values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not 0 < len(values) <= MAX_SEEDS or min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not A-B (A <= B) nor distinct A,B,..., at most {MAX_SEEDS} seeds"
        )
    return values


def out_dir(text: str) -> Path:
    """--out: a directory (made at the end if missing) in a writable place; refused now, not after the run."""
    path = Path(text).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {existing} is not a writable directory")
    return path


def parser(prog: str, description: str, default_seeds: str | None, said: str | None = None) -> cli.Parser:
    """The shared arguments; a bad value is one `error:` line and exit 2. ``default_seeds`` None: the command picks
    them (``said`` says how)."""
    out = cli.Parser(prog=prog, description=description)
    out.add_argument(
        "--seeds", type=seeds, default=default_seeds, help=f"A-B or A,B,... (default {said or default_seeds})"
    )
    out.add_argument("--out", type=out_dir, metavar="DIR", help="write the figures there (figures.json)")
    return out


def trees() -> dict[str, Path]:
    """The release as shipped, and the view (release + patch) written afresh, as `./run view` writes it."""
    from maintain.view import view

    view(None)
    return {"unpatched": release(pins()["megatron-bridge"]).root, "patched": VIEW}


class Stopped(Exception):
    """An arm failed, or finished no seed in STALL times the time expected: both arms were ended."""


class Arms:
    """Both arms of an experiment, each a process with its own tree first on the import path, started at once."""

    def __init__(
        self,
        function: str,
        trees: dict[str, Path],
        plans: dict[str, str],
        seed_seconds: float,
        keep: Path | None = None,
        name: str = "effect",
    ):
        """``function``: `module:name` of the arm (given the arm's plan as JSON), run by the worker's `call` mode.
        ``seed_seconds``: the time a seed is expected to take. ``keep``: where the arms keep their
        finished seeds (the plans say so; None: nowhere). ``name``: what the progress lines begin with."""
        self.trees, self.seed_seconds, self.keep, self.name = trees, seed_seconds, keep, name
        self.started_at = time.perf_counter()
        self.seeds = {arm: len(json.loads(plans[arm])["seeds"]) for arm in ARMS}
        self.done = {arm: 0 for arm in ARMS}  # seeds finished (run or reused)
        self._tmp = tempfile.TemporaryDirectory(prefix="mtp-experiment-")
        self._log = {arm: Path(self._tmp.name) / arm / "rank0.log" for arm in ARMS}  # the worker's, per rank
        self._read = dict.fromkeys(ARMS, 0)
        self._since = dict.fromkeys(ARMS, self.started_at)  # the last seed's end, or the start
        self._said_slow = set()
        self._started = {
            arm: Started(
                [
                    Launch(
                        "call",
                        trees[arm],
                        1,
                        Path(self._tmp.name) / arm,
                        ("--function", function, "--arg", plans[arm]),
                    )
                ],
                timeout=math.inf,  # the arms are watched seed by seed instead (_watch)
            )
            for arm in ARMS
        }

    def wait(self) -> dict[str, dict]:
        """Each arm's payload; raises Stopped if an arm failed or stalled. An interruption ends both arms first."""
        outcome = {arm: {} for arm in ARMS}

        def wait_for(arm: str) -> None:
            try:
                outcome[arm]["payload"] = self._started[arm].wait()[0][0]
            except RuntimeError as error:  # the worker's: an arm exited non-zero
                outcome[arm]["error"] = str(error)

        waiting = [threading.Thread(target=wait_for, args=(arm,), daemon=True) for arm in ARMS]
        try:
            for thread in waiting:
                thread.start()
            while any(thread.is_alive() for thread in waiting):
                next(thread for thread in waiting if thread.is_alive()).join(1.0)
                self._watch()
                if failed := [f"the {arm} arm failed: {o['error']}" for arm, o in outcome.items() if "error" in o]:
                    raise Stopped("\n".join(failed))
            self._watch()
            return {arm: o["payload"] for arm, o in outcome.items()}
        except BaseException:
            self.stop()
            raise
        finally:
            for thread in waiting:
                thread.join()
            self._tmp.cleanup()

    def stop(self) -> None:
        """End both arms (their finished seeds stay kept)."""
        for started in self._started.values():
            started.stop()

    def kept(self) -> str:
        """What the arms keep of their finished seeds, for the line that ends an unfinished run."""
        done = " and ".join(f"{self.done[arm]} of {self.seeds[arm]} seeds in the {arm} arm" for arm in ARMS)
        if self.keep is None:
            return f"{done} finished; nothing kept"
        return f"{done} finished, kept in {self.keep}: the same command resumes from them"

    def _watch(self) -> None:
        """Say each seed the arms have finished since the last call, and a seed slower than expected; raise Stopped
        for an arm that has finished no seed in STALL times the expected time."""
        now = time.perf_counter()
        for arm in ARMS:
            for done in self._new_seeds(arm):
                self.done[arm] += 1
                self._since[arm] = now
                took = done["pretrain_seconds"] + done["fine_tune_seconds"]
                what = (
                    "kept from an earlier run" if done["reused"] else f"{took:.0f} s, {done['cpu_seconds']:.0f} CPU-s"
                )
                slow = "" if done["reused"] or took < SLOW * self.seed_seconds else "; " + self._slower(took)
                self._say(f"{arm}: seed {done['seed']} done ({self.done[arm]} of {self.seeds[arm]}; {what}){slow}")
            if self.done[arm] == self.seeds[arm]:
                continue
            expected = self.seed_seconds + (START_S if self.done[arm] == 0 else 0)
            waited = now - self._since[arm]
            if waited > SLOW * expected and (arm, self.done[arm]) not in self._said_slow:
                self._said_slow.add((arm, self.done[arm]))
                self._say(
                    f"{arm}: seed number {self.done[arm] + 1} of {self.seeds[arm]} still running; {self._slower(waited)}"
                )
            if waited > STALL * expected:
                raise Stopped(
                    f"the {arm} arm finished no seed in {waited:.0f} s, {STALL} x the {expected:.0f} s a seed is "
                    f"expected to take{' with the start' if self.done[arm] == 0 else ''}: both arms stopped"
                )

    def _new_seeds(self, arm: str) -> list[dict]:
        """The SEED_DONE lines the arm has written since the last call (whole lines only)."""
        with contextlib.suppress(FileNotFoundError), open(self._log[arm], "rb") as log:
            log.seek(self._read[arm])
            text = log.read()
            text = text[: text.rfind(b"\n") + 1]
            self._read[arm] += len(text)
            lines = text.decode(errors="replace").splitlines()
            return [json.loads(line.removeprefix(SEED_DONE)) for line in lines if line.startswith(SEED_DONE)]
        return []

    def _slower(self, seconds: float) -> str:
        load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
        kept = f"; finished seeds are kept in {self.keep}" if self.keep else ""
        return (
            f"{seconds:.0f} s is slower than expected (about {self.seed_seconds:.0f} s a seed; load average {load})"
            f"{kept}"
        )

    def _say(self, line: str) -> None:
        print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def seconds(self) -> float:
        return time.perf_counter() - self.started_at


def write(out: Path | None, files: dict[str, bytes]) -> str:
    """The files into out, each in one rename, signals held until all are written; what to print about it."""
    if out is None:
        return ""
    with held():
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            write_atomic(out / name, data)
    return f"wrote {', '.join(str(out / name) for name in files)}"


def main(parser: cli.Parser, run, argv: list[str] | None = None) -> None:
    """Parse, then ``run(args)`` (returns what to print and the exit code); one line and its code for a refusal or a
    signal."""
    parser.set_defaults(func=printed(run))
    cli.main(sys.argv[1:] if argv is None else argv, parser=parser)
