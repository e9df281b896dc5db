"""The signals every command handles: raised as Interrupted (`guard`), held past a write, blocked once `say` ends."""

import contextlib
import os
import signal
import sys

from mtp_mask_fix.errors import Exit


SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class Interrupted(BaseException):
    """A signal arrived; a BaseException, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        self.name = signal.Signals(signum).name
        self.code = Exit.INTERRUPTED + signum
        super().__init__(f"interrupted by {self.name}")


@contextlib.contextmanager
def guard():
    """Have SIGNALS raise Interrupted inside the block (at the end of a `held()` one)."""

    def interrupt(signum, frame):
        raise Interrupted(signum)

    old = {sig: signal.signal(sig, interrupt) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def held():
    """Block SIGNALS until the block ends, then deliver them, so that no write is cut short."""
    # A process spawned inside inherits the block: its preexec_fn unblocks them (watch.UNBLOCK).
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # first: a handler run by the call below cannot skip `finally`
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def say(text: str, *, final: bool = True) -> None:
    """Print a line of a command's outcome, after which, if `final`, no signal is delivered; `| head` may take none."""
    if final:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # and Python's own flush at exit finds nothing left to write
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
