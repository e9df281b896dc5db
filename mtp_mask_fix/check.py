"""Where a target stands with respect to the patch and its backports, read and never written."""

import ast
import base64
import csv
import difflib
import hashlib
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from mtp_mask_fix import journal
from mtp_mask_fix.errors import Exit, ToolError, doing
from mtp_mask_fix.git import apply_diff, first_error_line, git, stripped
from mtp_mask_fix.journal import scratch
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PATCHES
from mtp_mask_fix.targets import Kind, Target


MASK = "loss_mask"
COPIES = {"clone", "detach", "contiguous"}  # what hands the model the same mask in another tensor


class State(Enum):
    """Where a target stands: its message and exit code."""

    INTERRUPTED = ("an interrupted run left {detail}", Exit.FAILED)
    LINKED = ("{detail} is a symlink: apply writes no link nor beyond one; name the tree that holds it", Exit.USAGE)
    APPLIES = ("the patch applies ({detail}); the bug is present: `apply` fixes it", Exit.OK)
    APPLIED = ("already applied ({detail}); nothing to do", Exit.ALREADY_APPLIED)
    UNPROVEN = ("the patch is applied ({detail}), but {why}: `mtp-mask-fix verify` runs it and tells", Exit.USAGE)
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


def candidates(explicit: Path | None = None) -> list[Patch]:
    """The patches to judge a target by: `explicit` alone, or the carried patch and its backports."""
    if explicit:
        return [Patch.load(explicit)]
    main = Patch.load()
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
    with doing("reading", target.fixed_file):
        lines = target.fixed_file.read_text(errors="replace").splitlines(keepends=True)
    unfixed = why_not_fixed("".join(lines), str(target.fixed_file.relative_to(target.root)))
    within = [Path(rel) for rel in touched(target, patches)]  # read through a link: what it holds may be fixed
    if linked := [part for rel in within for part in [rel, *rel.parents][:-1] if (target.root / part).is_symlink()]:
        return Verdict(target, State.LINKED if unfixed else State.EQUIVALENT, str(linked[0]), patches[0])
    # Closest: the patch whose source hunk (its first file's) the file holds the longest run of lines of.
    closest = sorted(patches, key=lambda patch: -max(_run(h, lines)[0].size for f in patch.files[:1] for h in f))
    verdicts = (_check(target, patch, unfixed) for patch in closest)
    first, fits = next(verdicts), (State.APPLIES, State.APPLIED, State.UNPROVEN)  # git applies it, one way or back
    return first if first.state in fits else next((verdict for verdict in verdicts if verdict.state in fits), first)


def _check(target: Target, patch: Patch, unfixed: str) -> Verdict:
    """The target's verdict by one patch, `unfixed` saying why its text may not be fixed, by git apply on a copy."""
    # Upstream's tests go with the source where the target has their files and their part fits; else it says so.
    tests = all((target.root / test).is_file() for test in patch.test_files()) and target.strip == 1
    source, tests = patch.part(src=True), patch.part(src=False) if tests else ""
    files = [stripped(path, target.strip) for path in patch.paths(src=True)]  # gpt_step.py's first
    reverted = _applied(target, source, reverse=True)[0]
    if not reverted and not unfixed:
        return Verdict(target, State.EQUIVALENT, patch=patch)
    changed, error = (reverted, "") if reverted else _applied(target, source)
    if changed:  # applied, one way or back
        with_tests, moved = _applied(target, tests, reverse=bool(reverted))
        if not reverted and (then := why_not_fixed(changed[files[0]].decode(errors="replace"), files[0])):
            return Verdict(target, State.DRIFTED, f"{name(patch)} applies, but then {then}", patch)
        scope = "source and tests" if with_tests else "source hunks only"
        scope += f"; upstream's tests left out, their file has moved on ({first_error_line(moved)})" if moved else ""
        state = (State.UNPROVEN if unfixed else State.APPLIED) if reverted else State.APPLIES
        return Verdict(target, state, f"{scope}, {name(patch)}", patch, changed | with_tests, unfixed)
    # Only local edits in the way: the diff fits the checkout's commit, or the installed files are not as their
    # wheel's RECORD has them.
    found = _user_line(target, patch, error)
    if target.kind == Kind.CHECKOUT and _applies_to_head(target, source):
        return Verdict(target, State.LOCAL_CHANGES, found or first_error_line(error), patch)
    if target.kind == Kind.INSTALLED and _not_as_recorded(target, files):
        return Verdict(target, State.INSTALLED_EDITS, found or first_error_line(error), patch)
    where = f", at {found} of this tree" if found else ""
    return Verdict(target, State.DRIFTED, f"{name(patch)}: {first_error_line(error)}{where}", patch)


def _applied(target: Target, diff: str, *, reverse=False) -> tuple[dict[str, bytes], str]:
    """The files `diff` changes, with their bytes once `git apply` (-R) of it on a copy; else {} and git's error."""
    if not diff:
        return {}, ""
    files = [stripped(path, target.strip) for path in re.findall(r"^\+\+\+ b/(.+)$", diff, re.M)]
    with scratch() as tmp:
        for rel in files:
            with doing(f"copying {target.root / rel} into", tmp):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes((target.root / rel).read_bytes())
        if error := apply_diff(diff, tmp, strip=target.strip, reverse=reverse):
            return {}, error
        return {rel: (tmp / rel).read_bytes() for rel in files}, ""


def why_not_fixed(source: str, path: str = "gpt_step.py") -> str:
    """What in gpt_step's text may keep a `model(**kwargs)` call from the batch's loss_mask, and where; "" if none."""
    try:
        module = ast.parse(source)
    except SyntaxError as exc:
        return f"{path}:{exc.lineno} does not parse"
    owner = {node: f for f in ast.walk(module) if isinstance(f, ast.FunctionDef) for node in ast.walk(f)}
    calls = [node for node in owner if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "model"]
    found = [_mask_given(owner[call], call) for call in calls if any(kw.arg is None for kw in call.keywords)]
    said, node = next((word for word in found if word[0]), found[0] if found else ("has no `model(**...)` call", None))
    where = f"{path}:{node.lineno} `{source.splitlines()[node.lineno - 1].strip()}`" if node else path
    return f"{where} {said}" if said else ""


def _mask_given(func: ast.FunctionDef, call: ast.Call) -> tuple[str, ast.AST]:
    """What is amiss with the loss_mask `call` hands the model ("" if it is the batch's), and where."""
    # Followed: the dict the call unpacks, made by a literal, and item sets of constant keys; any other use of it
    # before the call (del, pop, a key in a variable, the dict passed on or a caller's) is verify's to judge.
    unpacked = [kw.value for kw in call.keywords if kw.arg is None]
    parents = {kid: node for node in ast.walk(func) for kid in ast.iter_child_nodes(node)}
    name = getattr(unpacked[0], "id", None)
    given = name is None or name in [arg.arg for arg in ast.walk(func.args) if isinstance(arg, ast.arg)]
    unsure, mask = [*unpacked[1:], *[call] * given], None  # mask: the value the last word gives it
    uses = [node for node in ast.walk(func) if isinstance(node, ast.Name) and node.id == name]
    for node in sorted(uses, key=lambda node: (node.lineno, node.col_offset)):
        up, top = parents[node], parents.get(parents[node])
        key = getattr(up.slice, "value", 0) if isinstance(up, ast.Subscript) else None
        if node.lineno > call.lineno or isinstance(key, str) and key != MASK or isinstance(up, ast.Compare):
            continue  # after the call, another key, a test
        if isinstance(up, ast.Assign) and up.targets == [node] and isinstance(up.value, ast.Dict):
            entries = list(zip([getattr(k, "value", None) for k in up.value.keys], up.value.values))
            unsure += [v for k, v in entries if not isinstance(k, str)]  # `**other`, a key in a variable
            mask = ([v for k, v in entries if k == MASK] or [None])[-1]
        elif key == MASK and isinstance(top, ast.Assign) and top.targets == [up]:
            mask = top.value
        elif not (isinstance(up, ast.Attribute) and up.attr == "get" or isinstance(up, ast.keyword) and top is call):
            unsure.append(node)
    mask = next((kw.value for kw in call.keywords if kw.arg == MASK), mask)
    if unsure:
        return "does what check cannot follow", unsure[-1]
    if mask is None:
        return "gets no loss_mask", call
    return "" if _is_the_batch_mask(mask) else "hands the model something else as loss_mask", mask


def _is_the_batch_mask(value: ast.expr) -> bool:
    """Whether an expression is `loss_mask`, a copy of it, or it unless None."""
    if isinstance(value, ast.IfExp):  # `loss_mask if ... else None`, and the other way round
        branches = (value.body, value.orelse)
        none = any(isinstance(branch, ast.Constant) and branch.value is None for branch in branches)
        return none and any(map(_is_the_batch_mask, branches))
    copy = isinstance(value, ast.Call) and not value.args and getattr(value.func, "attr", "") in COPIES
    return isinstance(value, ast.Name) and value.id == MASK or copy and _is_the_batch_mask(value.func.value)


def _run(hunk, lines: list[str]) -> tuple[difflib.Match, list[str]]:
    """The longest run of a hunk's lines, as before the patch or patched, that `lines` hold, and that side's lines."""
    sides = [[line.value for line in hunk if not line.is_added], [line.value for line in hunk if not line.is_removed]]
    found = [(difflib.SequenceMatcher(None, side, lines, autojunk=False).find_longest_match(), side) for side in sides]
    return max(found, key=lambda run: run[0].size)


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
    if (hunk := next((h for h in hunks if h.source_start == int(failed[2])), None)) is None:
        return ""
    lines = (target.root / failed[1]).read_text(errors="replace").splitlines(keepends=True)
    # From the run of the hunk's lines the file holds, up and down: the first line off it is the edit.
    (a, b, size), expected = _run(hunk, lines)
    up = [b - k for k in range(1, a + 1) if b - k < 0 or lines[b - k] != expected[a - k]]
    down = [b + k for k in range(size, len(expected) - a) if b + k >= len(lines) or lines[b + k] != expected[a + k]]
    return f"{failed[1]}:{max([*up, *down, b][0], 0) + 1}"


def fixed_how(verdict: Verdict) -> str:
    """How the target already holds the fix, "" if the patch applies; any other state is refused with its line."""
    if verdict.state not in (State.APPLIED, State.EQUIVALENT, State.APPLIES):
        raise ToolError(str(verdict), verdict.state.code)
    return {State.APPLIED: verdict.detail, State.EQUIVALENT: "another way"}.get(verdict.state, "")
