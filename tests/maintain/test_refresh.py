"""`./run refresh` (maintain/refresh.py): the patch is edited as a commit in an upstream checkout and turned back into
the mailbox."""

import datetime
import re

import pytest

from maintain.refresh import build
from maintain.repo import checkout as checkout_target
from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PATCHES
from tests.support.targets import FIXED, SUBMITTER, UPSTREAM_TEST


pytestmark = pytest.mark.slow


def _changed_lines(patch: Patch) -> list[tuple[str, str]]:
    return [(x.line_type, x.value) for f in patch.files for hunk in f for x in hunk if x.is_added or x.is_removed]


@pytest.fixture
def upstream(branch, git, checkout):
    """The throwaway upstream with the patch as a commit on branch wip, made the way a developer would."""
    git(checkout.root, "config", "user.name", SUBMITTER[0])
    git(checkout.root, "config", "user.email", SUBMITTER[1])
    assert branch(checkout.root, "wip").returncode == 0
    return checkout


@pytest.fixture
def refresh(maintain):
    return lambda *args: maintain("refresh", *args)


@pytest.fixture
def rebuilt(upstream, patch) -> str:
    return build(checkout_target(upstream.root), "wip", patch)


class TestBuild:
    def test_round_trip(self, rebuilt, patch, tmp_path):
        """Same message, author, date, DEP-3 block and changed lines; only line numbers and blob ids may move."""
        new = Patch.load(tmp_path / "rebuilt.patch", rebuilt)
        assert (new.headers, new.body) == (patch.headers, patch.body)
        assert {k: v for k, v in new.metadata.items() if k != "Last-Update"} == {
            k: v for k, v in patch.metadata.items() if k != "Last-Update"
        }
        assert _changed_lines(new) == _changed_lines(patch)
        assert "Signed-off-by" not in rebuilt  # `./run branch` signed off; the carried patch holds none
        assert rebuilt.startswith("From 0000000000000000000000000000000000000000 ")

    def test_byte_stable(self, upstream, patch, rebuilt):
        assert build(checkout_target(upstream.root), "wip", patch) == rebuilt

    def test_last_update_moves_only_when_the_diff_changes(self, upstream, rebuilt, tmp_path):
        """The throwaway upstream's line numbers differ from real main's, so the diff moved: today. Rebuilt again
        from the rebuilt patch, the diff is the same: the date stays, whatever it was."""
        assert Patch.load(tmp_path / "p", rebuilt).metadata["Last-Update"] == datetime.date.today().isoformat()
        dated = re.sub(r"(?m)^Last-Update: .*$", "Last-Update: 2020-01-02", rebuilt)
        again = build(checkout_target(upstream.root), "wip", Patch.load(tmp_path / "p", dated))
        assert again == dated

    def test_edits_to_the_commit_reach_the_patch(self, git, upstream, patch, tmp_path):
        """gbp-pq style: amend the commit in the checkout, refresh, and the patch carries the edit."""
        text = upstream.gpt_step.read_text().replace(
            'forward_args["loss_mask"] = loss_mask', 'forward_args["loss_mask"] = loss_mask  # edited'
        )
        upstream.gpt_step.write_text(text)
        git(upstream.root, "commit", "--quiet", "--amend", "--no-edit", "-a")
        new = Patch.load(tmp_path / "p", build(checkout_target(upstream.root), "wip", patch))
        assert 'forward_args["loss_mask"] = loss_mask  # edited' in new.part(src=True)
        assert [f.path for f in new.files] == [FIXED, UPSTREAM_TEST]

    def test_a_commit_without_parent_is_refused(self, git, upstream, patch):
        root_commit = git(upstream.root, "rev-list", "--max-parents=0", "HEAD").strip()
        with pytest.raises(ToolError, match="not a commit with a parent"):
            build(checkout_target(upstream.root), root_commit, patch)

    def test_upstream_is_never_modified(self, snapshot, upstream, patch):
        before = snapshot(upstream.root)
        build(checkout_target(upstream.root), "wip", patch)
        assert snapshot(upstream.root) == before


class TestRefreshCommand:
    """`refresh` refusals: one line, and patches/ untouched."""

    def test_neither_upstream_nor_backports(self, refresh, refused, snapshot):
        before = snapshot(PATCHES)
        line = refused(refresh(), 2, "one of the arguments --upstream --backports is required")
        assert "(see ./run refresh --help)" in line
        assert snapshot(PATCHES) == before

    def test_non_git_upstream(self, refresh, refused, snapshot, source_tree):
        before = snapshot(source_tree.root, PATCHES)
        refused(
            refresh("--upstream", source_tree.root, "--no-verify"),
            2,
            "not the top of a Megatron-Bridge git checkout",
        )
        assert snapshot(source_tree.root, PATCHES) == before

    def test_missing_upstream(self, refresh, refused, snapshot, tmp_path):
        before = snapshot(PATCHES)
        refused(refresh("--upstream", tmp_path / "nope", "--no-verify"), 2, "no such file or directory")
        assert snapshot(PATCHES) == before

    def test_rev_that_is_not_a_commit(self, refresh, refused, snapshot, upstream):
        before = snapshot(upstream.root, PATCHES)
        refused(refresh("--upstream", upstream.root, "--from", "no-such-branch", "--no-verify"), 2, "not a commit")
        assert snapshot(upstream.root, PATCHES) == before

    def test_a_patch_whose_tests_do_not_hold_there_is_not_written(self, refresh, refused, snapshot, upstream):
        """The throwaway upstream's test file is only the patch's context: its tests cannot run, so nothing
        proves the patch there, and refresh writes nothing."""
        before = snapshot(PATCHES)
        refused(refresh("--upstream", upstream.root, "--from", "wip"), 5, "not written")
        assert snapshot(PATCHES) == before
