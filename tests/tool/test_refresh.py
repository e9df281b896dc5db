"""refresh: regenerating the patch from an upstream checkout (a throwaway one built in tmp_path)."""

import datetime
import re

import pytest

from mtp_mask_fix.errors import DRIFTED, ToolError
from mtp_mask_fix.patch import PATCHES, REPO, Patch
from mtp_mask_fix.refresh import build

from .conftest import FIXED, NEW_TEST, UPSTREAM_TEST


@pytest.fixture
def upstream(checkout):
    """The throwaway upstream: base commit = release gpt_step.py + synthesized test_gpt_step.py."""
    return checkout


@pytest.fixture
def rebuilt(upstream, patch) -> str:
    """The patch regenerated on the throwaway upstream's HEAD (the committed base-commit is a real upstream one)."""
    return build(upstream.root, base="HEAD", patch=patch)


@pytest.fixture
def applied_clone(tmp_path, git, upstream, rebuilt):
    """A clone of the upstream with the regenerated patch applied by `git am`."""
    patch_file = tmp_path / "rebuilt.patch"
    patch_file.write_text(rebuilt)
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "--quiet", str(upstream.root), str(clone))
    git(clone, "am", "--quiet", str(patch_file))
    return clone


class TestBuild:
    """build() on a throwaway upstream, with the real tooling flow."""

    def test_applies_with_git_am(self, git, applied_clone, upstream, release, patch):
        assert git(applied_clone, "rev-list", "--count", "HEAD").strip() == "2"
        assert git(applied_clone, "status", "--porcelain") == ""
        fixed = (applied_clone / FIXED).read_text()
        assert '        "loss_mask": loss_mask,\n' in fixed
        assert fixed.count("\n") == release.fixed_file.read_text().count("\n") + 3
        assert "            loss_mask=loss_mask,\n" in (applied_clone / UPSTREAM_TEST).read_text()
        assert (applied_clone / NEW_TEST).read_bytes() == (REPO / NEW_TEST).read_bytes()

    def test_byte_stable(self, upstream, patch, rebuilt):
        assert build(upstream.root, base="HEAD", patch=patch) == rebuilt

    def test_new_test_file_is_this_repos(self, rebuilt, tmp_path):
        regenerated = Patch(tmp_path / "rebuilt.patch", rebuilt)
        assert regenerated.new_files() == {NEW_TEST: (REPO / NEW_TEST).read_text()}

    def test_same_message_author_and_date(self, rebuilt, tmp_path, patch):
        regenerated = Patch(tmp_path / "rebuilt.patch", rebuilt)
        assert regenerated.subject == patch.subject
        assert regenerated.body == patch.body
        for header in ("From: ", "Date: "):
            (old,) = [line for line in patch.text.splitlines() if line.startswith(header)]
            assert old in rebuilt.splitlines()
        assert rebuilt.startswith("From 0000000000000000000000000000000000000000 ")
        assert "Signed-off-by" not in rebuilt

    def test_metadata_block_preserved(self, rebuilt, tmp_path, patch):
        """The DEP-3 block sits right after `---`, keys in order; the diff moved (new base), so Last-Update is today."""
        regenerated = Patch(tmp_path / "rebuilt.patch", rebuilt)
        old = patch.metadata()
        new = regenerated.metadata()
        assert list(new) == list(old)
        assert {k: v for k, v in new.items() if k != "Last-Update"} == {
            k: v for k, v in old.items() if k != "Last-Update"
        }
        assert new["Last-Update"] == datetime.date.today().isoformat()
        assert rebuilt.split("\n---\n", 1)[1].startswith(f"Bug: {old['Bug']}\n")

    def test_last_update_kept_when_the_diff_is_unchanged(self, upstream, rebuilt, tmp_path):
        """Refreshing an up-to-date patch is a no-op, byte for byte: Last-Update does not move."""
        dated = rebuilt.replace(f"Last-Update: {datetime.date.today().isoformat()}\n", "Last-Update: 2020-01-02\n")
        assert dated != rebuilt
        path = tmp_path / "dated.patch"
        path.write_text(dated)
        again = build(upstream.root, base="HEAD", patch=Patch.load(path))
        assert Patch(path, again).metadata()["Last-Update"] == "2020-01-02"
        assert again == dated

    def test_last_update_kept_on_a_new_base_with_the_same_diff(self, git, upstream, rebuilt, tmp_path):
        """Upstream moved on elsewhere (README only): the diff is the same, only `base-commit:` moves."""
        path = tmp_path / "dated.patch"
        path.write_text(re.sub(r"(?m)^Last-Update: .*$", "Last-Update: 2020-01-02", rebuilt))
        (upstream.root / "README.md").write_text("upstream moved on\n")
        git(upstream.root, "commit", "--quiet", "-am", "docs")
        again = build(upstream.root, base="HEAD", patch=Patch.load(path))
        assert str(Patch(path, again).files()) == str(Patch.load(path).files())  # same diff
        assert Patch(path, again).metadata()["Last-Update"] == "2020-01-02"

    def test_git_am_leaves_metadata_out_of_the_message(self, git, applied_clone, patch):
        message = git(applied_clone, "log", "-1", "--format=%B")
        assert message == f"{patch.subject}\n\n{patch.body}\n\n"
        for key in patch.metadata():
            assert f"{key}:" not in message
        assert (
            git(applied_clone, "log", "-1", "--format=%an <%ae>").strip()
            == "mtp-mask-fix <mtp-mask-fix@users.noreply.github.com>"
        )

    def test_drifted_upstream(self, edit, upstream, patch):
        edit(upstream, upstream.gpt_step, '        "attention_mask": attention_mask,\n', "        # gone\n")
        with pytest.raises(ToolError, match="no longer applies") as raised:
            build(upstream.root, base="HEAD", patch=patch)
        assert raised.value.code == DRIFTED

    def test_upstream_is_never_modified(self, snapshot, upstream, patch):
        before = snapshot(upstream.root)
        build(upstream.root, base="HEAD", patch=patch)
        assert snapshot(upstream.root) == before


class TestRefreshCommand:
    """`refresh --upstream` refusals: one line, and patches/ untouched."""

    def test_non_git_upstream(self, cli, refused, snapshot, source_tree):
        before = snapshot(source_tree.root, PATCHES)
        refused(cli("refresh", "--upstream", source_tree.root), 2, "not the top of a git checkout")
        assert snapshot(source_tree.root, PATCHES) == before

    def test_missing_upstream(self, cli, refused, snapshot, tmp_path):
        before = snapshot(PATCHES)
        refused(cli("refresh", "--upstream", tmp_path / "nope"), 2, "no such directory")
        assert snapshot(PATCHES) == before

    def test_base_commit_not_in_upstream(self, cli, refused, snapshot, upstream):
        """The committed base-commit names a real upstream commit, absent from the throwaway one."""
        before = snapshot(upstream.root, PATCHES)
        refused(cli("refresh", "--upstream", upstream.root), 2, "is not a commit in")
        assert snapshot(upstream.root, PATCHES) == before
