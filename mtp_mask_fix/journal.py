"""What makes a write all or nothing: one writer at a time per TARGET (a lock on its folder), each file replaced by one
rename, and a journal of what a run is about to replace, so that the next run puts back what a killed one left, and
never writes into a tree that changed since."""

import base64
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError


JOURNAL = ".mtp-mask-fix-journal.json"  # in TARGET while a write is unfinished: each file as it was, what replaces it
TEMP = ".mtp-mask-fix.tmp"  # `.NAME` + TEMP beside each file while its new bytes are written
WAIT = 300.0  # seconds a command waits for another's lock on TARGET: several ranks start at once


def digest(data: bytes | None) -> str | None:
    """sha256 of a file's bytes (None: no file)."""
    return None if data is None else hashlib.sha256(data).hexdigest()


def temp(path: Path) -> Path:
    """Where a file's new bytes are written before the rename."""
    return path.with_name(f".{path.name}{TEMP}")


def write_atomic(path: Path, data: bytes) -> None:
    """path's bytes become `data` in one rename; an existing file keeps its mode."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    with open(temp(path), "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(temp(path), mode)
    os.replace(temp(path), path)


class Lock:
    """flock(2) on TARGET's folder, shared (readers) or exclusive (a writer); it leaves no file behind and is gone with
    the process that held it, however it ended. Waits up to `wait` seconds, then refuses (Exit.BUSY)."""

    def __init__(self, root: Path, label: str, *, exclusive: bool, wait: float = WAIT):
        self.root, self.label, self.exclusive, self.wait = root, label, exclusive, wait

    def __enter__(self):
        self.fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._take(fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def _take(self, kind: int) -> None:
        deadline = time.monotonic() + self.wait
        while True:
            try:
                fcntl.flock(self.fd, kind | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ToolError(
                        f"{self.label}: another mtp-mask-fix process has held it for {self.wait:.0f} s; nothing "
                        "changed (run the command again once it has finished)",
                        Exit.BUSY,
                    ) from None
                time.sleep(0.05)

    def share(self) -> None:
        """From writer to reader: other readers may start (flock converts it; a writer may come between)."""
        self._take(fcntl.LOCK_SH)

    def __exit__(self, *exc):
        os.close(self.fd)


@dataclass(frozen=True)
class Entry:
    """One file of a journal: its bytes before, and the digests of before and of what replaces them."""

    before: bytes
    after: str


@dataclass(frozen=True)
class Journal:
    """What a run was about to replace in TARGET, and the Megatron-Bridge release TARGET held then."""

    release: str
    files: dict[str, Entry]

    @staticmethod
    def write(root: Path, release: str, before: dict[str, bytes], after: dict[str, bytes]) -> None:
        files = {
            rel: {"before": base64.b64encode(data).decode(), "after": digest(after[rel])}
            for rel, data in before.items()
        }
        write_atomic(root / JOURNAL, json.dumps({"release": release, "files": files}).encode())

    @staticmethod
    def read(root: Path) -> "Journal | None":
        """None when there is none; no files when it cannot be read or names a path outside TARGET (it is written by
        a rename: only damage from outside tears it)."""
        path = root / JOURNAL
        if path.exists() and not path.is_file():
            raise ToolError(f"{path} is not a file: mtp-mask-fix keeps its journal there; remove it")
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            files = {rel: Entry(base64.b64decode(e["before"]), e["after"]) for rel, e in data["files"].items()}
            release = str(data["release"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError):
            return Journal("", {})
        return Journal(release, files) if all(_file_in(root, rel) for rel in files) else Journal(release, {})


def _file_in(root: Path, rel: str) -> bool:
    path = root / rel
    return path.resolve().parent.is_relative_to(root.resolve()) and path.parent.is_dir() and not path.is_dir()


def _now(root: Path, rel: str) -> bytes | None:
    return (root / rel).read_bytes() if (root / rel).is_file() else None


def leftovers(root: Path, files: list[str]) -> list[Path]:
    """Temporary files a killed write left beside the journal's place or a file it writes."""
    return [temp(root / rel) for rel in [JOURNAL, *files] if temp(root / rel).exists()]


def left(root: Path, files: list[str]) -> str | None:
    """What a killed write left, said of each file now; None when it left nothing."""
    journal, stray = Journal.read(root), [str(path.relative_to(root)) for path in leftovers(root, files)]
    if journal is None:
        return f"the temporary file {', '.join(stray)}" if stray else None
    said = []
    for rel, entry in journal.files.items():
        now = _now(root, rel)
        state = (
            "as before"
            if now == entry.before
            else "patched, not verified"
            if digest(now) == entry.after
            else "changed since"
        )
        said.append(f"{rel} {state}")
    unreadable = "naming no file it can restore: unreadable, or not the tool's"
    return f"{JOURNAL} ({', '.join(said) or unreadable})"


def recover(root: Path, label: str, release: str, files: list[str]) -> str:
    """Put back what a killed write left (the journal's files, its temporary files), or refuse, changing nothing, where
    the tree changed since: a file that is neither as before nor as replaced, or another release in its place. Returns
    what it said of them ("" if nothing was left). Call it holding the writer's Lock, with signals held."""
    said, journal = left(root, files), Journal.read(root)
    for rel, entry in (journal.files if journal else {}).items():
        now = _now(root, rel)
        if now == entry.before:
            continue
        if digest(now) != entry.after or release != journal.release:
            why = (
                f"{rel} is neither as it left it nor as it was"
                if digest(now) != entry.after
                else (f"it was made for megatron-bridge {journal.release}, which now holds {release}")
            )
            raise ToolError(
                f"{label}: changed since an interrupted run left {JOURNAL} ({why}), so nothing was restored; if the "
                f"files are as you want them, remove {root / JOURNAL} and run the command again"
            )
    for rel, entry in (journal.files if journal else {}).items():
        if _now(root, rel) != entry.before:
            write_atomic(root / rel, entry.before)
    for path in leftovers(root, [*files, *(journal.files if journal else {})]):
        path.unlink(missing_ok=True)
    (root / JOURNAL).unlink(missing_ok=True)
    return said or ""


def close(root: Path) -> None:
    """The write is whole: the journal goes."""
    (root / JOURNAL).unlink()
