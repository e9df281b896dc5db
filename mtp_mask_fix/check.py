"""Where a target stands with respect to the patch and its backports, read and never written."""

import ast
import base64
import csv
import difflib
import hashlib
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mtp_mask_fix import journal
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, git, stripped
from mtp_mask_fix.journal import scratch
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PATCHES
from mtp_mask_fix.targets import Kind, Target


COPIES = {"clone", "detach", "contiguous"}  # what hands the model the same mask in another tensor
MASK = "loss_mask"


class State(Enum):
    """Where a target stands, its message and exit code; when the patches disagree, the first state here wins."""

    INTERRUPTED = ("an interrupted run left {detail}", Exit.FAILED)
    LINKED = ("{detail} is a symlink: apply writes no link nor beyond one; name the tree that holds it", Exit.USAGE)
    APPLIES = ("the patch applies ({detail}); the bug is present: `apply` fixes it", Exit.OK)
    APPLIED = ("already applied ({detail}); nothing to do", Exit.ALREADY_APPLIED)
    OVERRIDDEN = ("the patch is applied ({detail}), but a later line hands the model another loss_mask", Exit.USAGE)
    LOCAL_CHANGES = ("uncommitted local changes in the patch's region ({detail}); commit or stash them", Exit.USAGE)
    INSTALLED_EDITS = (
        "local edits in the patch's region ({detail}), unlike its wheel's RECORD; undo them or reinstall the release",
        Exit.USAGE,
    )
    EQUIVALENT = ("fixed another way: gpt_step passes loss_mask to the model; nothing to apply", Exit.ALREADY_APPLIED)
    DRIFTED = ("drifted: {detail}", Exit.DRIFTED)

    @property
    def code(self) -> Exit:
        return self.value[1]


@dataclass(frozen=True)
class Verdict:
    """A target's state, with the patch it was judged by, the part that fits (Patch.part's `src`) and a detail."""

    target: Target
    state: State
    detail: str = ""
    patch: Patch | None = None
    src: bool | None = True

    def __str__(self) -> str:
        return f"{self.target.label}: " + self.state.value[0].format(detail=self.detail)

    @property
    def files(self) -> list[str]:
        """The files the fitting part changes, as they lie under the target's root."""
        return [stripped(path, self.target.strip) for path in self.patch.paths(src=self.src)]


def candidates(explicit: Path | None = None) -> list[Patch]:
    """The patches to judge a target by: `explicit` alone, or the carried patch and its backports."""
    if explicit:
        return [Patch.load(explicit)]
    main = Patch.load()
    return [main, *map(Patch.load, sorted(PATCHES.glob(f"*/{main.path.name}")))]


def name(patch: Patch) -> str:
    """The patch file as README's table names it (patches/...), or as given."""
    try:
        return str(patch.path.resolve().relative_to(PATCHES.resolve().parent))
    except ValueError:
        return str(patch.path)


def fix_present(source: str) -> bool:
    """Whether, by its text, `_forward_step_common`'s last word on `loss_mask` hands the model the batch's mask."""
    # A word is an entry of forward_args, an item assignment or a keyword of a call but build_schedule_plan's; a mask
    # computed some other way is verify's to judge.
    try:
        module = ast.parse(source)
    except SyntaxError:
        return False
    words = []  # (the key's node, the value given); the last in the text is what the model receives
    common = [f for f in ast.walk(module) if isinstance(f, ast.FunctionDef) and f.name == "_forward_step_common"]
    for node in [node for func in common for node in ast.walk(func)]:
        if isinstance(node, ast.Dict):
            words += [(key, value) for key, value in zip(node.keys, node.values) if getattr(key, "value", 0) == MASK]
        elif isinstance(node, ast.Assign):
            words += [(t, node.value) for t in node.targets if getattr(getattr(t, "slice", 0), "value", 0) == MASK]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) != "build_schedule_plan":
            words += [(kw, kw.value) for kw in node.keywords if kw.arg == MASK]
    last = max(words, key=lambda word: (word[0].lineno, word[0].col_offset), default=None)
    return last is not None and _is_the_batch_mask(last[1])


def _is_the_batch_mask(value: ast.expr) -> bool:
    """Whether an expression is `loss_mask`, a copy of it, or it unless None."""
    if isinstance(value, ast.IfExp):  # `loss_mask if ... else None`, and the other way round
        branches = (value.body, value.orelse)
        none = any(isinstance(branch, ast.Constant) and branch.value is None for branch in branches)
        return none and any(map(_is_the_batch_mask, branches))
    copy = isinstance(value, ast.Call) and not value.args and getattr(value.func, "attr", "") in COPIES
    return isinstance(value, ast.Name) and value.id == MASK or copy and _is_the_batch_mask(value.func.value)


def touched(target: Target, patches: list[Patch]) -> list[str]:
    """Every file any of the patches changes, as it lies under the target's root."""
    return list(dict.fromkeys(stripped(path, target.strip) for patch in patches for path in patch.paths()))


def check(target: Target, patches: Patch | list[Patch]) -> Verdict:
    """The target's verdict: what a killed run left, else the most telling of each patch's."""
    patches = [patches] if isinstance(patches, Patch) else patches
    if (said := journal.left(target.root, touched(target, patches))) is not None:
        return Verdict(target, State.INTERRUPTED, said, patches[0])
    return min((_check(target, patch) for patch in patches), key=lambda verdict: list(State).index(verdict.state))


def _check(target: Target, patch: Patch) -> Verdict:
    """The target's verdict by one patch, by git apply forward and reverse."""
    # The whole patch where the target has upstream's test files, else (or where they moved on) its source alone.
    tests = patch.test_files()
    with_tests = target.strip == 1 and tests and all((target.root / test).is_file() for test in tests)
    errors, local, fixed = [], None, fix_present(target.fixed_file.read_text(errors="replace"))
    for src in [None, True] if with_tests else [True]:
        diff, verdict = patch.part(src=src), Verdict(target, State.APPLIES, patch=patch, src=src)
        within = [Path(rel) for rel in verdict.files]
        if linked := [
            part for rel in within for part in [rel, *rel.parents][:-1] if (target.root / part).is_symlink()
        ]:
            # read through the link: the fix may already be there
            if fixed:
                return Verdict(target, State.EQUIVALENT, patch=patch, src=src)
            return Verdict(target, State.LINKED, str(linked[0]), patch, src)
        scope = "source and tests" if src is None else "source hunks only"
        if errors:
            scope += f"; upstream's tests left out, their file has moved on ({first_error_line(errors[0])})"
        if not (error := apply_diff(diff, target.root, strip=target.strip, check=True)):
            return Verdict(target, State.APPLIES, f"{scope}, {name(patch)}", patch, src)
        if not apply_diff(diff, target.root, strip=target.strip, reverse=True, check=True):
            state = State.APPLIED if fixed else State.OVERRIDDEN
            return Verdict(target, state, f"{scope.split(';')[0]}, {name(patch)}", patch, src)
        errors.append(error)
        # Only local edits in the way: the diff fits the checkout's commit, or the installed files are not as their
        # wheel's RECORD has them.
        if target.kind == Kind.CHECKOUT and _applies_to_head(target, diff):
            local = Verdict(
                target, State.LOCAL_CHANGES, _user_line(target, patch, error) or first_error_line(error), patch, src
            )
            break
        if target.kind == Kind.INSTALLED and _not_as_recorded(target, verdict.files):
            local = Verdict(
                target, State.INSTALLED_EDITS, _user_line(target, patch, error) or first_error_line(error), patch, src
            )
    if fixed:
        return Verdict(target, State.EQUIVALENT, patch=patch)
    if local:
        return local
    where = f", at {found} of this tree" if (found := _user_line(target, patch, errors[-1])) else ""
    return Verdict(target, State.DRIFTED, first_error_line(errors[-1]) + where, patch)


def _applies_to_head(target: Target, diff: str) -> bool:
    """Whether the diff fits the committed files (`git apply --cached --check` to an index of HEAD)."""
    with scratch() as tmp:
        env = {"GIT_INDEX_FILE": str(tmp / "index")}
        git("read-tree", "HEAD", cwd=target.root, env=env)
        return not apply_diff(diff, target.root, check=True, cached=True, env=env)


def _not_as_recorded(target: Target, files: list[str]) -> bool:
    """Whether any of the files differs from the sha256 its wheel's RECORD (in a *.dist-info beside it) states."""
    records = [path.read_text().splitlines() for path in target.root.glob("*.dist-info/RECORD")]
    rows = [row for record in records for row in csv.reader(record)]
    recorded = {row[0]: row[1] for row in rows if len(row) == 3 and row[0] in files}
    sha = {rel: hashlib.sha256((target.root / rel).read_bytes()).digest() for rel in recorded}
    return any(recorded[rel] != f"sha256={base64.urlsafe_b64encode(sha[rel]).decode().rstrip('=')}" for rel in sha)


def _user_line(target: Target, patch: Patch, error: str) -> str:
    """`FILE:LINE` where the user's file departs from the hunk git failed on (at the patch's N), "" if none."""
    failed = re.search(r"patch failed: (\S+):(\d+)", error)
    hunks = [h for f in patch.files for h in f if failed and stripped(f.path, target.strip) == failed[1]]
    hunk = next((h for h in hunks if h.source_start == int(failed[2])), None)
    if hunk is None:
        return ""
    lines = (target.root / failed[1]).read_text(errors="replace").splitlines(keepends=True)
    # The hunk's side (as before the patch, or patched) that runs longest along the file, then up and down from there:
    # the first line off it is the edit.
    sides = [[line.value for line in hunk if not line.is_added], [line.value for line in hunk if not line.is_removed]]
    (a, b, size), expected = max(
        ((difflib.SequenceMatcher(None, side, lines, autojunk=False).find_longest_match(), side) for side in sides),
        key=lambda found: found[0].size,
    )
    up = [b - k for k in range(1, a + 1) if b - k < 0 or lines[b - k] != expected[a - k]]
    down = [b + k for k in range(size, len(expected) - a) if b + k >= len(lines) or lines[b + k] != expected[a + k]]
    return f"{failed[1]}:{max([*up, *down, b][0], 0) + 1}"


def fixed_how(verdict: Verdict) -> str:
    """How the target already holds the fix, "" if the patch applies; any other state is refused with its line."""
    if verdict.state in (State.APPLIED, State.EQUIVALENT):
        return verdict.detail if verdict.state == State.APPLIED else "another way"
    if verdict.state != State.APPLIES:
        raise ToolError(str(verdict), verdict.state.code)
    return ""
