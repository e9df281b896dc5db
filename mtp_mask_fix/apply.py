"""`apply` and `revert`: all or nothing, a write at a time; apply verifies by behaviour what it writes before it
writes it, no lock held for a probe."""

import os

from mtp_mask_fix import journal
from mtp_mask_fix.check import State, check, fixed_how, touched
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.journal import WAIT, Lock
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.signals import Interrupted, held, say
from mtp_mask_fix.targets import Target
from mtp_mask_fix.verify import verify


FAILURES = (ToolError, OSError, Interrupted)  # what stops a command; an OSError exits 5


def apply(target: Target, patches: list[Patch], *, python: str | None, wait: float = WAIT) -> int:
    """Apply the patch unless the target is already fixed, verify it with `python` (if given), and say what it did."""
    lock, label, verified = Lock(target.root, target.label, wait), target.label, None  # the bytes verified aside
    with lock.held():  # most start-ups find the fix: they read it side by side
        verdict = check(target, patches)
    if verdict.state is State.INTERRUPTED:
        with lock.held(exclusive=True):
            _undo(target, patches)
            verdict = check(target, patches)
    if verdict.state is State.APPLIES:  # its new bytes verified aside, beside the other ranks; then written alone
        verified = verdict.rewrite, _probe(target, python, verdict.rewrite, f"{label}: nothing changed; ")
        with lock.held(exclusive=True):
            _undo(target, patches)
            verdict = check(target, patches)  # another rank may have written them meanwhile
            if verdict.state is State.APPLIES and verdict.rewrite == verified[0]:
                done = f"applied ({verdict.detail})"
                _write(target, verdict.rewrite, done + (" and verified" if python else ""))
                say(f"{label}: {done}{verified[1]}")
                return Exit.OK
    if verdict.state is State.APPLIES:  # the bytes to write are not the ones verified: the tree changed meanwhile
        raise ToolError(f"{label}: changed while the patch was verified; nothing changed: run it again", Exit.FAILED)
    unsure = verdict.state in (State.UNPROVEN, State.UNTOLD)  # the probe tells
    if unsure and not python:
        raise ToolError(f"{verdict}; `apply` without --no-verify runs the probe")
    fixed = "check cannot tell, the probe shows it" if unsure else fixed_how(verdict)  # fixed_how refuses the rest
    if not (verified and all((target.root / rel).read_bytes() == data for rel, data in verified[0].items())):
        said = f"{verdict}; " if unsure else f"{label}: its source reads as fixed ({fixed}); "
        verified = None, _probe(target, python, None, said + "nothing changed; ")  # the tree as it is
    say(f"{label}: already fixed ({fixed}); nothing changed{verified[1]}")
    return Exit.OK


def revert(target: Target, patches: list[Patch], *, wait: float = WAIT) -> int:
    """Take the patch out again, giving the files the bytes they had before it, and say what it did."""
    label = target.label
    with Lock(target.root, label, wait).held(exclusive=True):
        undone, verdict = _undo(target, patches), check(target, patches)
        if verdict.state is State.APPLIES and undone:  # what a killed apply left is undone: that is the release
            say(f"{label}: the patch is not applied: the files are as before it")
            return Exit.OK
        if verdict.state is State.APPLIES:
            raise ToolError(f"{label}: the patch is not applied here: nothing to revert")
        if verdict.state is State.EQUIVALENT:
            raise ToolError(f"{label}: fixed another way, not by this patch: nothing of the tool's to revert")
        if verdict.state not in (State.APPLIED, State.UNPROVEN):
            raise ToolError(str(verdict), verdict.state.code)
        done = f"reverted ({verdict.detail}): the files are as before the patch"
        _write(target, verdict.rewrite, done)
    say(f"{label}: {done}")
    return Exit.OK


def _undo(target: Target, patches: list[Patch]) -> bool:
    """Undo what a killed run left, saying what it did, under the writer's lock; whether there was anything."""
    with held():
        undone = journal.recover(target.root, target.label, target.release, touched(target, patches))
    if undone:
        say(f"{target.label}: undid what an interrupted run left: {undone}", final=False)
    return bool(undone)


def _write(target: Target, after: dict[str, bytes], done: str) -> None:
    """Give the files the bytes `after` under a journal, all or nothing (`done`: the work, should a signal end it)."""
    root = target.root
    for path in [root, *[where for rel in after for where in (root / rel, (root / rel).parent)]]:
        # Read-only by its mode (root writes anything, but the mode states intent), or by access(2): its mount too.
        if not (path.stat().st_mode & 0o200 and os.access(path, os.W_OK)):
            make = "make it writable (mtp-mask-fix writes a journal in TARGET and renames each file into place)"
            raise ToolError(f"{path} is read-only or not yours to write; {make}")
    try:
        with held():
            journal.write(root, target.release, after)
        with held():
            for rel, data in after.items():
                journal.write_atomic(root / rel, data)
        with held():
            journal.close(root)
    except FAILURES as exc:  # how far it got, the tree says: a journal, or the new bytes and none
        written = (root / journal.JOURNAL).is_file()
        try:
            with held():
                journal.recover(root, target.label, target.release, list(after))
        except (ToolError, OSError) as failed:
            raise ToolError(f"{target.label}: {exc}; putting the files back failed: {failed}", Exit.FAILED) from None
        finished = not written and all((root / rel).read_bytes() == data for rel, data in after.items())
        left = "rolled back: the files are as before" if written else f"it had finished: {done}" if finished else ""
        raise ToolError(
            f"{target.label}: {exc}; {left or 'nothing changed'}", getattr(exc, "code", Exit.FAILED)
        ) from None


def _probe(target: Target, python: str | None, after: dict | None, failed: str) -> str:
    """`; verified with PY: why`, "" without `python`; refused (exit 5), after `failed`, where the mask is not seen."""
    delivered, reason = verify(target, python, after) if python else (True, "")
    if not delivered:
        raise ToolError(f"{failed}not verified with {python}: {reason}", Exit.FAILED)
    return f"; verified with {python}: {reason}" if python else ""
