"""Regenerate the patch from an upstream checkout: the fix as the current patch carries it, the tests as this repo has them.

Byte-stable: author, dates and message come from the current patch, `--zero-commit --no-signature`, and
Last-Update only moves when the diff itself changes. The user's checkout is never modified: the commit
is built in a temporary `--shared` clone through a temporary index, so no work tree is needed.
"""

import datetime
import re
import subprocess
import tempfile
from pathlib import Path

from mtp_mask_fix.errors import DRIFTED, ToolError
from mtp_mask_fix.patch import REPO, Patch, first_error_line, git, series
from mtp_mask_fix.targets import require_git_checkout


def mailinfo(patch: Patch) -> dict[str, str]:
    """git's own mailbox parser: Author, Email, Subject, Date and the message body."""
    with tempfile.TemporaryDirectory() as tmp:
        msg, rest = Path(tmp) / "msg", Path(tmp) / "rest"
        result = subprocess.run(
            ["git", "mailinfo", str(msg), str(rest)], input=patch.text, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise ToolError(f"patch {patch.path} is corrupted: git mailinfo: {result.stderr.strip()}")
        info = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
        info["Body"] = msg.read_text()
    return info


def base_commit(patch: Patch) -> str:
    """The upstream commit the patch was made on (its `base-commit:` trailer)."""
    match = re.search(r"^base-commit: ([0-9a-f]{40})$", patch.text, re.M)
    if not match:
        raise ToolError(f"patch {patch.path} has no base-commit line; pass --base")
    return match.group(1)


def repo_owned_files(patch: Patch) -> list[str]:
    """Files the patch adds whose source of truth is this repo (the upstream-bound tests)."""
    return sorted(path for path in patch.new_files() if (REPO / path).is_file())


def build(upstream: Path, base: str | None = None, patch: Patch | None = None) -> str:
    """The regenerated patch text (nothing written)."""
    patch = patch or Patch.load()
    require_git_checkout(upstream)
    base = base or base_commit(patch)
    resolved = git("rev-parse", "--verify", "--quiet", f"{base}^{{commit}}", cwd=upstream, check=False)
    if resolved.returncode != 0:
        raise ToolError(f"{base} is not a commit in {upstream}; fetch it, or pass --base REV")
    base_sha = resolved.stdout.strip()
    info = mailinfo(patch)
    owned = repo_owned_files(patch)
    carried = patch.diff if not owned else _diff_without(patch, owned)

    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "upstream"
        git("clone", "--quiet", "--shared", "--no-checkout", str(upstream), str(clone))
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git("read-tree", base_sha, cwd=clone, env_extra=env)
        carried_file = Path(tmp) / "carried.patch"
        carried_file.write_text(carried)
        applied = git("apply", "--cached", str(carried_file), cwd=clone, check=False, env_extra=env)
        if applied.returncode != 0:
            raise ToolError(
                f"the fix no longer applies to {base}: {first_error_line(applied.stderr)}; rebase the patch by hand",
                DRIFTED,
            )
        for path in owned:
            blob = git("hash-object", "-w", "--path", path, str(REPO / path), cwd=clone).stdout.strip()
            git("update-index", "--add", "--cacheinfo", f"100644,{blob},{path}", cwd=clone, env_extra=env)
        # --missing-ok: a partial clone may lack blobs of files the patch never touches.
        tree = git("write-tree", "--missing-ok", cwd=clone, env_extra=env).stdout.strip()
        identity = {
            "GIT_AUTHOR_NAME": info["Author"],
            "GIT_AUTHOR_EMAIL": info["Email"],
            "GIT_AUTHOR_DATE": info["Date"],
            "GIT_COMMITTER_NAME": info["Author"],
            "GIT_COMMITTER_EMAIL": info["Email"],
            "GIT_COMMITTER_DATE": info["Date"],
        }
        message = f"{info['Subject']}\n\n{info['Body']}"
        commit = git("commit-tree", tree, "-p", base_sha, "-F", "-", cwd=clone, env_extra=identity, input=message)
        text = git(
            "format-patch",
            "-1",
            "--stdout",
            "--zero-commit",
            "--no-signature",
            f"--base={base_sha}",
            commit.stdout.strip(),
            cwd=clone,
        ).stdout
    return _with_metadata(text, patch)


def _diff_without(patch: Patch, paths: list[str]) -> str:
    return "".join(str(f) for f in patch.files() if f.path not in paths)


def _with_metadata(text: str, old: Patch) -> str:
    """Re-insert the status block after `---`; Last-Update moves only if the diff changed."""
    meta = old.metadata()
    if Patch(old.path, text).diff != old.diff:
        meta["Last-Update"] = datetime.date.today().isoformat()
    block = "".join(f"{key}: {value}\n" for key, value in meta.items())
    head, sep, rest = text.partition("\n---\n")
    return f"{head}{sep}{block}\n{rest}"


def refresh(upstream: Path, base: str | None = None) -> tuple[Path, bool]:
    """Rewrite patches/<first in series>; returns (path, changed)."""
    path = series()[0]
    patch = Patch.load(path)
    text = build(upstream, base, patch)
    changed = text != patch.text
    if changed:
        path.write_text(text)
    return path, changed
