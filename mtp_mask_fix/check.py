"""check and apply: the states of a carried patch on a target, and an all-or-nothing apply verified by behaviour.

The carried patch fits 0.6 on and upstream main; older release lines get its backport (backport.py). Without
--patch, each target is checked against all of them and the one that fits is used.
"""

import ast
import os
import shutil
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mtp_mask_fix import atomic, backport
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, git
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import FIXED_FILE, PATCHES
from mtp_mask_fix.targets import Kind, Target
from mtp_mask_fix.verify import verify


class State(Enum):
    """Where a target stands with respect to the patch; the exit code follows from it."""

    APPLIES = ("the patch applies ({detail}); the bug is present", Exit.OK)
    APPLIED = ("already applied ({detail}); nothing to do", Exit.ALREADY_APPLIED)
    EQUIVALENT = ("an equivalent fix: gpt_step passes loss_mask to the model; retire the patch", Exit.ALREADY_APPLIED)
    LOCAL_CHANGES = ("uncommitted local changes in the patch's region ({detail}); commit or stash them", Exit.USAGE)
    INTERRUPTED = ("an interrupted apply left {detail}; `apply` restores the files and starts again", Exit.FAILED)
    DRIFTED = ("drifted: {detail}", Exit.DRIFTED)

    @property
    def code(self) -> Exit:
        return self.value[1]


# When the patches disagree (the carried one drifts where its backport applies), the most telling state wins.
RANK = [State.INTERRUPTED, State.APPLIES, State.APPLIED, State.LOCAL_CHANGES, State.EQUIVALENT, State.DRIFTED]


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
    return [main, *(Patch.load(path) for path in backport.backports(main))]


def name(patch: Patch) -> str:
    """The patch file as README's table names it (patches/...), or as given."""
    try:
        return str(patch.path.resolve().relative_to(PATCHES.resolve().parent))
    except ValueError:
        return str(patch.path)


def diff_for(target: Target, patch: Patch) -> tuple[str, str]:
    """The whole patch where upstream's test files are present (never in a package), else its source hunks; and which."""
    tests = patch.test_files()
    whole = target.strip == 1 and bool(tests) and all((target.root / path).is_file() for path in tests)
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


def check(target: Target, patches: Patch | list[Patch]) -> Verdict:
    """Applies / already applied / an equivalent fix / local changes / drifted, by git apply forward and reverse, with
    each patch in turn (the first wins a tie); or the state a killed apply left, which comes first."""
    patches = [patches] if isinstance(patches, Patch) else patches
    if (entries := atomic.read_journal(target.root)) is not None:
        left = f"{atomic.JOURNAL} ({atomic.describe(target.root, entries)})"
        return Verdict(target, State.INTERRUPTED, left, patches[0])
    verdicts = [_check(target, patch) for patch in patches]
    return min(verdicts, key=lambda verdict: RANK.index(verdict.state))


def _check(target: Target, patch: Patch) -> Verdict:
    diff, scope = diff_for(target, patch)
    error = apply_diff(diff, target.root, strip=target.strip, check=True)
    if not error:
        return Verdict(target, State.APPLIES, f"{scope}, {name(patch)}", patch)
    if not apply_diff(diff, target.root, strip=target.strip, reverse=True, check=True):
        return Verdict(target, State.APPLIED, name(patch), patch)
    if fix_present(target.fixed_file.read_text(errors="replace")):
        return Verdict(target, State.EQUIVALENT, patch=patch)
    local = target.kind == Kind.CHECKOUT and _applies_to_head(target, diff)
    return Verdict(target, State.LOCAL_CHANGES if local else State.DRIFTED, first_error_line(error), patch)


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


def _writable(root: Path, files: list[str]) -> None:
    """Refuse, before any work, files or folders that cannot be replaced. By permission bits and by trying: root may
    write anything, but a read-only file states intent; a read-only file system refuses even root."""
    for rel in files:
        path = root / rel
        if not path.stat().st_mode & 0o200:
            raise ToolError(f"{path} is read-only; make it writable first")
        if not path.parent.stat().st_mode & 0o200:
            raise ToolError(f"{path.parent} is read-only (the file is replaced by a rename in it); make it writable")
        try:
            fd, probe = tempfile.mkstemp(dir=path.parent, prefix=".mtp-mask-fix-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ToolError(f"{path.parent}: permission denied ({exc.strerror}); nothing changed") from exc


def _patched(root: Path, files: list[str], diff: str, strip: int) -> dict[str, bytes]:
    """The files' new bytes, made by git apply on copies (the target is not touched)."""
    with tempfile.TemporaryDirectory() as tmp:
        for rel in files:
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, Path(tmp) / rel)
        if error := apply_diff(diff, Path(tmp), strip=strip):
            raise ToolError(f"the patch does not apply: {first_error_line(error)}", Exit.DRIFTED)
        return {rel: (Path(tmp) / rel).read_bytes() for rel in files}


def recover(target: Target) -> str:
    """Put back what a killed apply left half done (its journal); "" when there was nothing to recover."""
    entries = atomic.read_journal(target.root)
    if entries is None:
        return ""
    left = atomic.describe(target.root, entries)
    atomic.restore(target.root, entries)
    return f"{target.label}: restored the files an interrupted apply left ({left})\n"


def apply(target: Target, patches: list[Patch], *, python: str | None) -> tuple[str, Exit]:
    """All or nothing: the new bytes are made aside, a journal keeps the old ones, each file is replaced by a rename;
    with `python`, the result is verified by behaviour under it and rolled back unless it holds. A signal before the
    verified end rolls back; any signal exits 128+n and says in which state the files are."""
    if target.kind == Kind.RELEASE:
        raise ToolError(f"{target.label} is a downloaded release; apply to a checkout or an installed package")
    with atomic.Guard() as guard:
        done, before, replaced = False, {}, False
        try:
            with guard.critical():
                recovered = recover(target)
            verdict = check(target, patches)
            if verdict.state in (State.APPLIED, State.EQUIVALENT):
                said = verdict.detail if verdict.state == State.APPLIED else "an equivalent fix"
                return f"{recovered}{target.label}: already fixed ({said}); nothing changed", Exit.OK
            require(verdict)
            patch = verdict.patch
            diff, scope = diff_for(target, patch)
            paths = patch.paths(src=None if scope == "source and tests" else True)
            files = [path.split("/", target.strip - 1)[-1] for path in paths]  # git apply's -p
            _writable(target.root, files)
            before = {rel: (target.root / rel).read_bytes() for rel in files}
            after = _patched(target.root, files, diff, target.strip)
            atomic.phase("checked")
            with guard.critical():
                atomic.write_journal(target.root, before, after)
                replaced = True
            atomic.phase("journaled")
            with guard.critical():
                for rel in files:
                    atomic.write_atomic(target.root / rel, after[rel], (target.root / rel).stat().st_mode & 0o7777)
            atomic.phase("replaced")
            verified = ""
            if python:
                found = verify(target, python)
                if not found.delivered:
                    with guard.critical():
                        _rollback(target)
                    raise ToolError(f"{target.label}: rolled back: {found.reason}", Exit.FAILED)
                verified = f"; verified with {python}: {found.reason}"
            atomic.phase("verified")
            with guard.critical():
                (target.root / atomic.JOURNAL).unlink()
                done = True
            atomic.phase("done")
            return f"{recovered}{target.label}: applied ({scope}, {name(patch)}){verified}", Exit.OK
        except atomic.Interrupted as signalled:
            if done:
                state = "the apply had finished: patched" + (" and verified" if python else " (not verified)")
            elif replaced:
                with guard.critical():
                    _rollback(target)
                state = "rolled back: the files are as before"
            else:
                state = "nothing changed"
            raise ToolError(f"{target.label}: interrupted by {signalled.name}: {state}", signalled.code) from None
        except BaseException:
            if replaced and not done:
                with guard.critical():
                    _rollback(target)
            raise


def _rollback(target: Target) -> None:
    if (entries := atomic.read_journal(target.root)) is not None:
        atomic.restore(target.root, entries)


def valid_branch(branch: str) -> str:
    """A branch name git accepts (`git check-ref-format --branch`), or a refusal before any work."""
    if not branch or git("check-ref-format", "--branch", branch, check=False).returncode != 0:
        raise ToolError(f"--branch {branch!r}: not a valid branch name (git check-ref-format --branch)")
    return branch


def _git(target: Target, *args: str, cwd: Path, code: Exit = Exit.USAGE) -> str:
    """git, or a one-line refusal saying which step failed and that the checkout is as it was."""
    done = git(*args, cwd=cwd, check=False)
    if done.returncode != 0:
        why = first_error_line(done.stderr)
        raise ToolError(f"{target.label}: git {args[0]} failed: {why}; nothing changed", code)
    return done.stdout.strip()


def make_branch(target: Target, patches: list[Patch], branch: str) -> str:
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
    verdict = check(target, patches)
    if verdict.state in (State.APPLIED, State.EQUIVALENT):
        return (
            f"{target.label}: already fixed ({verdict.state.value[0].format(detail=verdict.detail)}); no branch made"
        )
    require(verdict)
    patch = verdict.patch
    if git("diff", "--quiet", "--", FIXED_FILE, *patch.test_files(), cwd=root, check=False).returncode != 0:
        raise ToolError(f"{target.label}: uncommitted changes in files the patch touches; commit or stash them")
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "am"
        try:
            _git(target, "worktree", "add", "--quiet", "--detach", str(worktree), "HEAD", cwd=root, code=Exit.FAILED)
            _git(target, "am", "--quiet", "-s", str(patch.path), cwd=worktree, code=Exit.FAILED)
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
