"""The committed patch itself: a well-formed, upstream-ready git format-patch, in step with this repo."""

import datetime
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from maintain.repo import REPO, VIEW, series
from maintain.upstreams import base_commit, load
from mtp_mask_fix import check
from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.git import apply_diff
from mtp_mask_fix.paths import PATCHES
from tests.support.targets import FIXED, UPSTREAM_TEST


RUFF = Path(sys.executable).parent / "ruff"
# DEP-3 (https://dep-team.pages.debian.net/deps/dep3/): the fields a patch header may carry, and their values.
DEP3_FIELDS = {
    "Description",
    "Subject",
    "Origin",
    "Bug",
    "Forwarded",
    "Author",
    "From",
    "Reviewed-by",
    "Acked-by",
    "Last-Update",
    "Applied-Upstream",
}


class TestSeries:
    def test_one_patch_listed(self):
        assert len(series()) == 1 and series()[0].suffix == ".patch"

    def test_every_patch_in_patches_is_listed(self):
        assert sorted(p.name for p in PATCHES.glob("*.patch")) == [p.name for p in series()]


class TestMailbox:
    """The format-patch envelope: what `git am` and reviewers read; squash merge keeps only title and trailers."""

    def test_changes_gpt_step_and_upstreams_own_test_file(self, patch):
        assert [f.path for f in patch.files] == [FIXED, UPSTREAM_TEST]

    def test_title_is_a_conventional_commit_of_at_most_60_characters(self, patch):
        """House style: the median title is about 60 characters before " (#NNNN)"."""
        subject = patch.headers["Subject"]
        assert re.fullmatch(r"fix\(training\): [a-z][^.]*[^.\s]", subject)
        assert len(subject) <= 60
        assert "loss_mask" in subject and "MTP" in subject

    def test_the_fix_comment_says_why_the_guard(self, patch):
        """The next refactor must not simplify `if use_mtp:` away: the comment names the only reader and FalconH1."""
        (source,) = [f for f in patch.files if f.path == FIXED]
        comment = "".join(line.value for hunk in source for line in hunk if line.is_added and "#" in line.value)
        assert "MTP loss" in comment and "FalconH1Model" in comment

    def test_body_is_at_most_10_lines_and_closes_the_issue(self, patch):
        assert len(patch.body.splitlines()) <= 10
        assert patch.body.splitlines()[-1] == "Fixes #6103"

    def test_zero_commit_and_base_commit(self, patch):
        assert patch.text.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n")
        assert re.fullmatch(r"[0-9a-f]{40}", base_commit(patch) or "")

    def test_no_sign_off(self, patch):
        """The submitter signs off with `./run branch` (git am -s); the carried patch holds none."""
        assert "Signed-off-by" not in patch.text

    def test_lf_line_endings_and_utf8(self):
        raw = series()[0].read_bytes()
        assert b"\r" not in raw and raw.endswith(b"\n")
        raw.decode("utf-8")

    def test_maintain_loads_it_whole_from_its_own_path(self, patch):
        """maintain's load refuses a damaged mailbox (a cut, its diffstat unmatched): the carried one passes."""
        assert load(series()[0]).text == patch.text


class TestDep3:
    """The status block after `---` (git am leaves it out of the commit) uses DEP-3 fields with DEP-3's meanings."""

    def test_only_dep3_fields(self, patch):
        assert set(patch.metadata) <= DEP3_FIELDS, set(patch.metadata) - DEP3_FIELDS

    def test_bug_is_the_upstream_issue(self, patch):
        assert patch.metadata["Bug"] == "https://github.com/NVIDIA-NeMo/Megatron-Bridge/issues/6103"

    def test_forwarded(self, patch):
        assert re.fullmatch(r"no|not-needed|https://\S+", patch.metadata["Forwarded"])

    def test_applied_upstream_only_once_applied(self, patch):
        value = patch.metadata.get("Applied-Upstream")
        assert value is None or re.fullmatch(
            r"[\w.]+(, commit:[0-9a-f]{7,40})?|https://\S+|commit:[0-9a-f]{7,40}", value
        )

    def test_last_update(self, patch):
        date = datetime.date.fromisoformat(patch.metadata["Last-Update"])
        assert date.isoformat() == patch.metadata["Last-Update"] and date <= datetime.date.today()


class TestContent:
    """Small, in upstream's idiom: one source hunk that only adds, and at most 60 test lines in upstream's file."""

    def test_source_hunk_only_adds_a_few_lines(self, patch):
        (source,) = [f for f in patch.files if f.path == FIXED]
        assert (len(source), source.removed, source.added <= 4) == (1, 0, True)

    def test_test_part_adds_at_most_60_lines(self, patch):
        (tests,) = [f for f in patch.files if f.path == UPSTREAM_TEST]
        assert tests.added <= 60

    def test_source_hunk_applies_to_the_pinned_release(self, patch, release):
        assert apply_diff(patch.part(src=True), release.root, strip=2, check=True) == ""


class TestGeneratedView:
    """src/ is generated (pinned release + patch), never edited by hand: a drift guard."""

    def test_view_equals_release_plus_patch(self, patched_gpt_step):
        assert (VIEW / FIXED.removeprefix("src/")).read_text() == patched_gpt_step

    def test_the_release_itself_is_untouched(self, patch, release):
        assert apply_diff(patch.part(src=True), release.root, strip=2, reverse=True, check=True) != ""

    def test_a_write_through_the_view_leaves_the_cached_release_unchanged(self, release, tmp_path, monkeypatch):
        import maintain.view

        monkeypatch.setattr(maintain.view, "VIEW", tmp_path / "src")
        maintain.view.view(None)
        before = {path: path.read_bytes() for path in release.root.rglob("*.py")}
        for path in (tmp_path / "src").rglob("*.py"):
            with open(path, "a") as handle:
                handle.write("# edited by hand\n")
        assert {path: path.read_bytes() for path in release.root.rglob("*.py")} == before


class TestRuff:
    """Upstream CI runs ruff with these settings (pyproject mirrors upstream's ruff.toml); refresh runs ruff with
    upstream's own ruff.toml on the patch's test part, inside the checkout."""

    @pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
    @pytest.mark.parametrize("target", ["tests/unit_tests", FIXED], ids=["unit_tests", "view"])
    def test_clean(self, command, target):
        result = subprocess.run([str(RUFF), *command, "--no-cache", target], cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def _head(patch) -> str:
    return patch.text.split("\n---\n", 1)[0]


NEW = "src/megatron/bridge/training/new_module.py"
# name: (the damaged copy, made from the patch's text; what the refusal says)
DAMAGED = {
    "cut in the source hunk": (lambda p: p.text[: p.text.index("     }\n+    if use_mtp:")], "corrupted"),
    "cut at a file boundary": (lambda p: p.text[: p.text.index(f"diff --git a/{UPSTREAM_TEST}")], "corrupted"),
    "empty": (lambda p: "", "corrupted"),
    "binary garbage": (lambda p: "\x00\xff\xfe garbage \x13\x37\n" * 50, "corrupted"),
    "no diff": (lambda p: _head(p) + "\n", "corrupted"),
    "CRLF line endings": (lambda p: p.text.replace("\n", "\r\n"), "CRLF line endings"),
    "tests only": (lambda p: f"{_head(p)}\n---\n\n{p.part(src=False)}", "changes to existing files"),
    "a file created": (
        lambda p: (
            f"{_head(p)}\n---\n\ndiff --git a/{NEW} b/{NEW}\nnew file mode 100644\n--- /dev/null\n+++ b/{NEW}\n"
            "@@ -0,0 +1 @@\n+x = 1\n"
        ),
        "changes to existing files",
    ),
}


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_patch_is_refused_in_one_line(patch, tmp_path, name):
    """What `./run gate --patch` loads: never a traceback, nor a patch read half."""
    damaged, words = DAMAGED[name]
    path = tmp_path / "damaged.patch"
    path.write_bytes(damaged(patch).encode("utf-8", errors="surrogateescape"))
    with pytest.raises(ToolError, match=words) as refused:
        load(path)
    assert refused.value.code == 2 and "\n" not in str(refused.value)


def test_a_missing_patch_is_refused(tmp_path):
    with pytest.raises(ToolError, match="cannot read patch"):
        load(tmp_path / "nope.patch")


def test_a_patch_cut_short_in_the_package_is_refused_in_one_line(
    cli, refused, site_packages, patch, tmp_path, monkeypatch
):
    """An installed tool whose package data lost its patch's end: one line naming the file, exit 2, no traceback."""
    copy = tmp_path / "patches"
    shutil.copytree(PATCHES, copy)
    cut = copy / patch.path.name
    cut.write_text(patch.text[: patch.text.index("     }\n+    if use_mtp:")])
    monkeypatch.setattr(check, "PATCHES", copy)
    refused(cli("check", site_packages.root), 2, f"{cut}: its diff is cut short", "reinstall mtp-mask-fix")
