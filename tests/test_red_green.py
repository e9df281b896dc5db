"""The suite's own red/green proof: every regression test fails by assertion on the unpatched base and passes
on the generated view (base + patch); tests/red_green.toml lists them all.

Both sides run in fresh pytest processes, because each selects its gpt_step.py before importing Bridge.
"""

from collections import Counter, defaultdict

import pytest

from mtp_mask_fix.patch import BASE_FILE, REPO, VIEW
from mtp_mask_fix.redgreen import Manifest, problems, run_pytest


SUITES = {"unit": "tests/unit_tests", "functional": "tests/functional"}


@pytest.fixture(scope="module")
def manifest():
    return Manifest.load()


@pytest.fixture(scope="module")
def runs():
    """The upstream-bound and functional suites, whole, once on the base and once on the view."""
    assert BASE_FILE.is_file() and VIEW.is_file(), "run ./run setup first"
    dirs = list(SUITES.values())
    return {
        "base": run_pytest(dirs, env={"MTP_FIX_GPT_STEP": str(BASE_FILE)}),
        "patched": run_pytest(dirs, env={"MTP_FIX_GPT_STEP": str(VIEW)}),
    }


def _report(runs, nodeids, title) -> str:
    """One line per test function: how its cases ended on the base and patched."""
    cases = defaultdict(list)
    for nodeid in nodeids:
        cases[nodeid.split("[")[0]].append(nodeid)
    lines = [f"{title}: base = {BASE_FILE.relative_to(REPO)} (pinned release), patched = {VIEW.relative_to(REPO)}"]
    for name, ids in cases.items():
        sides = []
        for side in ("base", "patched"):
            counts = Counter(runs[side].outcomes.get(nodeid, "missing") for nodeid in ids)
            sides.append(f"{side}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
        lines.append(f"  {name.split('::', 1)[1]:<95} {'  '.join(sides)}")
    return "\n".join(lines)


class TestRedGreen:
    @pytest.mark.parametrize("suite", SUITES)
    def test_fail_to_pass_red_on_base_by_assertion_and_green_patched(self, runs, manifest, suite, capsys):
        assert manifest.fail_to_pass[suite], f"no FAIL_TO_PASS tests listed for {suite}"
        with capsys.disabled():  # the proof belongs in CI's log
            print("\n" + _report(runs, manifest.fail_to_pass[suite], f"FAIL_TO_PASS, {SUITES[suite]}"))
        assert problems(runs["base"], runs["patched"], manifest.fail_to_pass[suite], []) == []

    @pytest.mark.parametrize("suite", SUITES)
    def test_pass_to_pass_green_on_both(self, runs, manifest, suite):
        assert problems(runs["base"], runs["patched"], [], manifest.pass_to_pass[suite]) == []

    def test_each_side_ran_the_gpt_step_it_names(self, runs):
        assert runs["base"].gpt_step_files == {str(BASE_FILE)}
        assert runs["patched"].gpt_step_files == {str(VIEW)}

    def test_manifest_lists_every_test_exactly_once(self, runs, manifest):
        listed = [nodeid for suite in SUITES for nodeid in manifest.fail_to_pass[suite] + manifest.pass_to_pass[suite]]
        assert len(listed) == len(set(listed))
        assert set(runs["patched"].outcomes) == set(listed)
