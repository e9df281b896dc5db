"""What `./run effect` and `./run repro` share: their arguments, the two trees, the arms as processes, the output.

Both refuse a bad argument in one line (exit 2) before any work, write files only under ``--out DIR`` (in one rename
each, once everything is measured), and on SIGINT, SIGTERM or SIGHUP end their arms and exit 128 + n with nothing
written.
"""

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from maintain.repo import VIEW, pins, release
from mtp_mask_fix import cli
from mtp_mask_fix.journal import write_atomic
from mtp_mask_fix.signals import held
from tinymodel.worker import Launch, Started


ARMS = ("unpatched", "patched")
MAX_SEEDS = 100  # more would run for hours


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


def parser(prog: str, description: str, default_seeds: str) -> cli.Parser:
    """The shared arguments; a bad value is one `error:` line and exit 2."""
    out = cli.Parser(prog=prog, description=description)
    out.add_argument("--seeds", type=seeds, default=default_seeds, help=f"A-B or A,B,... (default {default_seeds})")
    out.add_argument("--out", type=out_dir, metavar="DIR", help="write the figures there (figures.json)")
    return out


def trees() -> dict[str, Path]:
    """The release as shipped, and the view (release + patch) written afresh, as `./run view` writes it."""
    from maintain.view import view

    view(None)
    return {"unpatched": release(pins()["megatron-bridge"]).root, "patched": VIEW}


class Arms:
    """Both arms of an experiment, each a process with its own tree first on the import path, started at once."""

    def __init__(self, function: str, trees: dict[str, Path], plans: dict[str, str], timeout: float):
        """``function``: `module:name` of the arm (given the arm's plan as JSON), run by the worker's `call` mode."""
        self.trees, self.started_at = trees, time.perf_counter()
        self._tmp = tempfile.TemporaryDirectory(prefix="mtp-experiment-")
        runs = [
            Launch("call", trees[arm], 1, Path(self._tmp.name) / arm, ("--function", function, "--arg", plans[arm]))
            for arm in ARMS
        ]
        self._started = Started(runs, timeout=timeout)

    def wait(self) -> dict[str, dict]:
        """Each arm's payload (raises if one failed); an interruption ends both arms first."""
        try:
            return {arm: ranks[0] for arm, ranks in zip(ARMS, self._started.wait())}
        except BaseException:
            self._started.stop()
            raise
        finally:
            self._tmp.cleanup()

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
    parser.set_defaults(func=run)
    cli.main(sys.argv[1:] if argv is None else argv, parser=parser)
