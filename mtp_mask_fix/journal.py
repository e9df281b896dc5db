"""What makes a write all or nothing: a lock on TARGET, one rename a file, a journal of the bytes a write replaces."""

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.signals import Interrupted, held, say
from mtp_mask_fix.targets import Target


JOURNAL = ".mtp-mask-fix-journal.json"  # in TARGET until a write is verified: each file as it was, what replaces it
WAIT = 300.0  # seconds a command waits for another's write to TARGET: several ranks start at once


@contextlib.contextmanager
def doing(what: str, path):
    """Have an OSError inside say what the tool was doing, on which path, and why (the command says what it left)."""
    try:
        yield
    except OSError as exc:
        raise OSError(f"{what} {path}: {exc.strerror or exc}") from None


def temp(path: Path) -> Path:
    """Where a file's new bytes are written before the rename: `.NAME.mtp-mask-fix.tmp` beside it."""
    return path.with_name(f".{path.name}.mtp-mask-fix.tmp")


def write_atomic(path: Path, data: bytes) -> None:
    """Give path the bytes `data` in one rename, keeping an existing file's mode; an OS error leaves it as it was."""
    with doing("writing", path):  # a failed one leaves its temporary file to recover()
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
        with open(temp(path), "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp(path), mode)
        os.replace(temp(path), path)


@contextlib.contextmanager
def scratch():
    """A temporary folder in $TMPDIR, removed as the run ends (a killed run's stays)."""
    with doing("making a temporary folder in", tempfile.gettempdir()):
        folder = tempfile.TemporaryDirectory(prefix="mtp-mask-fix-run-", ignore_cleanup_errors=True)
    with folder as path:
        yield Path(path)


@dataclass
class Lock:
    """One command's flock(2) on TARGET's folder: shared to read it, exclusive to write it, never held for a probe."""

    # A waiter sleeps in the kernel's queue; SIGALRM tells a person still waiting after 2 s why (once a command), and
    # ends a wait of more than `wait`. It goes with its process, however it ends.
    root: Path
    label: str
    wait: float = WAIT
    told: bool = False  # whether this command has said why it waits

    @contextlib.contextmanager
    def held(self, exclusive: bool = False):
        tell = not self.told and self.wait > 2

        def alarm(signum, frame):
            if not tell or self.told:
                raise TimeoutError
            print(f"mtp-mask-fix: waiting for the lock on {self.label}, which another process holds", file=sys.stderr)
            self.told = True

        with doing("locking", self.root):
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        previous = signal.signal(signal.SIGALRM, alarm)
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, 2 if tell else self.wait, self.wait - 2 if tell else 0)
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if self.wait else fcntl.LOCK_NB))
            except (TimeoutError, BlockingIOError):  # even had just before the alarm: closing fd frees it
                held = f"its lock was not free within {self.wait:g} s (another process held it)"
                raise ToolError(f"{self.label}: {held}; nothing changed: run it again once that one ends", Exit.BUSY)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            yield
        finally:
            os.close(fd)


@dataclass(frozen=True)
class Journal:
    """TARGET's journal: none, or what a killed write left; it names no file if it is unreadable or not the tool's."""

    exists: bool = False
    release: str = ""
    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)  # each file's bytes before, and state now


def write(target: Target, after: dict[str, bytes], done: str) -> None:
    """Give the files the bytes `after` under a journal of the bytes they had, all or nothing; `done`: the work."""
    root = target.root
    for path in [root, *[where for rel in after for where in (root / rel, (root / rel).parent)]]:
        # Read-only by its mode (root writes anything, but the mode states intent), or by access(2): its mount too.
        if not (path.stat().st_mode & 0o200 and os.access(path, os.W_OK)):
            make = "make it writable (mtp-mask-fix writes a journal in TARGET and renames each file into place)"
            raise ToolError(f"{path} is read-only or not yours to write; {make}")
    try:
        with held():
            with doing("reading", root):
                before = {rel: base64.b64encode((root / rel).read_bytes()).decode() for rel in after}
            files = {rel: {"before": b, "after": hashlib.sha256(after[rel]).hexdigest()} for rel, b in before.items()}
            write_atomic(root / JOURNAL, json.dumps({"release": target.release, "files": files}).encode())
        with held():
            for rel, data in after.items():
                write_atomic(root / rel, data)
        with held(), doing("removing", root / JOURNAL):
            (root / JOURNAL).unlink()
    except (ToolError, OSError, Interrupted) as exc:  # how far it got, the tree says: a journal, or the new bytes
        written = (root / JOURNAL).is_file()
        try:
            with held():
                recover(target, list(after))
        except (ToolError, OSError) as failed:
            raise ToolError(f"{target.label}: {exc}; putting the files back failed: {failed}", Exit.FAILED) from None
        finished = not written and all((root / rel).read_bytes() == data for rel, data in after.items())
        left = "rolled back: the files are as before" if written else f"it had finished: {done}" if finished else ""
        code = getattr(exc, "code", Exit.FAILED)  # a signal's 128+n, a refusal's own
        raise ToolError(f"{target.label}: {exc}; {left or 'nothing changed'}", code) from None


def undo(target: Target, files: list[str]) -> bool:
    """Undo what a killed run left, saying what it did, under the writer's lock; whether there was anything."""
    with held():
        undone = recover(target, files)
    if undone:
        say(f"{target.label}: undid what an interrupted run left: {undone}", final=False)
    return bool(undone)


def read(root: Path) -> Journal:
    """TARGET's journal, each file's state now: as before, patched (as the write left it), or changed since."""
    # Written by a rename, it is torn only by damage from outside: so is a path that is no file inside TARGET.
    path = root / JOURNAL
    if path.exists() and not path.is_file():
        raise ToolError(f"{path} is not a file: mtp-mask-fix keeps its journal there; remove it")
    if not path.is_file():
        return Journal()
    files = {}  # each file's bytes before, and its digest after; none where the journal cannot be read
    release = ""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        data = json.loads(path.read_text())
        release = str(data["release"])
        files = {rel: (base64.b64decode(e["before"]), e["after"]) for rel, e in data["files"].items()}
    inside = all((root / rel).resolve().parent.is_relative_to(root.resolve()) for rel in files)
    if not (inside and all((root / rel).parent.is_dir() and not (root / rel).is_dir() for rel in files)):
        files = {}
    for rel, (before, after) in files.items():
        now = (root / rel).read_bytes() if (root / rel).is_file() else None
        patched = (None if now is None else hashlib.sha256(now).hexdigest()) == after
        state = "as before" if now == before else "patched, not verified" if patched else "changed since"
        files[rel] = before, state
    return Journal(True, release, files)


def _leftovers(root: Path, files: list[str]) -> list[Path]:
    """The temporary files a killed write left beside the journal's place or a file it writes."""
    return [temp(root / rel) for rel in dict.fromkeys([JOURNAL, *files]) if temp(root / rel).exists()]


def left(root: Path, files: list[str]) -> str | None:
    """What a killed write left, said of each file, and what to do; None if it left nothing."""
    journal = read(root)
    stray = [str(path.relative_to(root)) for path in _leftovers(root, files)]
    if not journal.exists:
        return f"the temporary file {', '.join(stray)}; the next `apply` or `revert` removes it" if stray else None
    states = [state for _, state in journal.files.values()]
    said = ", ".join(f"{rel} {state}" for rel, (_, state) in journal.files.items())
    said = said or "naming no file it can restore: unreadable, or not the tool's"
    if "changed since" in states:
        return f"{JOURNAL} ({said}): if the files are as you want them, remove {root / JOURNAL}"
    then = "puts it back" if set(states) - {"as before"} else "removes it"
    return f"{JOURNAL} ({said}); the next `apply` or `revert` {then} first"


def recover(target: Target, files: list[str]) -> str:
    """Undo what a killed write left, under the caller's lock and held(); what it put back and removed, or ""."""
    # Refused where the tree changed since: a file neither as before nor as replaced, or another release in its place.
    root = target.root
    journal = read(root)
    states = {rel: state for rel, (_, state) in journal.files.items()}
    why = [f"{rel} is neither as it left it nor as it was" for rel, s in states.items() if s == "changed since"]
    if why or target.release != journal.release and "patched, not verified" in states.values():
        why.append(f"it was made for megatron-bridge {journal.release}, which now holds {target.release}")
        raise ToolError(
            f"{target.label}: changed since an interrupted run left {JOURNAL} ({why[0]}), so nothing was restored; if "
            f"the files are as you want them, remove {root / JOURNAL} and run the command again"
        )
    done = []
    for rel, (before, state) in journal.files.items():
        if state != "as before":
            write_atomic(root / rel, before)
            done.append(f"put back {rel}")
    for path in _leftovers(root, [*files, *journal.files]) + ([root / JOURNAL] if journal.exists else []):
        with doing("removing", path):
            path.unlink()
        done.append(f"removed {path.relative_to(root)}")
    return ", ".join(done)
