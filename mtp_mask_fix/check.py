"""Reading a target, never writing it: where it stands with respect to the patch and its backports (`check`), what a
killed apply left (its journal), whether the code it imports delivers the mask (`verify`)."""

import ast
import base64
import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mtp_mask_fix import probe
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, git, stripped
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PATCHES, is_gpt_step_of
from mtp_mask_fix.targets import Kind, Target


JOURNAL = ".mtp-mask-fix-journal.json"  # apply's, until verified or rolled back: each file as it was, what replaced it


class State(Enum):
    """Where a target stands, its message and exit code; when the patches disagree, the first state here wins."""

    INTERRUPTED = ("an interrupted apply left {detail}; `apply` restores the files and starts again", Exit.FAILED)
    LINKED = ("{detail} is a symlink: apply writes no link nor beyond one; name the tree that holds it", Exit.USAGE)
    APPLIES = ("the patch applies ({detail}); the bug is present", Exit.OK)
    APPLIED = ("already applied ({detail}); nothing to do", Exit.ALREADY_APPLIED)
    LOCAL_CHANGES = ("uncommitted local changes in the patch's region ({detail}); commit or stash them", Exit.USAGE)
    EQUIVALENT = ("an equivalent fix: gpt_step passes loss_mask to the model; retire the patch", Exit.ALREADY_APPLIED)
    DRIFTED = ("drifted: {detail}", Exit.DRIFTED)

    @property
    def code(self) -> Exit:
        return self.value[1]


@dataclass(frozen=True)
class Verdict:
    """A target's state, the patch it was judged with, and the detail its message names (scope, or git's reason)."""

    target: Target
    state: State
    detail: str = ""
    patch: Patch | None = None

    def __str__(self) -> str:
        return f"{self.target.label}: " + self.state.value[0].format(detail=self.detail)


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


def scope(target: Target, patch: Patch) -> bool | None:
    """Patch.part's `src`: all files (None) where upstream's test files are present (never in a package), else True."""
    tests = patch.test_files()
    return None if target.strip == 1 and tests and all((target.root / t).is_file() for t in tests) else True


def fix_present(source: str) -> bool:
    """Whether `_forward_step_common` hands `loss_mask` to the model call in any form (an entry of forward_args, an
    item assignment, a keyword of the call); passing it to `build_schedule_plan` does not count."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return False
    common = [f for f in ast.walk(module) if isinstance(f, ast.FunctionDef) and f.name == "_forward_step_common"]
    for node in [node for func in common for node in ast.walk(func)]:
        pairs = []  # (key, value); a key is a node (its `value` a constant's), or a keyword's name
        if isinstance(node, ast.Dict):
            pairs = zip(node.keys, node.values)
        elif isinstance(node, ast.Assign):
            pairs = [(getattr(target, "slice", None), node.value) for target in node.targets]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) != "build_schedule_plan":
            pairs = [(kw.arg, kw.value) for kw in node.keywords]
        for key, value in pairs:
            passed = any(isinstance(n, ast.Name) and n.id == "loss_mask" for n in ast.walk(value))
            if getattr(key, "value", key) == "loss_mask" and passed:
                return True
    return False


def journal(root: Path) -> dict[str, tuple[bytes, str]] | None:
    """The journal a killed apply left: each file's bytes before, and the sha256 of what replaced them; None when
    there is none, {} when it cannot be read (it is written by a rename: only damage from outside tears it)."""
    if (root / JOURNAL).exists() and not (root / JOURNAL).is_file():
        raise ToolError(f"{root / JOURNAL} is not a file: apply keeps its journal there; remove it")
    if not (root / JOURNAL).is_file():
        return None
    try:
        files = json.loads((root / JOURNAL).read_text())["files"]
        entries = {rel: (base64.b64decode(entry["before"]), entry["after"]) for rel, entry in files.items()}
        inside = all(_file_in(root, rel) for rel in entries)  # never a path outside root, nor a folder
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return {}
    return entries if inside else {}


def _file_in(root: Path, rel: str) -> bool:
    path = root / rel
    return path.resolve().parent.is_relative_to(root.resolve()) and path.parent.is_dir() and not path.is_dir()


def left(root: Path) -> str | None:
    """What the journal a killed apply left says of each file now; None when there is none."""
    entries = journal(root)
    if entries is None:
        return None
    said = []
    for rel, (before, after) in entries.items():
        now = (root / rel).read_bytes() if (root / rel).is_file() else None
        patched = now is not None and hashlib.sha256(now).hexdigest() == after
        state = "as before" if now == before else "patched, not verified" if patched else "changed since"
        said.append(f"{rel} {state}")
    return ", ".join(said) or "naming no file it can restore: unreadable, or not the tool's"


def check(target: Target, patches: Patch | list[Patch]) -> Verdict:
    """The state a killed apply left, or the most telling of each patch's (by git apply forward and reverse)."""
    patches = [patches] if isinstance(patches, Patch) else patches
    if (said := left(target.root)) is not None:
        return Verdict(target, State.INTERRUPTED, f"{JOURNAL} ({said})", patches[0])
    return min((_check(target, patch) for patch in patches), key=lambda verdict: list(State).index(verdict.state))


def _check(target: Target, patch: Patch) -> Verdict:
    src = scope(target, patch)
    diff = patch.part(src=src)
    within = [Path(stripped(path, target.strip)) for path in patch.paths(src=src)]  # each file, folders above it
    if linked := [part for rel in within for part in [rel, *rel.parents][:-1] if (target.root / part).is_symlink()]:
        # read through the link: the fix may already be there
        if fix_present(target.fixed_file.read_text(errors="replace")):
            return Verdict(target, State.EQUIVALENT, patch=patch)
        return Verdict(target, State.LINKED, str(linked[0]), patch)
    if not (error := apply_diff(diff, target.root, strip=target.strip, check=True)):
        said = "source and tests" if src is None else "source hunks only"
        return Verdict(target, State.APPLIES, f"{said}, {name(patch)}", patch)
    if not apply_diff(diff, target.root, strip=target.strip, reverse=True, check=True):
        return Verdict(target, State.APPLIED, name(patch), patch)
    if fix_present(target.fixed_file.read_text(errors="replace")):
        return Verdict(target, State.EQUIVALENT, patch=patch)
    if target.kind == Kind.CHECKOUT:  # only uncommitted edits in the way? `git apply --cached` to an index of HEAD
        with tempfile.TemporaryDirectory() as tmp:
            env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            git("read-tree", "HEAD", cwd=target.root, env=env)
            if not apply_diff(diff, target.root, check=True, cached=True, env=env):
                return Verdict(target, State.LOCAL_CHANGES, first_error_line(error), patch)
    return Verdict(target, State.DRIFTED, first_error_line(error), patch)


def already_fixed(verdict: Verdict) -> str:
    """How the target already holds the fix, "" if the patch applies; else a refusal with the verdict's line."""
    if verdict.state in (State.APPLIED, State.EQUIVALENT):
        return verdict.detail if verdict.state == State.APPLIED else "an equivalent fix"
    if verdict.state != State.APPLIES:
        raise ToolError(str(verdict), verdict.state.code)
    return ""


def verify(target: Target, python: str) -> tuple[bool, str]:
    """Whether the mask reaches the model, and why: probe.py's source run with -c under `python` (nothing of the tool
    installed there, no module of its folder shadowing the target's), the target's import root first on the path."""
    path = os.pathsep.join(filter(None, [str(target.import_root), os.environ.get("PYTHONPATH")]))
    run = [python, "-c", Path(probe.__file__).read_text()]
    env = dict(os.environ, PYTHONPATH=path)
    result = subprocess.run(run, capture_output=True, text=True, env=env, cwd=target.import_root)
    if result.returncode != 0 or not result.stdout.strip():
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        why = f"the probe could not run {target.label} under {python} ({tail}); pass --python an interpreter"
        return False, f"{why} that imports this Megatron-Bridge (its megatron-core)"
    try:
        found = json.loads(result.stdout.strip().splitlines()[-1])
    except ValueError:
        return False, f"{python} printed no probe result ({result.stdout.strip().splitlines()[-1][:200]!r})"
    if not is_gpt_step_of(found["file"], target.import_root):
        return False, f"{python} imported gpt_step from {found['file']}, not from {target.label}"
    return found["delivered"], found["reason"]
