"""The one way the tool runs git, the reference behaviour reviewers use."""

import os
import shutil
import subprocess
from pathlib import Path

from mtp_mask_fix.errors import ToolError


def git(*args: str, cwd: Path | str | None = None, check: bool = True, env: dict | None = None, **kw):
    """Run the git CLI, refusing in one line where there is no git."""
    if shutil.which("git") is None:
        raise ToolError("git is not on PATH; install git (it is what applies and checks the patch)")
    env = dict(os.environ, **(env or {}))
    return subprocess.run(["git", *args], cwd=cwd, check=check, capture_output=True, text=True, env=env, **kw)


def apply_diff(diff: str, root: Path, *, strip=1, reverse=False, check=False, cached=False, env=None) -> str:
    """git's error of `git apply` (all or nothing) under root, or to the index `env` names if `cached`; "" if none."""
    # Outside a cached apply, which needs the repository, root is no part of an enclosing one: git would resolve the
    # paths from that one's top and skip ours.
    flags = {"-R": reverse, "--check": check, "--cached": cached}
    args = ["apply", f"-p{strip}", "--whitespace=nowarn", *[flag for flag, on in flags.items() if on]]
    env = dict(env or {}, **({} if cached else {"GIT_CEILING_DIRECTORIES": str(Path(root).resolve().parent)}))
    result = git(*args, "-", cwd=root, check=False, input=diff, env=env)
    return "" if result.returncode == 0 else (result.stderr.strip() or result.stdout.strip() or "git apply failed")


def stripped(path: str, strip: int) -> str:
    """A diff's path (src/megatron/...) as `git apply -p<strip>` names it."""
    return path.split("/", strip - 1)[-1]


def first_error_line(git_stderr: str) -> str:
    """git's most telling line, e.g. `error: patch failed: src/.../gpt_step.py:571`."""
    lines = [line for line in git_stderr.splitlines() if line.startswith("error:")]
    return "; ".join(lines[:2]) if lines else (git_stderr.strip().splitlines() or ["git gave no reason"])[0]
