"""check and apply: the three states of a carried patch, and an all-or-nothing apply verified by behaviour."""

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mtp_mask_fix.errors import ALREADY_APPLIED, DRIFTED, FAILED, ToolError
from mtp_mask_fix.patch import REPO, Patch, apply_diff, first_error_line, git
from mtp_mask_fix.targets import Target


APPLIES = 0


@dataclass
class Verdict:
    """One of the three states, with its exit code and a one-line explanation."""

    code: int  # APPLIES, ALREADY_APPLIED or DRIFTED
    message: str


def diff_for(target: Target, patch: Patch) -> str:
    """The whole patch where upstream's tests are present; the source hunks alone elsewhere."""
    return patch.part(src=None if target.has_tests else True)


def fix_present(source: str) -> bool:
    """Whether `_forward_step_common` passes loss_mask=loss_mask to the model, whatever the exact lines.

    Recognises an equivalent upstream fix (e.g. without our comment) as applied, so the patch can retire.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for func in ast.walk(tree):
        if not (isinstance(func, ast.FunctionDef) and func.name == "_forward_step_common"):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Dict):
                pairs = zip(node.keys, node.values)
                if any(_is_loss_mask_key(k) and _is_loss_mask_name(v) for k, v in pairs):
                    return True
            if isinstance(node, ast.Assign) and _is_loss_mask_name(node.value):
                if any(isinstance(t, ast.Subscript) and _is_loss_mask_key(t.slice) for t in node.targets):
                    return True  # forward_args["loss_mask"] = loss_mask
            if isinstance(node, ast.Call) and any(
                kw.arg == "loss_mask" and _is_loss_mask_name(kw.value) for kw in node.keywords
            ):
                if getattr(node.func, "attr", None) != "build_schedule_plan":
                    return True
    return False


def _is_loss_mask_key(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == "loss_mask"


def _is_loss_mask_name(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "loss_mask"


def check(target: Target, patch: Patch) -> Verdict:
    """Applies, already applied, or drifted: forward check, reverse check, then why it failed."""
    diff = diff_for(target, patch)
    error = apply_diff(diff, target.root, strip=target.strip, check=True)
    if not error:
        return Verdict(APPLIES, f"{target.label}: the patch applies ({_scope(target)}); the bug is present")
    if not apply_diff(diff, target.root, strip=target.strip, reverse=True, check=True):
        return Verdict(ALREADY_APPLIED, f"{target.label}: already applied; nothing to do")
    if fix_present(target.fixed_file.read_text(errors="replace")):
        return Verdict(
            ALREADY_APPLIED,
            f"{target.label}: gpt_step already passes loss_mask to the model (an equivalent fix); retire the patch",
        )
    if target.kind == "git" and _applies_to_head(target, diff):
        return Verdict(
            DRIFTED,
            f"{target.label}: local changes in the patch's region ({first_error_line(error)}); commit or stash them",
        )
    return Verdict(DRIFTED, f"{target.label}: drifted: {first_error_line(error)}")


def _scope(target: Target) -> str:
    return "source and tests" if target.has_tests else "source hunks only: no tests/ here"


def _applies_to_head(target: Target, diff: str) -> bool:
    """Whether the patch applies to the committed files, i.e. only uncommitted edits are in the way."""
    with tempfile.TemporaryDirectory() as tmp:
        for path in _touched(diff):
            shown = git("show", f"HEAD:{path}", cwd=target.root, check=False)
            if shown.returncode == 0:
                (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / path).write_text(shown.stdout)
        return not apply_diff(diff, Path(tmp), check=True)


def _touched(diff: str) -> list[str]:
    return [line.split(" b/", 1)[1] for line in diff.splitlines() if line.startswith("diff --git ")]


def apply(target: Target, patch: Patch, *, verify: bool = True, python: str = sys.executable) -> str:
    """Apply to the files in place, all or nothing; with verify, prove the model now gets the mask."""
    if target.kind == "pypi":
        raise ToolError(f"{target.label} is a downloaded release; apply to a checkout or an installed package")
    verdict = check(target, patch)
    if verdict.code != APPLIES:
        raise ToolError(verdict.message, verdict.code)
    diff = diff_for(target, patch)
    paths = [_strip(path, target.strip) for path in _touched(diff)]
    _require_writable(target.root, paths)
    with tempfile.TemporaryDirectory() as tmp:
        staging, backup = Path(tmp) / "staging", Path(tmp) / "backup"
        for path in paths:
            if (target.root / path).exists():
                for copy in (staging, backup):
                    (copy / path).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(target.root / path, copy / path)
        error = apply_diff(diff, staging, strip=target.strip)
        if error:
            raise ToolError(f"{target.label}: {first_error_line(error)}", DRIFTED)
        _replace(staging, target.root, paths)
        if verify:
            found = behaviour(target, python)
            if "error" in found:
                _restore(backup, target.root, paths)
                raise ToolError(
                    f"{target.label}: rolled back, the fix could not be verified: {found['error']}; pass --python "
                    "an interpreter that imports this Megatron-Bridge (its megatron-core), or --no-verify",
                    FAILED,
                )
            if not (found.get("passes_loss_mask") and found.get("same_tensor_as_loss")):
                _restore(backup, target.root, paths)
                raise ToolError(
                    f"{target.label}: rolled back, the patched code still does not hand the batch's loss_mask "
                    f"to the model (probe: {found})",
                    FAILED,
                )
    return f"{target.label}: applied ({_scope(target)})" + (
        "; verified: the model receives loss_mask" if verify else ""
    )


def _strip(path: str, strip: int) -> str:
    return path.split("/", strip - 1)[-1] if strip > 1 else path


def _require_writable(root: Path, paths: list[str]) -> None:
    # By permission bits, not os.access: root may write anything, but a read-only file states intent.
    for path in paths:
        existing = root / path
        while not existing.exists():
            existing = existing.parent
        if not existing.stat().st_mode & 0o200:
            raise ToolError(f"{existing} is read-only; make it writable first")


def _replace(staging: Path, root: Path, paths: list[str]) -> None:
    """Write every file beside its original first, then rename them all into place."""
    pending = []
    try:
        for path in paths:
            dest = root / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.mtp-mask-fix")
            shutil.copy2(staging / path, tmp)
            pending.append((tmp, dest))
    except OSError as exc:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        raise ToolError(f"cannot write into {root}: {exc.strerror}") from exc
    for tmp, dest in pending:
        os.replace(tmp, dest)


def _restore(backup: Path, root: Path, paths: list[str]) -> None:
    for path in paths:
        if (backup / path).exists():
            shutil.copy2(backup / path, root / path)
        else:
            (root / path).unlink(missing_ok=True)


def behaviour(target: Target, python: str = sys.executable) -> dict:
    """Run the probe under `python` against the target's own files."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [python, "-m", "mtp_mask_fix.probe", str(target.import_root)], capture_output=True, text=True, env=env
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"probe could not import {target.import_root}: {tail}"}
    return json.loads(lines[-1])


def make_branch(target: Target, patch: Patch, branch: str) -> str:
    """On a git checkout: a new branch holding the patch as a commit by, and signed off by, the submitter.

    `git am -s` runs in a temporary worktree, so a failure anywhere (hooks, conflicts) leaves the checkout as it
    was; the checkout only changes at the final `git switch`, which git refuses if it would lose local edits.
    """
    if target.kind != "git":
        raise ToolError(f"{target.label}: --branch needs a git checkout")
    root = target.root
    for key in ("user.name", "user.email"):
        if not git("config", key, cwd=root, check=False).stdout.strip():
            raise ToolError(f"git {key} is not set in {target.label}; `git am -s` signs off as you")
    if git("rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", cwd=root, check=False).returncode == 0:
        raise ToolError(f"branch {branch} already exists in {target.label}")
    if git("diff", "--cached", "--quiet", cwd=root, check=False).returncode != 0:
        raise ToolError(f"{target.label} has staged changes; commit or unstage them first")
    verdict = check(target, patch)
    if verdict.code != APPLIES:
        raise ToolError(verdict.message, verdict.code)
    if git("diff", "--quiet", "--", *_touched(diff_for(target, patch)), cwd=root, check=False).returncode != 0:
        raise ToolError(
            f"{target.label}: uncommitted changes in files the patch touches; commit or stash them", DRIFTED
        )
    commit = _commit_in_worktree(target, patch)
    git("branch", branch, commit, cwd=root)
    switched = git("switch", "--quiet", branch, cwd=root, check=False)
    if switched.returncode != 0:
        git("branch", "--quiet", "-D", branch, cwd=root, check=False)
        raise ToolError(f"{target.label}: git switch failed: {first_error_line(switched.stderr)}; nothing changed")
    return f"{target.label}: branch {branch} holds the fix, signed off by you; push it and run `mtp-mask-fix pr`"


def _commit_in_worktree(target: Target, patch: Patch) -> str:
    """`git am -s` onto HEAD in a throwaway worktree; returns the commit id."""
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "am"
        added = git("worktree", "add", "--quiet", "--detach", str(worktree), "HEAD", cwd=target.root, check=False)
        try:
            if added.returncode != 0:
                raise ToolError(f"{target.label}: git worktree add failed: {first_error_line(added.stderr)}", FAILED)
            am = git("am", "--quiet", "-s", str(patch.path), cwd=worktree, check=False)
            if am.returncode != 0:
                raise ToolError(
                    f"{target.label}: git am failed: {first_error_line(am.stderr)}; nothing changed", DRIFTED
                )
            # The submitter authors the upstream commit; the mailbox's From is this repo's placeholder.
            # --no-verify: a local pre-commit hook must not stop the amend of git am's own commit.
            amend = git(
                "commit", "--quiet", "--amend", "--no-edit", "--no-verify", "--reset-author", cwd=worktree, check=False
            )
            if amend.returncode != 0:
                raise ToolError(
                    f"{target.label}: git commit failed: {first_error_line(amend.stderr)}; nothing changed"
                )
            return git("rev-parse", "HEAD", cwd=worktree).stdout.strip()
        finally:
            git("worktree", "remove", "--force", str(worktree), cwd=target.root, check=False)
            git("worktree", "prune", cwd=target.root, check=False)
