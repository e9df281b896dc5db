"""Reading a target, never writing it: where it stands with respect to the patch and its backports, and what a killed
run left there."""

import ast
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mtp_mask_fix import journal
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, git, stripped
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PATCHES
from mtp_mask_fix.targets import Kind, Target


COPIES = {"clone", "detach", "contiguous"}  # what hands the model the same mask in another tensor


class State(Enum):
    """Where a target stands, its message and exit code; when the patches disagree, the first state here wins."""

    INTERRUPTED = ("an interrupted run left {detail}", Exit.FAILED)
    LINKED = ("{detail} is a symlink: apply writes no link nor beyond one; name the tree that holds it", Exit.USAGE)
    APPLIES = ("the patch applies ({detail}); the bug is present: `apply` fixes it", Exit.OK)
    APPLIED = ("already applied ({detail}); nothing to do", Exit.ALREADY_APPLIED)
    LOCAL_CHANGES = ("uncommitted local changes in the patch's region ({detail}); commit or stash them", Exit.USAGE)
    EQUIVALENT = ("fixed another way: gpt_step passes loss_mask to the model; nothing to apply", Exit.ALREADY_APPLIED)
    DRIFTED = ("drifted: {detail}", Exit.DRIFTED)

    @property
    def code(self) -> Exit:
        return self.value[1]


@dataclass(frozen=True)
class Verdict:
    """A target's state, the patch it was judged with, the part of it that fits (Patch.part's `src`), and the detail
    its message names."""

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
    """--patch FILE alone, or the carried patch (first in patches/series) and its backports for older lines."""
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
    """Whether `_forward_step_common` hands the batch's `loss_mask` itself to the model call (an entry of forward_args,
    an item assignment, a keyword of the call; a copy of it, or it unless None), never a tensor made from it (all ones,
    shifted): the file's text only, so a mask computed some other way is `verify`'s to judge. Passing it to
    `build_schedule_plan` does not count."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return False

    def the_mask(value) -> bool:
        if isinstance(value, ast.IfExp):  # `loss_mask if ... else None`, and the other way round
            return {the_mask(value.body), the_mask(value.orelse)} == {True, None}
        if isinstance(value, ast.Constant) and value.value is None:
            return None
        copy = isinstance(value, ast.Call) and not value.args and getattr(value.func, "attr", "") in COPIES
        return isinstance(value, ast.Name) and value.id == "loss_mask" or copy and the_mask(value.func.value) is True

    common = [f for f in ast.walk(module) if isinstance(f, ast.FunctionDef) and f.name == "_forward_step_common"]
    for node in [node for func in common for node in ast.walk(func)]:
        pairs = []  # (key, value); a key is a node (its `value` a constant's), or a keyword's name
        if isinstance(node, ast.Dict):
            pairs = zip(node.keys, node.values)
        elif isinstance(node, ast.Assign):
            pairs = [(getattr(target, "slice", None), node.value) for target in node.targets]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) != "build_schedule_plan":
            pairs = [(kw.arg, kw.value) for kw in node.keywords]
        if any(getattr(key, "value", key) == "loss_mask" and the_mask(value) is True for key, value in pairs):
            return True
    return False


def touched(target: Target, patches: list[Patch]) -> list[str]:
    """Every file any of the patches changes, as it lies under the target's root."""
    return list(dict.fromkeys(stripped(path, target.strip) for patch in patches for path in patch.paths()))


def check(target: Target, patches: Patch | list[Patch]) -> Verdict:
    """What a killed run left, or the most telling of each patch's states (by git apply forward and reverse)."""
    patches = [patches] if isinstance(patches, Patch) else patches
    if (said := journal.left(target.root, touched(target, patches))) is not None:
        return Verdict(target, State.INTERRUPTED, said, patches[0])
    return min((_check(target, patch) for patch in patches), key=lambda verdict: list(State).index(verdict.state))


def _check(target: Target, patch: Patch) -> Verdict:
    """The whole patch where the target has upstream's test files (a checkout, a source tree), else or where those
    moved on, its source part alone (what a release holds)."""
    tests = patch.test_files()
    with_tests = target.strip == 1 and tests and all((target.root / test).is_file() for test in tests)
    errors, local = [], None
    for src in [None, True] if with_tests else [True]:
        diff, verdict = patch.part(src=src), Verdict(target, State.APPLIES, patch=patch, src=src)
        within = [Path(rel) for rel in verdict.files]
        if linked := [
            part for rel in within for part in [rel, *rel.parents][:-1] if (target.root / part).is_symlink()
        ]:
            # read through the link: the fix may already be there
            if fix_present(target.fixed_file.read_text(errors="replace")):
                return Verdict(target, State.EQUIVALENT, patch=patch, src=src)
            return Verdict(target, State.LINKED, str(linked[0]), patch, src)
        scope = "source and tests" if src is None else "source hunks only"
        if errors:
            scope += f"; upstream's tests left out, their file has moved on ({first_error_line(errors[0])})"
        if not (error := apply_diff(diff, target.root, strip=target.strip, check=True)):
            return Verdict(target, State.APPLIES, f"{scope}, {name(patch)}", patch, src)
        if not apply_diff(diff, target.root, strip=target.strip, reverse=True, check=True):
            return Verdict(target, State.APPLIED, f"{scope.split(';')[0]}, {name(patch)}", patch, src)
        errors.append(error)
        if target.kind == Kind.CHECKOUT and _applies_to_head(target, diff):  # only uncommitted edits in the way
            local = Verdict(target, State.LOCAL_CHANGES, first_error_line(error), patch, src)
            break
    if fix_present(target.fixed_file.read_text(errors="replace")):
        return Verdict(target, State.EQUIVALENT, patch=patch)
    return local or Verdict(target, State.DRIFTED, first_error_line(errors[-1]), patch)


def _applies_to_head(target: Target, diff: str) -> bool:
    """`git apply --cached --check` to an index of HEAD: whether the diff fits the committed files."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", "HEAD", cwd=target.root, env=env)
        return not apply_diff(diff, target.root, check=True, cached=True, env=env)


def already_fixed(verdict: Verdict) -> str:
    """How the target already holds the fix, "" if the patch applies; else a refusal with the verdict's line."""
    if verdict.state in (State.APPLIED, State.EQUIVALENT):
        return verdict.detail if verdict.state == State.APPLIED else "another way"
    if verdict.state != State.APPLIES:
        raise ToolError(str(verdict), verdict.state.code)
    return ""
