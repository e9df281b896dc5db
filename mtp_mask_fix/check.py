"""check and apply: the states of a carried patch on a target, and an all-or-nothing apply verified by behaviour."""

import ast
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, git
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import FIXED_FILE
from mtp_mask_fix.targets import Kind, Target
from mtp_mask_fix.verify import verify


class State(Enum):
    """Where a target stands with respect to the patch; the exit code follows from it."""

    APPLIES = ("the patch applies ({detail}); the bug is present", Exit.OK)
    APPLIED = ("already applied; nothing to do", Exit.ALREADY_APPLIED)
    EQUIVALENT = ("an equivalent fix: gpt_step passes loss_mask to the model; retire the patch", Exit.ALREADY_APPLIED)
    LOCAL_CHANGES = ("local changes in the patch's region ({detail}); commit or stash them", Exit.DRIFTED)
    DRIFTED = ("drifted: {detail}", Exit.DRIFTED)

    @property
    def code(self) -> Exit:
        return self.value[1]


@dataclass(frozen=True)
class Verdict:
    """A target's state, with the detail its message names (the scope of the diff, or git's reason)."""

    target: Target
    state: State
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.target.label}: " + self.state.value[0].format(detail=self.detail)


def diff_for(target: Target, patch: Patch) -> tuple[str, str]:
    """The whole patch where upstream's test files are present (never in a package), else its source hunks; and which."""
    whole = target.strip == 1 and all((target.root / path).is_file() for path in patch.test_files())
    return patch.part(src=None if whole else True), "source and tests" if whole else "source hunks only"


def fix_present(source: str) -> bool:
    """Whether `_forward_step_common` hands a `loss_mask` to the model call, in whatever form (a dict entry of
    forward_args, an item assignment, a keyword of the call); `build_schedule_plan` already did and does not count."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return False
    common = [f for f in ast.walk(module) if isinstance(f, ast.FunctionDef) and f.name == "_forward_step_common"]
    for node in [node for func in common for node in ast.walk(func)]:
        if isinstance(node, ast.Dict):
            found = [value for key, value in zip(node.keys, node.values) if _is_key(key)]
        elif isinstance(node, ast.Assign):
            found = [node.value for t in node.targets if isinstance(t, ast.Subscript) and _is_key(t.slice)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) != "build_schedule_plan":
            found = [kw.value for kw in node.keywords if kw.arg == "loss_mask"]
        else:
            found = []
        if any(isinstance(n, ast.Name) and n.id == "loss_mask" for value in found for n in ast.walk(value)):
            return True
    return False


def _is_key(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == "loss_mask"


def check(target: Target, patch: Patch) -> Verdict:
    """Applies / already applied / an equivalent fix / local changes / drifted, by git apply forward and reverse."""
    diff, scope = diff_for(target, patch)
    error = apply_diff(diff, target.root, strip=target.strip, check=True)
    if not error:
        return Verdict(target, State.APPLIES, scope)
    if not apply_diff(diff, target.root, strip=target.strip, reverse=True, check=True):
        return Verdict(target, State.APPLIED)
    if fix_present(target.fixed_file.read_text(errors="replace")):
        return Verdict(target, State.EQUIVALENT)
    local = target.kind == Kind.CHECKOUT and _applies_to_head(target, diff)
    return Verdict(target, State.LOCAL_CHANGES if local else State.DRIFTED, first_error_line(error))


def _applies_to_head(target: Target, diff: str) -> bool:
    """Whether the patch applies to HEAD (only uncommitted edits are in the way): `git apply --cached` to a HEAD index."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", "HEAD", cwd=target.root, env=env)
        return not apply_diff(diff, target.root, check=True, cached=True, env=env)


def require(verdict: Verdict) -> None:
    """Refuse, with the verdict's own line and code, unless the patch applies."""
    if verdict.state != State.APPLIES:
        raise ToolError(str(verdict), verdict.state.code)


def apply(target: Target, patch: Patch, *, python: str | None) -> str:
    """git apply (all or nothing) in place; with `python`, verify by behaviour and `git apply -R` on failure."""
    if target.kind == Kind.RELEASE:
        raise ToolError(f"{target.label} is a downloaded release; apply to a checkout or an installed package")
    require(check(target, patch))
    diff, scope = diff_for(target, patch)
    for line in [line for line in diff.splitlines() if line.startswith("+++ b/")]:
        # By permission bits, not os.access: root may write anything, but a read-only file states intent.
        existing = target.root / line[6:].split("/", target.strip - 1)[-1]
        if not existing.stat().st_mode & 0o200:
            raise ToolError(f"{existing} is read-only; make it writable first")
    if error := apply_diff(diff, target.root, strip=target.strip):
        raise ToolError(f"{target.label}: {first_error_line(error)}", Exit.DRIFTED)
    if python and not (found := verify(target, python)).delivered:
        apply_diff(diff, target.root, strip=target.strip, reverse=True)
        raise ToolError(f"{target.label}: rolled back: {found.reason}", Exit.FAILED)
    return f"{target.label}: applied ({scope})" + ("; verified: the model receives loss_mask" if python else "")


def _git(target: Target, *args: str, cwd: Path, code: Exit = Exit.USAGE) -> str:
    """git, or a one-line refusal saying which step failed and that the checkout is as it was."""
    done = git(*args, cwd=cwd, check=False)
    if done.returncode != 0:
        why = first_error_line(done.stderr)
        raise ToolError(f"{target.label}: git {args[0]} failed: {why}; nothing changed", code)
    return done.stdout.strip()


def make_branch(target: Target, patch: Patch, branch: str) -> str:
    """On a git checkout: a new branch holding the patch as a commit authored and signed off by the submitter.

    `git am -s` runs in a temporary worktree, so a failure anywhere (hooks, conflicts) leaves the checkout as it
    was; the checkout only changes at the final `git switch`, which git refuses if it would lose local edits.
    """
    if target.kind != Kind.CHECKOUT:
        raise ToolError(f"{target.label}: --branch needs a git checkout")
    root = target.root
    for key in ("user.name", "user.email"):
        if not git("config", key, cwd=root, check=False).stdout.strip():
            raise ToolError(f"git {key} is not set in {target.label}; `git am -s` signs off as you")
    if git("rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", cwd=root, check=False).returncode == 0:
        raise ToolError(f"branch {branch} already exists in {target.label}")
    if git("diff", "--cached", "--quiet", cwd=root, check=False).returncode != 0:
        raise ToolError(f"{target.label} has staged changes; commit or unstage them first")
    require(check(target, patch))
    if git("diff", "--quiet", "--", FIXED_FILE, *patch.test_files(), cwd=root, check=False).returncode != 0:
        raise ToolError(
            f"{target.label}: uncommitted changes in files the patch touches; commit or stash them", Exit.DRIFTED
        )
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "am"
        try:
            _git(target, "worktree", "add", "--quiet", "--detach", str(worktree), "HEAD", cwd=root, code=Exit.FAILED)
            _git(target, "am", "--quiet", "-s", str(patch.path), cwd=worktree, code=Exit.DRIFTED)
            # --no-verify: a local pre-commit hook must not stop the amend of git am's own commit; --reset-author:
            # the submitter authors the upstream commit (the mailbox's From is this repo's placeholder).
            _git(target, "commit", "-q", "--amend", "--no-edit", "--no-verify", "--reset-author", cwd=worktree)
            commit = _git(target, "rev-parse", "HEAD", cwd=worktree)
        finally:
            git("worktree", "remove", "--force", str(worktree), cwd=root, check=False)
            git("worktree", "prune", cwd=root, check=False)
    git("branch", branch, commit, cwd=root)
    switched = git("switch", "--quiet", branch, cwd=root, check=False)
    if switched.returncode != 0:
        git("branch", "--quiet", "-D", branch, cwd=root, check=False)
        raise ToolError(f"{target.label}: git switch failed: {first_error_line(switched.stderr)}; nothing changed")
    return f"{target.label}: branch {branch} holds the fix, signed off by you; push it and run `mtp-mask-fix pr`"
