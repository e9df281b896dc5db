"""The committed patch itself: a well-formed, upstream-ready git format-patch, in step with this repo."""

import datetime
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_mask_fix.patch import BASE_FILE, PATCHES, REPO, Patch, apply_diff, series
from mtp_mask_fix.view import render

from .conftest import FIXED, NEW_TEST, UPSTREAM_TEST


PATCH_NAME = "0001-fix-training-pass-loss_mask-to-the-model-in-gpt_step.patch"
SUBJECT = "fix(training): pass loss_mask to the model in gpt_step"
RUFF = Path(sys.executable).parent / "ruff"


class TestSeries:
    def test_listed_first_in_series(self):
        assert series() == [PATCHES / PATCH_NAME]

    def test_every_patch_in_patches_is_listed(self):
        assert sorted(p.name for p in PATCHES.glob("*.patch")) == [p.name for p in series()]


class TestMailbox:
    """The format-patch envelope: what `git am` and reviewers read."""

    def test_parses(self, patch):
        assert [f.path for f in patch.files()] == [FIXED, UPSTREAM_TEST, NEW_TEST]

    def test_subject(self, patch):
        assert patch.subject == SUBJECT
        assert f"Subject: [PATCH] {SUBJECT}\n" in patch.text

    def test_zero_commit_from_line(self, patch):
        assert patch.text.startswith("From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n")

    def test_base_commit_line(self, patch):
        assert re.search(r"^base-commit: [0-9a-f]{40}$", patch.text, re.M)

    def test_no_sign_off(self, patch):
        """The submitter signs off with `apply --branch` (git am -s); the carried patch holds none."""
        assert "Signed-off-by" not in patch.text

    def test_lf_line_endings_and_utf8(self):
        raw = (PATCHES / PATCH_NAME).read_bytes()
        assert b"\r" not in raw
        raw.decode("utf-8")
        assert raw.endswith(b"\n")

    def test_metadata(self, patch):
        meta = patch.metadata()
        assert {"Bug", "Upstream-Status", "Forwarded", "Applied-Upstream", "Last-Update"} <= set(meta)
        assert meta["Bug"] == "https://github.com/NVIDIA-NeMo/Megatron-Bridge/issues/6103"
        assert datetime.date.fromisoformat(meta["Last-Update"]).isoformat() == meta["Last-Update"]

    def test_body_closes_the_issue(self, patch):
        assert patch.body.splitlines()[-1] == "Fixes #6103"

    def test_diffstat_matches_the_diff(self, patch):
        """The summary line git wrote agrees with what `git apply --numstat` counts in the diff."""
        numstat = subprocess.run(
            ["git", "apply", "--numstat", "-"], input=patch.diff, capture_output=True, text=True, check=True
        ).stdout.splitlines()
        added = sum(int(line.split("\t")[0]) for line in numstat)
        removed = sum(int(line.split("\t")[1]) for line in numstat)
        summary = f" {len(numstat)} files changed, {added} insertions(+)" + (
            f", {removed} deletions(-)" if removed else ""
        )
        assert summary + "\n" in patch.text


class TestContent:
    """What the diff changes, and that its carried files match this repo."""

    def test_only_gpt_step_among_sources(self, patch):
        assert [f.path for f in patch.files() if f.path.startswith("src/")] == [FIXED]

    def test_source_hunk_adds_only_the_kwarg_and_its_comment(self, patch):
        (source,) = [f for f in patch.files() if f.path == FIXED]
        added = [line.value for hunk in source for line in hunk if line.is_added]
        removed = [line.value for hunk in source for line in hunk if line.is_removed]
        assert removed == []
        assert added[-1] == '        "loss_mask": loss_mask,\n'
        assert all(line.lstrip().startswith("#") for line in added[:-1])

    def test_new_test_file_matches_the_repo(self, patch):
        """Drift guard: tests/unit_tests/... here is the source of truth, the patch carries it byte for byte."""
        assert patch.new_files()[NEW_TEST].encode() == (REPO / NEW_TEST).read_bytes()

    def test_source_hunks_apply_to_the_pinned_release(self, patch, release, tmp_path):
        tree = tmp_path / "megatron/bridge/training"
        tree.mkdir(parents=True)
        (tree / "gpt_step.py").write_bytes(release.fixed_file.read_bytes())
        assert apply_diff(patch.part(src=True), tmp_path, strip=2, check=True) == ""

    def test_loads_from_its_own_path(self, patch):
        again = Patch.load(PATCHES / PATCH_NAME)
        assert again.text == patch.text


class TestGeneratedView:
    """src/megatron/bridge/training/gpt_step.py is generated (base + patch), never edited by hand."""

    def test_view_equals_base_plus_patch(self, view_file, patch):
        assert view_file.read_text() == render(BASE_FILE, patch)

    def test_base_is_the_pinned_release(self, view_file, release):
        assert BASE_FILE.read_bytes() == release.fixed_file.read_bytes()


class TestRuff:
    """Upstream CI runs ruff with these settings; the upstream-bound files must pass it unchanged."""

    @pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
    @pytest.mark.parametrize("target", ["tests/unit_tests", FIXED], ids=["unit_tests", "view"])
    def test_clean(self, view_file, command, target):
        result = subprocess.run([str(RUFF), *command, "--no-cache", target], cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "error" not in result.stdout.lower()
