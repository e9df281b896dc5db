"""`apply` and `revert`: all or nothing; apply verifies by behaviour what it writes, no lock held for the probe."""

from mtp_mask_fix.check import State, candidates, check, touched
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.journal import WAIT, Lock, undo, write
from mtp_mask_fix.signals import say
from mtp_mask_fix.targets import find, interpreter
from mtp_mask_fix.verify import proven


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
            undo(tree, touched(tree, patches))
            verdict = check(tree, patches)
    verified = {}  # the new bytes the probe saw hand the model its mask, verified aside beside the other ranks
    if verdict.state is State.APPLIES:
        verified = verdict.rewrite
        shown = proven(tree, prober, verified, f"{tree.label}: nothing changed; ")
        with lock.held(exclusive=True):  # then written alone
            undo(tree, touched(tree, patches))
            verdict = check(tree, patches)  # another rank may have written them meanwhile
            if verdict.state is State.APPLIES and verdict.rewrite == verified:
                done = f"applied ({verdict.detail})"
                write(tree, verified, f"{done} and verified" if prober else done)
                say(f"{tree.label}: {done}{shown}")
                return Exit.OK
    if verdict.state is State.APPLIES:  # the bytes to write are not the ones verified: the tree changed meanwhile
        said = f"{tree.label}: changed while the patch was verified; nothing changed: run it again"
        raise ToolError(said, Exit.FAILED)
    unsure = verdict.state in (State.UNPROVEN, State.UNTOLD)  # the probe tells
    if not unsure and not verdict.how_fixed:
        raise ToolError(str(verdict), verdict.state.code)
    if unsure and not prober:
        raise ToolError(f"{verdict}; `apply` without --no-verify runs the probe")
    fixed = verdict.how_fixed or "check cannot tell, the probe shows it"
    if not (verified and all((tree.root / rel).read_bytes() == data for rel, data in verified.items())):
        said = f"{verdict}; " if unsure else f"{tree.label}: its source reads as fixed ({fixed}); "
        shown = proven(tree, prober, {}, f"{said}nothing changed; ")  # the tree as it is
    say(f"{tree.label}: already fixed ({fixed}); nothing changed{shown}")
    return Exit.OK


def revert(target: str | None, *, python: str, wait: float = WAIT) -> int:
    """`revert`: give the files the bytes they had before the patch; say what it did."""
    tree = find(target, python)
    patches = candidates()
    with Lock(tree.root, tree.label, wait).held(exclusive=True):
        undone = undo(tree, touched(tree, patches))
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
        write(tree, verdict.rewrite, done)
    say(f"{tree.label}: {done}")
    return Exit.OK
