"""All or nothing for `apply`: a journal of the original bytes, atomic replacement, and signals turned into rollbacks.

Before it replaces any file, apply writes ROOT/.mtp-mask-fix-journal.json (atomically) holding every file's bytes as
they were and the digest of what it will write; it removes the journal only once the apply is verified (or once it
has put the originals back). Each file is replaced with os.replace from a temporary file in the same directory, so a
file is always either all old or all new. A journal left behind (kill -9, power loss) is how `check` and `verify`
tell the truth afterwards, and what the next `apply` restores from before it starts again.

SIGINT, SIGTERM and SIGHUP raise Interrupted, except inside a `critical()` block (journal writes, replacements,
rollback), which finishes first. `MTP_MASK_FIX_PAUSE=PHASE:FILE` (tests only) makes apply create FILE and wait at
PHASE, so a test can send a signal at a known moment instead of racing a sleep.
"""

import base64
import contextlib
import hashlib
import json
import os
import signal
import time
from pathlib import Path

from mtp_mask_fix.errors import Exit


JOURNAL = ".mtp-mask-fix-journal.json"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A signal arrived; BaseException so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def code(self) -> int:
        return Exit.interrupted(self.signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class Guard:
    """Signal handlers for the duration of a `with`: outside critical blocks a signal raises Interrupted at once,
    inside one it is held until the block ends."""

    def __init__(self):
        self.pending: int | None = None
        self.depth = 0
        self._old = {}

    def _handle(self, signum, frame):
        if not self.depth:
            raise Interrupted(signum)
        self.pending = self.pending or signum

    def __enter__(self) -> "Guard":
        self._old = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.pending and not self.depth:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)


def phase(name: str) -> None:
    """Test hook: with MTP_MASK_FIX_PAUSE=NAME:FILE, create FILE and wait (a signal ends the wait)."""
    want, _, marker = os.environ.get("MTP_MASK_FIX_PAUSE", "").partition(":")
    if want == name and marker:
        Path(marker).write_text(f"{os.getpid()}\n")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)


def digest(data: bytes) -> str:
    """sha256, hex."""
    return hashlib.sha256(data).hexdigest()


def _temp(path: Path) -> Path:
    return path.with_name(f".{path.name}.mtp-mask-fix.tmp")


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """path's bytes become `data` in one rename; the file keeps `mode`."""
    temp = _temp(path)
    with open(temp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(temp, mode)
    os.replace(temp, path)


def write_journal(root: Path, before: dict[str, bytes], after: dict[str, bytes]) -> None:
    """ROOT/JOURNAL: each file's bytes as they are and the digest of what will replace them."""
    entries = {
        rel: {"before": base64.b64encode(data).decode(), "after": digest(after[rel])} for rel, data in before.items()
    }
    write_atomic(root / JOURNAL, json.dumps({"files": entries}, indent=1).encode(), 0o644)


def read_journal(root: Path) -> dict[str, dict] | None:
    """The journal's entries (relative path -> before bytes, after digest), or None when there is none."""
    path = root / JOURNAL
    if not path.is_file():
        return None
    try:
        entries = json.loads(path.read_text())["files"]
        return {rel: {"before": base64.b64decode(e["before"]), "after": e["after"]} for rel, e in entries.items()}
    except (ValueError, KeyError, TypeError):  # a torn journal: only before its rename, so no file was replaced
        return {}


def describe(root: Path, entries: dict[str, dict]) -> str:
    """What a left-behind journal says about each file: as before, patched, or something else."""
    states = []
    for rel, entry in entries.items():
        path = root / rel
        data = path.read_bytes() if path.is_file() else None
        state = (
            "as before"
            if data == entry["before"]
            else "patched, not verified"
            if data is not None and digest(data) == entry["after"]
            else "changed since"
        )
        states.append(f"{rel} {state}")
    return ", ".join(states) or "no file replaced"


def restore(root: Path, entries: dict[str, dict]) -> None:
    """Put every file back as the journal holds it, then drop the journal and any temporary file."""
    for rel, entry in entries.items():
        path = root / rel
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
        if not path.is_file() or path.read_bytes() != entry["before"]:
            write_atomic(path, entry["before"], mode)
        _temp(path).unlink(missing_ok=True)
    (root / JOURNAL).unlink(missing_ok=True)
    _temp(root / JOURNAL).unlink(missing_ok=True)
