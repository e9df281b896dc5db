"""The suite's own red/green proof: every regression test fails by assertion on the pinned release as shipped and
passes on the view (release + patch); tests/red_green.toml lists them all.

Each side is a pytest session with its tree first on the import path, forked from one warm process.
"""

from collections import Counter, defaultdict

import pytest

from mtp_mask_fix.patch import REPO, VIEW
from mtp_mask_fix.redgreen import Job, Manifest, problems, run_many
from mtp_mask_fix.targets import pins, release


SUITES = {"unit": "tests/unit_tests", "functional": "tests/functional"}
BASE = release(pins()["megatron-bridge"]).root


@pytest.fixture(scope="module")
def manifest():
    return Manifest.load()


@pytest.fixture(scope="module")
def runs():
    """The unit and functional suites, whole, once on the base and once on the view."""
    base, patched = run_many([Job(tuple(SUITES.values()), BASE), Job(tuple(SUITES.values()), VIEW)])
    return {"base": base, "patched": patched}


def _report(runs, nodeids, title) -> str:
    """One line per test function: how its cases ended on the base and patched."""
    cases = defaultdict(list)
    for nodeid in nodeids:
        cases[nodeid.split("[")[0]].append(nodeid)
    lines = [f"{title}: base = {BASE.relative_to(REPO)} (pinned release), patched = {VIEW.relative_to(REPO)} (view)"]
    for name, ids in cases.items():
        sides = []
        for side in ("base", "patched"):
            counts = Counter(runs[side].of(nodeid).value for nodeid in ids)
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

    def test_each_side_ran_its_own_tree(self, runs):
        assert {f.removeprefix(str(BASE)) for f in runs["base"].gpt_step_files} == {
            "/megatron/bridge/training/gpt_step.py"
        }
        assert {f.removeprefix(str(VIEW)) for f in runs["patched"].gpt_step_files} == {
            "/megatron/bridge/training/gpt_step.py"
        }

    def test_manifest_lists_every_test_exactly_once(self, runs, manifest):
        listed = [nodeid for suite in SUITES for nodeid in manifest.fail_to_pass[suite] + manifest.pass_to_pass[suite]]
        assert len(listed) == len(set(listed))
        assert set(listed) == set(runs["patched"].outcomes)
