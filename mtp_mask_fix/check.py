"""Where a target stands with respect to the patch and its backports, read and never written: its verdict."""

import difflib
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from mtp_mask_fix import journal, trial
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.git import first_error_line, stripped
from mtp_mask_fix.patch import Patch, failed_hunk
from mtp_mask_fix.paths import PATCHES
from mtp_mask_fix.reading import Reading, read, unbound
from mtp_mask_fix.targets import Kind, Target


class State(Enum):
    """Where a target stands: its message and exit code."""

    INTERRUPTED = ("an interrupted run left {detail}", Exit.FAILED)
    LINKED = ("{detail} is a symlink: apply writes no link nor beyond one; name the tree that holds it", Exit.USAGE)
    APPLIES = ("the patch applies ({detail}); the bug is present: `apply` fixes it", Exit.OK)
    APPLIED = ("already applied ({detail}); nothing to do", Exit.ALREADY_APPLIED)
    UNTOLD = ("check cannot tell: {why}; `mtp-mask-fix verify` decides", Exit.USAGE)
    UNPROVEN = ("the patch is applied ({detail}), but " + UNTOLD[0], Exit.USAGE)
    LOCAL_CHANGES = ("uncommitted local changes in the patch's region ({detail}); commit or stash them", Exit.USAGE)
    INSTALLED_EDITS = ("local edits in the patch's region ({detail}) unlike its wheel's RECORD: undo them", Exit.USAGE)
    EQUIVALENT = ("fixed another way: gpt_step passes loss_mask to the model; nothing to apply", Exit.ALREADY_APPLIED)
    DRIFTED = ("drifted: {detail}", Exit.DRIFTED)

    @property
    def code(self) -> Exit:
        return self.value[1]


@dataclass(frozen=True)
class Verdict:
    """A target's state, the patch judged by, a detail, and the files' bytes with the patch, or without it."""

    target: Target
    state: State
    detail: str = ""
    patch: Patch | None = None
    rewrite: dict[str, bytes] = field(default_factory=dict, repr=False)  # upstream's test file only where it fits
    why: str = ""  # what keeps its text from showing the fix

    def __str__(self) -> str:
        return f"{self.target.label}: " + self.state.value[0].format(detail=self.detail, why=self.why)

    @property
    def how_fixed(self) -> str:
        """How the target already holds the fix: by which patch, or "another way"; "" where it does not."""
        return {State.APPLIED: self.detail, State.EQUIVALENT: "another way"}.get(self.state, "")


def candidates() -> list[Patch]:
    """The patches to judge a target by: the carried patch (the one in patches/) and its backports."""
    main = Patch.load(min(PATCHES.glob("*.patch")))
    return [main, *map(Patch.load, sorted(PATCHES.glob(f"*/{main.path.name}")))]


def name(patch: Patch) -> str:
    """The patch file as README's table names it (patches/...), or as given."""
    path, folder = patch.path.resolve(), PATCHES.resolve().parent
    return str(path.relative_to(folder) if path.is_relative_to(folder) else patch.path)


def touched(target: Target, patches: list[Patch]) -> list[str]:
    """Every file any of the patches changes, as it lies under the target's root."""
    return list(dict.fromkeys(stripped(path, target.strip) for patch in patches for path in patch.paths()))


def check(target: Target, patches: list[Patch]) -> Verdict:
    """The target's verdict: what a killed run left, else its verdict by the patch that fits, the closest first."""
    if (said := journal.left(target.root, touched(target, patches))) is not None:
        return Verdict(target, State.INTERRUPTED, said, patches[0])
    with journal.doing("reading", target.fixed_file):
        lines = target.fixed_file.read_text(errors="replace").splitlines(keepends=True)
    reading = read("".join(lines), str(target.fixed_file.relative_to(target.root)))
    within = [Path(rel) for rel in touched(target, patches)]  # read through a link: what it holds may be fixed
    if linked := [part for rel in within for part in [rel, *rel.parents][:-1] if (target.root / part).is_symlink()]:
        return Verdict(target, State.EQUIVALENT if reading.fixed else State.LINKED, str(linked[0]), patches[0])
    run = lambda patch: max(_run(hunk, lines)[0].size for f in patch.files[:1] for hunk in f)
    closest = sorted(patches, key=lambda patch: (-run(patch), not _of_line(patch, target.release)))
    verdicts = (_check(target, patch, reading) for patch in closest)
    first = next(verdicts)  # git applies a patch one way or back: its verdict has the files' bytes
    return first if first.rewrite else next((verdict for verdict in verdicts if verdict.rewrite), first)


def _check(target: Target, patch: Patch, reading: Reading) -> Verdict:
    """The target's verdict by one patch, given the reading of its gpt_step.py, by git apply on a copy."""
    # Upstream's tests go with the source where the target has their files and their part fits; else it says so.
    beside = target.kind != Kind.INSTALLED and all((target.root / rel).is_file() for rel in patch.paths(src=False))
    gpt_step = stripped(patch.paths(src=True)[0], target.strip)
    reverted = trial.applied(target, patch, src=True, reverse=True)[0]
    if not reverted and reading.fixed:
        return Verdict(target, State.EQUIVALENT, patch=patch)
    changed, error = (reverted, "") if reverted else trial.applied(target, patch, src=True)
    if not changed and reading.fixed is None:
        return Verdict(target, State.UNTOLD, patch=patch, why=reading.why)
    if not changed:  # `FILE:LINE `text`` where gpt_step departs from the hunk git failed on, next to the run it holds
        hunks = [hunk for hunk in patch.files[0] if failed_hunk(error) in (None, hunk.source_start)]
        lines = (target.root / gpt_step).read_text(errors="replace").splitlines(keepends=True)
        (a, b, size), expected = _run(hunks[0], lines)
        at = b + size if a + size < len(expected) else b - 1  # the first line off the run: after it, else before it
        found = f"{gpt_step}:{at + 1} `{lines[at].strip()}`" if size and 0 <= at < len(lines) else ""
        if trial.edited(target, patch.part(src=True), [gpt_step]):  # only local edits in the way
            state = State.LOCAL_CHANGES if target.kind is Kind.CHECKOUT else State.INSTALLED_EDITS
            return Verdict(target, state, found.split(" ")[0] or first_error_line(error), patch)
        said = f"{found} is not what its hunk has there" if found else f"git says {first_error_line(error)}"
        return Verdict(target, State.DRIFTED, f"{name(patch)} does not apply: {said}", patch)
    with_tests, moved = trial.applied(target, patch, src=False, reverse=bool(reverted)) if beside else ({}, "")
    scope = "source and tests" if with_tests else "source hunks only"
    scope += f"; upstream's tests left out, their file has moved on ({first_error_line(moved)})" if moved else ""
    detail = f"{scope}, {name(patch)}"
    rewrite = changed | with_tests
    text = ((target.root / gpt_step).read_bytes() if reverted else changed[gpt_step]).decode(errors="replace")
    added = {line.value for hunk in patch.files[0] for line in hunk if line.is_added}
    landed = unbound(text, {n + 1 for n, line in enumerate(text.splitlines(True)) if line in added}, gpt_step)
    then = Reading(None, landed) if landed else reading if reverted else read(text, gpt_step)
    if reverted:
        return Verdict(target, State.APPLIED if then.fixed else State.UNPROVEN, detail, patch, rewrite, then.why)
    if landed or reading.fixed is not None and not then.fixed:  # it would not be shown to fix the tree
        return Verdict(target, State.DRIFTED, f"{name(patch)} applies, but then {then.why}", patch)
    state = State.APPLIES if reading.fixed is False else State.UNTOLD  # the probe tells whether it is fixed as it is
    return Verdict(target, state, detail, patch, rewrite, reading.why)


def _of_line(patch: Patch, release: str) -> bool:
    """Whether the patch's folder names the release line of `release` (`0.2-0.5`: 0.2.x to 0.5.x)."""
    span = re.fullmatch(r"(\d+\.\d+)-(\d+\.\d+)", patch.path.parent.name)
    line = re.findall(r"\d+", release)[:2]
    low, high = [tuple(map(int, end.split("."))) for end in span.groups()] if span else [(), ()]
    return bool(span) and len(line) == 2 and low <= (*map(int, line),) <= high


def _run(hunk, lines: list[str]) -> tuple[difflib.Match, list[str]]:
    """The longest run of a hunk's lines, as before the patch or patched, that `lines` hold, and that side's lines."""
    sides = [[line.value for line in hunk if not line.is_added], [line.value for line in hunk if not line.is_removed]]
    found = [(difflib.SequenceMatcher(None, side, lines, autojunk=False).find_longest_match(), side) for side in sides]
    return max(found, key=lambda run: run[0].size)
