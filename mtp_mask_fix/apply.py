"""Writing a target: `apply`, all or nothing (a journal, files replaced by a rename, signals held while writing) and
verified by behaviour."""

import base64
import contextlib
import hashlib
import json
import os
import signal
import tempfile
from pathlib import Path

from mtp_mask_fix.check import JOURNAL, already_fixed, check, journal, left, scope, verify
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, stripped
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.targets import Target


SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class Interrupted(BaseException):
    """A signal arrived; a BaseException, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        self.name, self.code = signal.Signals(signum).name, Exit.INTERRUPTED + signum
        super().__init__(self.name)


class Guard:
    """Inside the `with`, SIGINT, SIGTERM and SIGHUP raise Interrupted (at the end of a `held()` block)."""

    def __enter__(self):
        self.old = {sig: signal.signal(sig, self.interrupt) for sig in SIGNALS}

    def __exit__(self, *exc):
        for sig, handler in self.old.items():
            signal.signal(sig, handler)

    def interrupt(self, signum, frame):
        raise Interrupted(signum)


@contextlib.contextmanager
def held():
    """Signals blocked until the block ends, then delivered: no write is cut short (spawn nothing: it inherits that)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [])  # first: a handler run by the call below cannot skip `finally`
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _temp(path: Path) -> Path:
    return path.with_name(f".{path.name}.mtp-mask-fix.tmp")


def write_atomic(path: Path, data: bytes) -> None:
    """path's bytes become `data` in one rename; an existing file keeps its mode."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    with open(_temp(path), "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(_temp(path), mode)
    os.replace(_temp(path), path)


def restore(root: Path) -> str:
    """Put back the files a journal holds, then drop it and any temporary file; what it said of them ("" if none)."""
    said, entries = left(root) or "", journal(root) or {}
    for rel, (before, _) in entries.items():
        if not (root / rel).is_file() or (root / rel).read_bytes() != before:
            write_atomic(root / rel, before)
    for path in [root / JOURNAL, *map(root.joinpath, entries)]:
        _temp(path).unlink(missing_ok=True)
    (root / JOURNAL).unlink(missing_ok=True)
    return said


def apply(target: Target, patches: list[Patch], *, python: str | None) -> tuple[str, Exit]:
    """New bytes made aside, a journal of the old ones, each file replaced by a rename, then (with `python`) verified
    by behaviour; rolled back unless it holds or on a signal before the end, which exits 128+n saying which."""
    root, finished = target.root, ""
    with Guard():  # also when called without the CLI's
        try:
            with held():
                said = restore(root)
            recovered = f"{target.label}: restored the files an interrupted apply left ({said})\n" if said else ""
            verdict = check(target, patches)
            if fixed := already_fixed(verdict):  # verified all the same: exit 0 means it holds where it trains
                verified = _verified(target, python, f"already fixed ({fixed}), not verified with {python}")
                return f"{recovered}{target.label}: already fixed ({fixed}); nothing changed{verified}", Exit.OK
            before, after = _new_bytes(target, verdict.patch)
            digest = {rel: hashlib.sha256(data).hexdigest() for rel, data in after.items()}
            entries = {
                rel: {"before": base64.b64encode(data).decode(), "after": digest[rel]} for rel, data in before.items()
            }
            with held():
                write_atomic(root / JOURNAL, json.dumps({"files": entries}).encode())
            with held():
                for rel, data in after.items():
                    write_atomic(root / rel, data)
            verified = _verified(target, python, "rolled back")
            with held():
                (root / JOURNAL).unlink()
                finished = "the apply had finished: patched" + (" and verified" if python else " (not verified)")
            return f"{recovered}{target.label}: applied ({verdict.detail}){verified}", Exit.OK
        except BaseException as exc:
            with held():
                rolled_back = restore(root)
            if not isinstance(exc, Interrupted):
                raise
            state = "rolled back: the files are as before" if rolled_back else finished or "nothing changed"
            raise ToolError(f"{target.label}: interrupted by {exc.name}: {state}", exc.code) from None


def _verified(target: Target, python: str | None, failed: str) -> str:
    """What verify says under `python` ("" without one), or a refusal that begins with `failed`."""
    delivered, reason = verify(target, python) if python else (True, "")
    if not delivered:
        raise ToolError(f"{target.label}: {failed}: {reason}", Exit.FAILED)
    return f"; verified with {python}: {reason}" if python else ""


def _new_bytes(target: Target, patch: Patch) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The files' bytes as they are and as git apply makes them on copies; refused first where apply could not
    replace a file: read-only by its mode (root writes anything, but that states intent) or by access(2)."""
    src = scope(target, patch)
    files = [stripped(path, target.strip) for path in patch.paths(src=src)]
    for path in [target.root, *[where for rel in files for where in (target.root / rel, (target.root / rel).parent)]]:
        if not (path.stat().st_mode & 0o200 and os.access(path, os.W_OK)):
            raise ToolError(
                f"{path} is read-only or not yours to write; make it writable (apply writes a journal in TARGET and "
                "renames each file into place)"
            )
    before = {rel: (target.root / rel).read_bytes() for rel in files}
    with tempfile.TemporaryDirectory() as tmp:
        for rel in files:
            Path(tmp, rel).parent.mkdir(parents=True, exist_ok=True)
            Path(tmp, rel).write_bytes(before[rel])
        if error := apply_diff(patch.part(src=src), Path(tmp), strip=target.strip):
            raise ToolError(f"the patch does not apply: {first_error_line(error)}", Exit.DRIFTED)
        return before, {rel: Path(tmp, rel).read_bytes() for rel in files}
