"""What makes a write all or nothing: a lock on TARGET, one rename a file, a journal of what a killed run left."""

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError, doing


JOURNAL = ".mtp-mask-fix-journal.json"  # in TARGET while a write is unfinished: each file as it was, what replaces it
TEMP = ".mtp-mask-fix.tmp"  # `.NAME` + TEMP beside each file while its new bytes are written
WAIT = 300.0  # seconds a command waits for another's lock on TARGET: several ranks start at once
Entries = dict[str, tuple[bytes, str]]  # file: (its bytes before, the sha256 of what replaces them)
UNREADABLE = "naming no file it can restore: unreadable, or not the tool's"
SCRATCH = "mtp-mask-fix-scratch-"  # a run's temporary folders in $TMPDIR (`watch` names its own otherwise)


def digest(data: bytes | None) -> str | None:
    """The sha256 of a file's bytes, None for no file."""
    return None if data is None else hashlib.sha256(data).hexdigest()


def temp(path: Path) -> Path:
    """Where a file's new bytes are written before the rename."""
    return path.with_name(f".{path.name}{TEMP}")


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
    """A temporary folder in $TMPDIR, locked while its run lives: a later run removes it if this one is killed."""
    for stale in Path(tempfile.gettempdir()).glob(f"{SCRATCH}*"):
        with contextlib.suppress(OSError):
            fd = os.open(stale, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live run holds its own: BlockingIOError
                shutil.rmtree(stale)
            finally:
                os.close(fd)
    while True:  # made, then locked: a sweep in between removes it, and it is made again
        with doing("making a temporary folder in", tempfile.gettempdir()):
            path = Path(tempfile.mkdtemp(prefix=SCRATCH))
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if path.is_dir() and path.stat().st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


@contextlib.contextmanager
def lock(root: Path, label: str, *, exclusive: bool = False, wait: float = WAIT):
    """Hold flock(2) on TARGET's folder, shared to read it or exclusive to check and write it; yields its unlock."""
    # A waiter sleeps in the kernel's queue and takes the lock once it is free; SIGALRM tells a person still waiting
    # after 2 s why, and ends the wait. The lock leaves no file behind and goes with its process, however it ends.

    def alarm(signum, frame):
        if said or wait <= 2:
            raise TimeoutError
        print(f"mtp-mask-fix: waiting for the lock on {label}, which another process holds", file=sys.stderr)
        said.append(True)

    with doing("locking", root):
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    said, previous = [], signal.signal(signal.SIGALRM, alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, min(wait, 2), max(wait - 2, 0))
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        except (TimeoutError, BlockingIOError):  # even had just before the alarm: closing fd frees it
            held = f"its lock was not free within {wait:g} s (another process held it)"
            raise ToolError(f"{label}: {held}; nothing changed: run it again once that one ends", Exit.BUSY) from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        yield lambda: fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def write(root: Path, release: str, after: dict[str, bytes]) -> None:
    """Write the journal of a write about to give the files the bytes `after` in a TARGET holding `release`."""
    with doing("reading", root):
        before = {rel: base64.b64encode((root / rel).read_bytes()).decode() for rel in after}
    files = {rel: {"before": before[rel], "after": digest(data)} for rel, data in after.items()}
    write_atomic(root / JOURNAL, json.dumps({"release": release, "files": files}).encode())


def read(root: Path) -> tuple[str, Entries] | None:
    """The release and entries of a killed write's journal, None without one, no entries if it is unreadable."""
    # Written by a rename, it is torn only by damage from outside: so is a path that is no file inside TARGET.
    path = root / JOURNAL
    if path.exists() and not path.is_file():
        raise ToolError(f"{path} is not a file: mtp-mask-fix keeps its journal there; remove it")
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        entries = {rel: (base64.b64decode(e["before"]), e["after"]) for rel, e in data["files"].items()}
        release = str(data["release"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return "", {}
    inside = all((root / rel).resolve().parent.is_relative_to(root.resolve()) for rel in entries)
    files = all((root / rel).parent.is_dir() and not (root / rel).is_dir() for rel in entries)
    return (release, entries) if inside and files else (release, {})


def _now(root: Path, rel: str) -> bytes | None:
    return (root / rel).read_bytes() if (root / rel).is_file() else None


def _leftovers(root: Path, files: list[str]) -> list[Path]:
    """The temporary files a killed write left beside the journal's place or a file it writes."""
    return [temp(root / rel) for rel in [JOURNAL, *files] if temp(root / rel).exists()]


def left(root: Path, files: list[str], *, next_step: bool = True) -> str | None:
    """What a killed write left, said of each file, and (with `next_step`) what to do; None if it left nothing."""
    journal, stray = read(root), [str(path.relative_to(root)) for path in _leftovers(root, files)]

    def then(step: str) -> str:
        return f"; the next `apply` or `revert` {step}" if next_step else ""

    if journal is None:
        return f"the temporary file {', '.join(stray)}{then('removes it')}" if stray else None
    said = []
    for rel, (before, after) in journal[1].items():
        now = _now(root, rel)
        said.append(
            f"{rel} "
            + ("as before" if now == before else "patched, not verified" if digest(now) == after else "changed since")
        )
    if any(state.endswith("changed since") for state in said):
        return f"{JOURNAL} ({', '.join(said)}): if the files are as you want them, remove {root / JOURNAL}"
    return f"{JOURNAL} ({', '.join(said) or UNREADABLE}){then('puts it back first')}"


def recover(root: Path, label: str, release: str, files: list[str]) -> str:
    """Put back what a killed write left and say what it was, or refuse where the tree changed since."""
    # Changed since: a file neither as before nor as replaced, or another release in its place. The caller holds the
    # writer's lock, with signals held.
    said, (made_for, entries) = left(root, files, next_step=False), read(root) or (release, {})
    for rel, (before, after) in entries.items():
        if (now := _now(root, rel)) != before and (digest(now) != after or release != made_for):
            why = f"it was made for megatron-bridge {made_for}, which now holds {release}"
            why = f"{rel} is neither as it left it nor as it was" if digest(now) != after else why
            raise ToolError(
                f"{label}: changed since an interrupted run left {JOURNAL} ({why}), so nothing was restored; if the "
                f"files are as you want them, remove {root / JOURNAL} and run the command again"
            )
    for rel, (before, _) in entries.items():
        if _now(root, rel) != before:
            write_atomic(root / rel, before)
    for path in [*_leftovers(root, [*files, *entries]), root / JOURNAL]:
        with doing("removing", path):
            path.unlink(missing_ok=True)
    return said or ""


def close(root: Path) -> None:
    """Remove the journal of a whole write."""
    with doing("removing", root / JOURNAL):
        (root / JOURNAL).unlink()
