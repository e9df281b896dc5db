"""`./run branch CHECKOUT NAME`: the patch as a commit on a new branch of a Megatron-Bridge git checkout, authored and
signed off by you (why both: CONTRIBUTING.md, "Commits"), made in a temporary worktree so that the checkout changes
only at the final switch. The patch queue's first step (CONTRIBUTING.md): amend the commit there, then `./run refresh`
writes it back; also the branch of the upstream PR."""

import tempfile
from pathlib import Path

from maintain import printed
from maintain.repo import UPSTREAM_TEST, checkout
from mtp_mask_fix import check, cli
from mtp_mask_fix.check import State
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import first_error_line, git
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.targets import Target


def make_branch(target: Target, patches: list[Patch], branch: str) -> str:
    """Make a new branch of a checkout holding the patch as a commit authored and signed off by you."""
    root = target.root
    for key in ("user.name", "user.email"):
        if not git("config", key, cwd=root, check=False).stdout.strip():
            raise ToolError(f"git {key} is not set in {target.label}; `git am -s` signs off as you")
    if git("rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", cwd=root, check=False).returncode == 0:
        raise ToolError(f"branch {branch} already exists in {target.label}")
    if git("diff", "--cached", "--quiet", cwd=root, check=False).returncode != 0:
        raise ToolError(f"{target.label} has staged changes; commit or unstage them first")
    verdict = check.check(target, patches)
    if verdict.state not in (State.APPLIED, State.EQUIVALENT, State.APPLIES):
        raise ToolError(str(verdict), verdict.state.code)
    if verdict.how_fixed:
        return f"{target.label}: already fixed ({verdict.how_fixed}); no branch made"
    if git("diff", "--quiet", "--", *verdict.patch.paths(), cwd=root, check=False).returncode != 0:
        raise ToolError(f"{target.label}: uncommitted changes in files the patch touches; commit or stash them")
    with tempfile.TemporaryDirectory() as worktree:  # detached: a killed run leaves no branch behind
        try:
            _git(target, "worktree", "add", "--quiet", "--detach", worktree, "HEAD", cwd=root, code=Exit.FAILED)
            only = ["--include=src/*"] if UPSTREAM_TEST not in verdict.rewrite else []  # its file moved on: check says
            _git(target, "am", "--quiet", "-s", *only, str(verdict.patch.path), cwd=worktree, code=Exit.FAILED)
            # --no-verify: a local pre-commit hook must not stop the amend of am's own commit; --reset-author:
            # the submitter authors the upstream commit (the mailbox's From is this repo's placeholder).
            _git(target, "commit", "-q", "--amend", "--no-edit", "--no-verify", "--reset-author", cwd=worktree)
            commit = git("rev-parse", "HEAD", cwd=worktree).stdout.strip()
        finally:
            git("worktree", "remove", "--force", worktree, cwd=root, check=False)
    # The branch first: git refuses a name that clashes with a branch (`fix` against `fix/x`) before any file
    # changes, which `switch --create` would only find once it had switched the files.
    _git(target, "branch", branch, commit, cwd=root)
    try:
        _git(target, "switch", "--quiet", branch, cwd=root)  # git refuses it if it would lose local edits
    except BaseException:
        git("branch", "--quiet", "-D", branch, cwd=root, check=False)
        raise
    scope = " (source hunks only: upstream's test file has moved on)" if UPSTREAM_TEST not in verdict.rewrite else ""
    said = f"{target.label}: branch {branch} holds the fix{scope}, signed off by you"
    return f"{said}; push it, and open the PR with upstream/pr-body.md"


def _git(target: Target, *args: str, cwd: Path | str, code: Exit = Exit.USAGE) -> None:
    """git, or a one-line refusal saying which step failed and that the checkout is as it was."""
    if (done := git(*args, cwd=cwd, check=False)).returncode != 0:
        why = first_error_line(done.stderr)
        raise ToolError(f"{target.label}: git {args[0]} failed: {why}; nothing changed", code)


def run(args) -> tuple[str, Exit]:
    """What `./run branch ARGS` prints, and its exit code; a branch name git refuses is refused before any work."""
    if not args.name or git("check-ref-format", "--branch", args.name, check=False).returncode != 0:
        raise ToolError(f"branch {args.name!r}: not a valid branch name (git check-ref-format --branch)")
    return make_branch(checkout(args.checkout), check.candidates(), args.name), Exit.OK


def parser() -> cli.Parser:
    """`./run branch`'s options; its refusals are the tool's (one line, the same exit codes)."""
    said = "the patch as a signed-off commit on a new branch of a checkout"
    parser = cli.Parser(prog="./run branch", description=said)
    parser.add_argument("checkout", metavar="CHECKOUT", help="the top of a Megatron-Bridge git checkout")
    parser.add_argument("name", metavar="NAME", help="the new branch")
    parser.set_defaults(func=printed(run))
    return parser


if __name__ == "__main__":
    cli.main(parser=parser())
