"""`apply` and `revert`: all or nothing, a write at a time; apply verifies by behaviour what it writes before it
writes it, no lock held for a probe."""

import os

from mtp_mask_fix import journal
from mtp_mask_fix.check import State, candidates, check, fixed_how, touched
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.journal import WAIT, Lock
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.signals import Interrupted, held, say
from mtp_mask_fix.targets import Target, find, interpreter
from mtp_mask_fix.verify import verify as probe


def apply(target: str | None, *, verify: bool, python: str, wait: float = WAIT) -> int:
    """`apply`: the patch, unless TARGET is already fixed, verified first (`verify`) with `python`; say what it did."""
    tree = find(target, python)
    prober = interpreter(python) if verify else None
    patches = candidates()
    lock = Lock(tree.root, tree.label, wait)
    with lock.held():  # most start-ups find the fix: they read it side by side
        verdict = check(tree, patches)
    if verdict.state is State.INTERRUPTED:
        with lock.held(exclusive=True):
            _undo(tree, patches)
            verdict = check(tree, patches)
    verified = {}  # the new bytes the probe saw hand the model its mask, verified aside beside the other ranks
    shown = ""  # what the probe said of them
    if verdict.state is State.APPLIES:
        verified = verdict.rewrite
        shown = _verified(tree, prober, verified, f"{tree.label}: nothing changed; ")
        with lock.held(exclusive=True):  # then written alone
            _undo(tree, patches)
            verdict = check(tree, patches)  # another rank may have written them meanwhile
            if verdict.state is State.APPLIES and verdict.rewrite == verified:
                done = f"applied ({verdict.detail})"
                _write(tree, verified, f"{done} and verified" if prober else done)
                say(f"{tree.label}: {done}{shown}")
                return Exit.OK
    if verdict.state is State.APPLIES:  # the bytes to write are not the ones verified: the tree changed meanwhile
        raise ToolError(
            f"{tree.label}: changed while the patch was verified; nothing changed: run it again", Exit.FAILED
        )
    unsure = verdict.state in (State.UNPROVEN, State.UNTOLD)  # the probe tells
    if unsure and not prober:
        raise ToolError(f"{verdict}; `apply` without --no-verify runs the probe")
    fixed = "check cannot tell, the probe shows it" if unsure else fixed_how(verdict)  # fixed_how refuses the rest
    if not (verified and all((tree.root / rel).read_bytes() == data for rel, data in verified.items())):
        said = f"{verdict}; " if unsure else f"{tree.label}: its source reads as fixed ({fixed}); "
        shown = _verified(tree, prober, {}, f"{said}nothing changed; ")  # the tree as it is
    say(f"{tree.label}: already fixed ({fixed}); nothing changed{shown}")
    return Exit.OK


def revert(target: str | None, *, python: str, wait: float = WAIT) -> int:
    """`revert`: give the files the bytes they had before the patch; say what it did."""
    tree = find(target, python)
    patches = candidates()
    with Lock(tree.root, tree.label, wait).held(exclusive=True):
        undone = _undo(tree, patches)
        verdict = check(tree, patches)
        if verdict.state is State.APPLIES and undone:  # what a killed apply left is undone: that is the release
            say(f"{tree.label}: the patch is not applied: the files are as before it")
            return Exit.OK
        if verdict.state is State.APPLIES:
            raise ToolError(f"{tree.label}: the patch is not applied here: nothing to revert")
        if verdict.state is State.EQUIVALENT:
            raise ToolError(f"{tree.label}: fixed another way, not by this patch: nothing of the tool's to revert")
        if verdict.state not in (State.APPLIED, State.UNPROVEN):
            raise ToolError(str(verdict), verdict.state.code)
        done = f"reverted ({verdict.detail}): the files are as before the patch"
        _write(tree, verdict.rewrite, done)
    say(f"{tree.label}: {done}")
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
    except (ToolError, OSError, Interrupted) as exc:  # how far it got, the tree says: a journal, or the new bytes
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


def _verified(target: Target, python: str | None, after: dict[str, bytes], failed: str) -> str:
    """`; verified with PY: why`, "" without `python`; refused (exit 5), after `failed`, where the mask is not seen."""
    if not python:
        return ""
    delivered, reason = probe(target, python, after)
    if not delivered:
        raise ToolError(f"{failed}not verified with {python}: {reason}", Exit.FAILED)
    return f"; verified with {python}: {reason}"
