"""`./run branch CHECKOUT NAME` (maintain/branch.py): one signed-off commit by the configured user on a new branch, or a
one-line refusal with the checkout as it was."""

import pytest
from unidiff import PatchSet

from tests.support.targets import CONTEXT, FAR_FROM_HUNK, FIXED, REGION_EDIT, SUBMITTER, changed_lines, hunk_parts


pytestmark = pytest.mark.slow


class TestBranch:
    @pytest.fixture
    def submitter(self, git, checkout):
        git(checkout.root, "config", "user.name", SUBMITTER[0])
        git(checkout.root, "config", "user.email", SUBMITTER[1])
        return f"{SUBMITTER[0]} <{SUBMITTER[1]}>"

    def test_where_upstreams_test_file_moved_on_the_branch_holds_the_source_alone(
        self, branch, git, edit, checkout, patch, submitter
    ):
        edit(checkout, checkout.upstream_test, "_flops_seqlen_sum == 0\n", "_flops_seqlen_sum == 0  # moved on\n")
        result = branch(checkout.root, "fix-6103")
        assert result.returncode == 0, result.stderr
        assert "source hunks only: upstream's test file has moved on" in result.stdout
        assert changed_lines(PatchSet(git(checkout.root, "diff", "main", "fix-6103"))) == hunk_parts(
            patch, src_only=True
        )

    def test_branch_holds_one_signed_off_commit(self, branch, git, checkout, patch, submitter):
        main = git(checkout.root, "rev-parse", "main").strip()
        result = branch(checkout.root, "fix-6103")
        assert result.returncode == 0, result.stderr
        assert "branch fix-6103 holds the fix" in result.stdout

        assert git(checkout.root, "rev-parse", "main").strip() == main  # original branch untouched
        assert git(checkout.root, "branch", "--show-current").strip() == "fix-6103"
        assert git(checkout.root, "rev-list", "main..fix-6103").count("\n") == 1
        assert git(checkout.root, "rev-parse", "fix-6103~1").strip() == main
        assert git(checkout.root, "status", "--porcelain") == ""

        message = git(checkout.root, "log", "-1", "--format=%B", "fix-6103")
        assert message == f"{patch.headers['Subject']}\n\n{patch.body}\n\nSigned-off-by: {submitter}\n\n"
        assert git(checkout.root, "log", "-1", "--format=%an <%ae>|%cn <%ce>", "fix-6103").strip() == (
            f"{submitter}|{submitter}"
        )
        committed = PatchSet(git(checkout.root, "diff", "main", "fix-6103"))
        assert changed_lines(committed) == hunk_parts(patch, src_only=False)

    def test_unstaged_change_elsewhere_in_a_touched_file(self, branch, git, edit, refused, checkout, submitter):
        """`git am` needs touched files to match the index: a clean one-line refusal, nothing left behind."""
        edit(checkout, checkout.gpt_step, FAR_FROM_HUNK, "import logging  # local note\n", commit=False)
        branches = git(checkout.root, "branch")
        refused(branch(checkout.root, "fix-6103"), 2, "uncommitted changes")
        assert git(checkout.root, "branch") == branches
        assert git(checkout.root, "status", "--porcelain") == f" M {FIXED}\n"
        assert "# local note" in checkout.gpt_step.read_text()

    def test_detached_head_is_restored_after_a_failed_am(self, branch, git, refused, checkout, submitter):
        """From a detached HEAD, a failing `git am` (its pre-applypatch hook refuses) leaves HEAD where it was."""
        git(checkout.root, "switch", "--quiet", "--detach", "main")
        hook = checkout.root / ".git" / "hooks" / "pre-applypatch"
        hook.write_text("#!/bin/sh\nexit 1\n")
        hook.chmod(0o755)
        head = git(checkout.root, "rev-parse", "HEAD")
        refused(branch(checkout.root, "fix-6103"), 5, "git am failed")
        assert git(checkout.root, "branch", "--list", "fix-6103") == ""
        assert git(checkout.root, "branch", "--show-current") == ""  # still detached
        assert git(checkout.root, "rev-parse", "HEAD") == head
        assert git(checkout.root, "status", "--porcelain") == ""

    def test_failing_commit_hook(self, branch, git, refused, checkout, submitter):
        """A failing pre-commit hook (e.g. upstream's, with pre-commit not installed) must not half-finish the
        branch: either the commit is made (hooks skipped) or the refusal is one line and clean.
        """
        hook = checkout.root / ".git" / "hooks" / "pre-commit"
        hook.write_text("#!/bin/sh\necho 'pre-commit: command not found' >&2\nexit 1\n")
        hook.chmod(0o755)
        result = branch(checkout.root, "fix-6103")
        if result.returncode == 0:
            assert git(checkout.root, "log", "-1", "--format=%an <%ae>", "fix-6103").strip() == submitter
        else:
            refused(result, result.returncode)
            assert git(checkout.root, "branch", "--list", "fix-6103") == ""
            assert git(checkout.root, "branch", "--show-current") == "main\n"

    @pytest.mark.parametrize("existing, wanted", [("fix", "fix/mtp-mask"), ("fix/mtp-mask", "fix")])
    def test_branch_whose_name_clashes_with_a_branch(
        self, branch, git, refused, checkout, submitter, existing, wanted
    ):
        """git stores `fix` and `fix/x` as a file and a folder: one cannot be made beside the other. Refused with the
        checkout as it was: on its branch, nothing staged, no new branch."""
        git(checkout.root, "branch", existing)
        branches = git(checkout.root, "branch")
        refused(branch(checkout.root, wanted), 2, "nothing changed")
        assert git(checkout.root, "branch") == branches
        assert git(checkout.root, "status", "--porcelain") == ""

    def test_branch_when_already_fixed_exits_0_and_makes_none(self, branch, git, checkout, submitter):
        assert branch(checkout.root, "fix-6103").returncode == 0
        result = branch(checkout.root, "again")
        assert (result.returncode, result.stderr) == (0, "")
        assert "already fixed" in result.stdout and "no branch made" in result.stdout
        assert "again" not in git(checkout.root, "branch")


# name: (the target, what to do to it first, the branch name, the words of the refusal)
REFUSALS = {
    "a missing path": ("missing", None, "fix-6103", "no such file or directory"),
    "a tree without git": ("source_tree", None, "fix-6103", "not the top of a Megatron-Bridge git checkout"),
    "site-packages": ("site_packages", None, "fix-6103", "not the top of a Megatron-Bridge git checkout"),
    "no git identity": ("checkout", "no identity", "fix-6103", "user.name is not set"),
    "local edits in the region": ("checkout", "region edit", "fix-6103", "local changes"),
    "staged changes": ("checkout", "staged", "fix-6103", "staged changes"),
    "a branch that exists": ("checkout", "branch exists", "fix-6103", "already exists"),
    **{
        f"the name {name!r}": ("checkout", None, name, "not a valid branch name")
        for name in ("", "bad..name", "-x", "a b", "x.lock")
    },
}


@pytest.mark.parametrize("name", REFUSALS)
def test_refused_in_one_line_with_the_checkout_as_it_was(
    request, branch, git, edit, refused, snapshot, tmp_path, name
):
    kind, first, new, words = REFUSALS[name]
    root = tmp_path / "no-such-dir" if kind == "missing" else request.getfixturevalue(kind).root
    if kind == "checkout" and first != "no identity":
        git(root, "config", "user.name", SUBMITTER[0])
        git(root, "config", "user.email", SUBMITTER[1])
    if first == "region edit":
        edit(request.getfixturevalue(kind), root / FIXED, CONTEXT, REGION_EDIT, commit=False)
    elif first == "staged":
        (root / "README.md").write_text("staged edit\n")
        git(root, "add", "README.md")
    elif first == "branch exists":
        git(root, "branch", new)
    before = snapshot(tmp_path)
    refused(branch(root, new), 2, words)
    assert snapshot(tmp_path) == before
