"""`apply` and `revert`, all or nothing, one writer at a time; apply is verified by behaviour or rolled back."""

import contextlib
import os

from mtp_mask_fix import journal
from mtp_mask_fix.check import State, check, fixed_how, touched
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.journal import WAIT
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.signals import Interrupted, held
from mtp_mask_fix.targets import Target
from mtp_mask_fix.verify import verify


FAILURES = (ToolError, OSError, Interrupted)  # what stops a command; an OSError exits 5


def apply(target: Target, patches: list[Patch], *, python: str | None, wait: float = WAIT) -> tuple[str, Exit]:
    """Apply the patch unless the target is already fixed, then verify it with `python` (if given)."""
    with journal.lock(target.root, target.label, wait=wait):  # most start-ups find the fix: they read it side by side
        verdict = check(target, patches)
    writes = verdict.state in (State.APPLIES, State.INTERRUPTED)  # the rest only verify, outside the writer's lock
    writer = _writer(target, patches, wait) if writes else contextlib.nullcontext(("", lambda: None))
    with writer as (put_back, unlock):
        verdict = check(target, patches) if writes else verdict
        if verdict.state is State.APPLIES:
            return put_back + _write(target, verdict.rewrite, f"applied ({verdict.detail})", python), Exit.OK
        fixed = fixed_how(verdict)
        unlock()  # nothing to write (another rank wrote it, maybe): verified beside the others
        verified = _verified(target, python, f"{target.label}: nothing changed (its source reads as fixed: {fixed}); ")
        return f"{put_back}{target.label}: already fixed ({fixed}); nothing changed{verified}", Exit.OK


def revert(target: Target, patches: list[Patch], *, wait: float = WAIT) -> tuple[str, Exit]:
    """Take the patch out again, giving the files the bytes they had before it."""
    with _writer(target, patches, wait) as (put_back, _):
        verdict = check(target, patches)
        if verdict.state is State.APPLIES and put_back:  # what a killed apply left is put back: that is the release
            return f"{put_back}{target.label}: the patch is not applied: the files are as before it", Exit.OK
        if verdict.state is State.APPLIES:
            raise ToolError(f"{target.label}: the patch is not applied here: nothing to revert")
        if verdict.state is State.EQUIVALENT:
            raise ToolError(f"{target.label}: fixed another way, not by this patch: nothing of the tool's to revert")
        if verdict.state not in (State.APPLIED, State.UNPROVEN):
            raise ToolError(str(verdict), verdict.state.code)
        done = f"reverted ({verdict.detail}): the files are as before the patch"
        return put_back + _write(target, verdict.rewrite, done, None), Exit.OK


@contextlib.contextmanager
def _writer(target: Target, patches: list[Patch], wait: float):
    """Be TARGET's one writer, having put back what an interrupted run left; yields the line saying so, and unlock."""
    said = ""
    try:
        with journal.lock(target.root, target.label, exclusive=True, wait=wait) as unlock:
            with held():
                said = journal.recover(target.root, target.label, target.release, touched(target, patches))
            yield f"{target.label}: put back what an interrupted run left ({said})\n" if said else "", unlock
    except FAILURES as exc:  # a write says what it left itself; this is before or after one
        if said:
            left = f"put back what an interrupted run left ({said}); then {exc}"
            raise ToolError(f"{target.label}: {left}", getattr(exc, "code", Exit.FAILED)) from None
        raise


def _write(target: Target, after: dict[str, bytes], done: str, python: str | None) -> str:
    """Give the files the bytes `after` under a journal and verify them with `python`, or put them back; its line."""
    root = target.root
    for path in [root, *[where for rel in after for where in (root / rel, (root / rel).parent)]]:
        # Read-only by its mode (root writes anything, but the mode states intent) or by access(2).
        if not (path.stat().st_mode & 0o200 and os.access(path, os.W_OK)):
            raise ToolError(
                f"{path} is read-only or not yours to write; make it writable (mtp-mask-fix writes a journal in "
                "TARGET and renames each file into place)"
            )
    try:
        with held():
            journal.write(root, target.release, after)
        with held():
            for rel, data in after.items():
                journal.write_atomic(root / rel, data)
        verified = _verified(target, python)
        with held():
            journal.close(root)
        return f"{target.label}: {done}{verified}"
    except FAILURES as exc:  # how far it got, the tree says: a journal, or the new bytes and none
        written = (root / journal.JOURNAL).is_file()
        try:
            with held():
                journal.recover(root, target.label, target.release, list(after))
        except (ToolError, OSError) as failed:
            raise ToolError(f"{target.label}: {exc}; putting the files back failed: {failed}", Exit.FAILED) from None
        finished = not written and all((root / rel).read_bytes() == data for rel, data in after.items())
        left = f"it had finished: {done}" + (" and verified" if python else "") if finished else "nothing changed"
        left = "rolled back: the files are as before" if written else left
        raise ToolError(f"{target.label}: {exc}; {left}", getattr(exc, "code", Exit.FAILED)) from None


def _verified(target: Target, python: str | None, failed: str = "") -> str:
    """`; verified with PY: why`, "" without `python`; refused (exit 5), after `failed`, where the mask is not seen."""
    delivered, reason = verify(target, python) if python else (True, "")
    if not delivered:
        raise ToolError(f"{failed}not verified with {python}: {reason}", Exit.FAILED)
    return f"; verified with {python}: {reason}" if python else ""
