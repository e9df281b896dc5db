"""`apply` and `revert`, all or nothing, one writer at a time; apply is verified by behaviour or rolled back."""

import os
from collections.abc import Callable

from mtp_mask_fix import journal
from mtp_mask_fix.check import State, Verdict, check, fixed_how, touched
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line
from mtp_mask_fix.journal import WAIT
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.signals import Interrupted, guard, held
from mtp_mask_fix.targets import Target
from mtp_mask_fix.verify import verify


def apply(target: Target, patches: list[Patch], *, python: str | None, wait: float = WAIT) -> tuple[str, Exit]:
    """Apply the patch unless the target is already fixed, then verify it with `python` (if given)."""

    def patched_files(verdict: Verdict, recovered: str):
        if fixed := fixed_how(verdict):
            return f"already fixed ({fixed}); nothing changed", None
        return f"applied ({verdict.detail})", _new_bytes(verdict)

    return _write(target, patches, patched_files, python=python, wait=wait)


def revert(target: Target, patches: list[Patch], *, wait: float = WAIT) -> tuple[str, Exit]:
    """Take the patch out again, giving the files the bytes they had before it."""

    def reverted_files(verdict: Verdict, recovered: str):
        if verdict.state == State.APPLIES and recovered:  # what a killed apply left is put back: that is the release
            return "the patch is not applied: the files are as before it", None
        if verdict.state == State.APPLIES:
            raise ToolError(f"{target.label}: the patch is not applied here: nothing to revert")
        if verdict.state == State.EQUIVALENT:
            raise ToolError(f"{target.label}: fixed another way, not by this patch: nothing of the tool's to revert")
        if verdict.state not in (State.APPLIED, State.OVERRIDDEN):
            raise ToolError(str(verdict), verdict.state.code)
        return f"reverted ({verdict.detail}): the files are as before the patch", _new_bytes(verdict, reverse=True)

    return _write(target, patches, reverted_files, python=None, wait=wait)


def _write(target: Target, patches: list[Patch], new_files: Callable, *, python: str | None, wait: float):
    """Write what `new_files(verdict, what was put back)` returns (what it does, each file's new bytes or None)."""
    # Most start-ups find the fix and only verify it: they do so under a reader's lock, beside each other.
    label, files = target.label, touched(target, patches)

    def without_writing() -> str | None:
        if journal.left(target.root, files) is None and (done := new_files(check(target, patches), ""))[1] is None:
            return f"{label}: {done[0]}{_verified(target, python, f'{done[0]}, but')}"
        return None

    try:
        with guard(), journal.lock(target.root, label, wait=wait, unless=without_writing) as read:
            return (read, Exit.OK) if read is not None else _as_writer(target, patches, new_files, python)
    except Interrupted as exc:  # waiting, or verifying what was already fixed: nothing was written
        raise ToolError(f"{label}: interrupted by {exc.name}: nothing changed", exc.code) from None


def _as_writer(target: Target, patches: list[Patch], new_files: Callable, python: str | None) -> tuple[str, Exit]:
    """Write as the lock's writer: put back what a killed run left, journal, replace, verify, or roll back."""
    # A signal before the end rolls back too, and exits 128+n saying which.
    root, label = target.root, target.label
    wrote, finished, said = False, "nothing changed", ""
    try:
        with held():
            said = journal.recover(root, label, target.release, touched(target, patches))
            finished = f"it put back what an interrupted run left ({said})" if said else finished
        recovered = f"{label}: put back what an interrupted run left ({said})\n" if said else ""
        done, after = new_files(check(target, patches), said)
        if after is None:  # nothing to write; exit 0 still means verified where it trains
            return f"{recovered}{label}: {done}{_verified(target, python, f'{done}, but')}", Exit.OK
        before = {rel: (root / rel).read_bytes() for rel in after}
        with held():
            wrote = True
            journal.write(root, target.release, before, after)
        with held():
            for rel, data in after.items():
                journal.write_atomic(root / rel, data)
        verified = _verified(target, python, "rolled back:")
        with held():
            journal.close(root)
            finished = f"it had finished: {done}" + (" and verified" if python else "")
        return f"{recovered}{label}: {done}{verified}", Exit.OK
    except BaseException as exc:
        rolled_back = ""
        if wrote:
            with held():
                rolled_back = journal.recover(root, label, target.release, list(after))
        if isinstance(exc, ToolError) and said and not wrote:  # it did change something: say what
            raise ToolError(f"{label}: put back what an interrupted run left ({said}); then: {exc}", exc.code)
        if not isinstance(exc, Interrupted):
            raise
        state = "rolled back: the files are as before" if rolled_back else finished
        raise ToolError(f"{label}: interrupted by {exc.name}: {state}", exc.code) from None


def _verified(target: Target, python: str | None, failed: str) -> str:
    """The line's ending that says what `python` verified ("" without one); refused, beginning with `failed`."""
    delivered, reason = verify(target, python) if python else (True, "")
    if not delivered:
        raise ToolError(f"{target.label}: {failed} not verified with {python}: {reason}", Exit.FAILED)
    return f"; verified with {python}: {reason}" if python else ""


def _new_bytes(verdict: Verdict, *, reverse: bool = False) -> dict[str, bytes]:
    """Each file's bytes as git apply (or apply -R) makes them on a copy, refused where it could not be replaced."""
    # Read-only by its mode (root writes anything, but the mode states intent) or by access(2).
    root, files = verdict.target.root, verdict.files
    for path in [root, *[where for rel in files for where in (root / rel, (root / rel).parent)]]:
        if not (path.stat().st_mode & 0o200 and os.access(path, os.W_OK)):
            raise ToolError(
                f"{path} is read-only or not yours to write; make it writable (mtp-mask-fix writes a journal in "
                "TARGET and renames each file into place)"
            )
    with journal.scratch() as tmp:
        for rel in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes((root / rel).read_bytes())
        diff = verdict.patch.part(src=verdict.src)
        if error := apply_diff(diff, tmp, strip=verdict.target.strip, reverse=reverse):
            raise ToolError(f"the patch does not apply: {first_error_line(error)}", Exit.DRIFTED)
        return {rel: (tmp / rel).read_bytes() for rel in files}
