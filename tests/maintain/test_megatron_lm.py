"""The Megatron-LM patches through the same machinery as Megatron-Bridge's: read with their sources under src/, judged
by the rules of their upstream, rewritten by refresh from a commit, and (with an upstream checkout whose Megatron-LM
submodule holds their base-commits) held to red/green on core's own test file by `./run gate --megatron-lm`."""

import datetime
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maintain.gate import Row, judge
from maintain.redgreen import Job, Outcome, Run
from maintain.refresh import build
from maintain.repo import REPO, megatron_lm_checkout
from maintain.upstreams import BRIDGE, MEGATRON_LM, MEGATRON_LM_PATCHES, load, upstream_of
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.targets import Kind, Target


pytestmark = pytest.mark.slow

PATCHES = {path.stem: load(path) for path in sorted(MEGATRON_LM_PATCHES.glob("*.patch"))}
SOURCE = "megatron/core/transformer/multi_token_prediction.py"
TEST_FILE = "tests/unit_tests/transformer/test_multi_token_prediction.py"


def _changed_lines(patch: Patch) -> list[tuple[str, str]]:
    return [(x.line_type, x.value) for f in patch.files for hunk in f for x in hunk if x.is_added or x.is_removed]


class TestTheirPatches:
    def test_one_per_branch_each_on_the_commit_it_names(self):
        assert set(PATCHES) == {"main", "dev", "core_r0.19.0"}
        assert all(re.fullmatch(r"[0-9a-f]{40}", patch.base_commit) for patch in PATCHES.values())
        assert len({patch.base_commit for patch in PATCHES.values()}) == 3

    @pytest.mark.parametrize("name", ["main", "dev", "core_r0.19.0"])
    def test_read_with_their_sources_under_src_and_their_own_text(self, name):
        patch = PATCHES[name]
        assert patch.paths() == [f"src/{SOURCE}", TEST_FILE] and patch.test_files() == [TEST_FILE]
        assert patch.text == (MEGATRON_LM_PATCHES / f"{name}.patch").read_text()
        assert f"diff --git a/{SOURCE} b/{SOURCE}" in patch.text and "src/megatron" not in patch.text
        assert upstream_of(patch) == MEGATRON_LM and upstream_of(load()) == BRIDGE

    def test_every_branch_gets_the_same_test(self):
        added = {
            name: [
                line.value for file in p.files if file.path == TEST_FILE for h in file for line in h if line.is_added
            ]
            for name, p in PATCHES.items()
        }
        assert added["main"] == added["dev"] == added["core_r0.19.0"]


def _row(patch: Patch) -> Row:
    target = Target("upstream", Path("/nowhere"), Kind.INSTALLED)  # a release: no lint runs
    jobs = [Job((name,), Path(name)) for name in ("base", "patched", "without-1")]
    return Row(target, patch, *jobs[:2], jobs[2:], touched={"t.py::T::test_warns"})


def _runs(row: Row, base: dict, patched: dict, without: dict) -> dict:
    sides = zip([row.base, row.patched, *row.without], [base, patched, without])
    return {job: Run({n: Outcome(o) for n, o in outcomes.items()}, set(), set()) for job, outcomes in sides}


class TestJudge:
    """A test that fails on the base here for want of CUDA is counted, not held, for Megatron-LM only."""

    OTHERS = {"t.py::T::test_ok": "passed", "t.py::T::test_cuda": "failed by another exception"}
    BASE = {"t.py::T::test_warns": "failed by assertion", **OTHERS}
    PATCHED = {"t.py::T::test_warns": "passed", **OTHERS}
    WITHOUT = BASE

    def test_megatron_lm_counts_what_fails_on_the_base_here(self):
        row = _row(PATCHES["main"])
        judge(row, _runs(row, self.BASE, self.PATCHED, self.WITHOUT))
        assert (row.verdict.value[0], row.notes, row.unjudged, row.red) == ("PASS", [], 1, "1/1")

    def test_megatron_bridge_holds_every_test(self):
        row = _row(load())
        judge(row, _runs(row, self.BASE, self.PATCHED, self.WITHOUT))
        assert row.verdict.value[0] == "FAIL" and row.unjudged == 0
        assert any("t.py::T::test_cuda" in note for note in row.notes)

    def test_a_test_passing_on_the_base_is_held_to_pass_patched(self):
        row = _row(PATCHES["main"])
        broken = self.PATCHED | {"t.py::T::test_ok": "failed by assertion"}
        judge(row, _runs(row, self.BASE, broken, self.WITHOUT))
        assert row.verdict.value[0] == "FAIL" and any("t.py::T::test_ok" in note for note in row.notes)

    def test_a_hunk_the_tests_do_not_need_is_named(self):
        row = _row(PATCHES["main"])
        judge(row, _runs(row, self.BASE, self.PATCHED, self.PATCHED))
        assert row.verdict.value[0] == "FAIL" and any("source hunk 1" in note for note in row.notes)


@pytest.fixture
def megatron_lm(git, tmp_path) -> Path:
    """A throwaway Megatron-LM clone: main.patch's files made of its own context at their line numbers, committed,
    and the patch as a commit on top (`git am`), as a developer makes it."""
    patch, root = PATCHES["main"], tmp_path / "Megatron-LM"
    for file in patch.files:
        lines = [f"# line {n}\n" for n in range(1, max(h.source_start + h.source_length for h in file) + 5)]
        for hunk in file:
            kept = [line.value for line in hunk if not line.is_added]
            lines[hunk.source_start - 1 : hunk.source_start - 1 + len(kept)] = kept
        path = root / file.path.removeprefix("src/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(lines))
    git(tmp_path, "init", "--quiet", str(root))
    git(root, "add", "-A")
    git(root, "commit", "--quiet", "-m", "base")
    git(root, "am", "--quiet", str(patch.path))
    return root


class TestRefresh:
    def test_round_trip(self, megatron_lm):
        """The commit becomes the mailbox again: same message, author, date, DEP-3 block and changed lines."""
        old = PATCHES["main"]
        text = build(megatron_lm_checkout(megatron_lm), "HEAD", old)
        new = load(old.path, text)
        assert (new.headers, new.body, _changed_lines(new)) == (old.headers, old.body, _changed_lines(old))
        assert new.metadata == old.metadata | {"Last-Update": datetime.date.today().isoformat()}  # its blobs differ
        assert f"diff --git a/{SOURCE} b/{SOURCE}" in text and "Signed-off-by" not in text
        assert build(megatron_lm_checkout(megatron_lm), "HEAD", load(old.path, text)) == text  # byte-stable


class TestRefusals:
    def test_gate_refuses_what_is_no_megatron_lm_repository(self, maintain, refused, tmp_path):
        refused(maintain("gate", "--megatron-lm", tmp_path, "--checkouts-only"), 2, "not a Megatron-LM git repository")

    def test_refresh_refuses_a_megatron_bridge_checkout_for_a_megatron_lm_patch(self, maintain, refused, checkout):
        patch = MEGATRON_LM_PATCHES / "main.patch"
        line = refused(maintain("refresh", "--upstream", checkout.root, "--patch", patch, "--no-verify"), 2)
        assert "not a Megatron-LM git repository" in line


def test_gate_holds_every_megatron_lm_patch_on_core_s_own_tests(upstream_checkout, tool_env):
    """Red/green on each base-commit and on megatron-core 0.19.2, with the Megatron-LM clone of an upstream checkout
    that holds those commits (about half an hour on 2 cores)."""
    clone = upstream_checkout / "3rdparty" / "Megatron-LM"
    held = [
        subprocess.run(["git", "-C", clone, "cat-file", "-e", f"{p.base_commit}^{{commit}}"]) for p in PATCHES.values()
    ]
    if any(done.returncode for done in held):
        pytest.skip(f"{clone} does not hold every base-commit of patches/megatron-lm: fetch them there")
    gate = [sys.executable, "-m", "maintain.gate", "--megatron-lm", clone, "--checkouts-only"]
    result = subprocess.run(gate, cwd=REPO, env=tool_env, capture_output=True, text=True)
    rows = [line for line in result.stdout.splitlines() if line.startswith(("Megatron-LM ", "megatron-core "))]
    assert result.returncode == 0 and len(rows) == 4 and all(row.endswith("PASS") for row in rows), result.stdout
