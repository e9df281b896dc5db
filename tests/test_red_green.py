"""The suite's own red/green proof: every test marked `fail_to_pass` fails by assertion on the pinned release as
shipped and passes on the view (release + patch); every other test passes on both.

The view's side is what this session itself measured (tests/conftest.py records every outcome; these checks run
last); a suite this session did not run is run on the view here. The base's side is a pytest session with the
release first on the import path, forked from one warm process.
"""

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from maintain.redgreen.client import Job, read_run, run_many
from maintain.redgreen.contract import Run, problems
from maintain.repo import REPO, VIEW, WORK, pins, release
from maintain.trees import materialise
from mtp_mask_fix.paths import PACKAGE, is_gpt_step_of
from tests.support import sessions


SUITES = {"unit": "tests/unit_tests", "functional": "tests/functional"}


def _this_session(config, suite_dir: str) -> Run:
    """What this session recorded for the tests under suite_dir (an empty Run if it ran none)."""
    return read_run(Path(config.getoption("outcomes")), suite_dir + "/")


EARLY = {}


def _tier(config) -> tuple[str, ...]:
    """The tier this session runs, as a red/green session's arguments."""
    return ("--all",) if config.getoption("--all") else ()


def _base_job(config) -> Job:
    return Job((*SUITES.values(), *_tier(config)), release(pins()["megatron-bridge"]).root)


BRIDGE_SESSION = "tests/support/bridge_session.py"
INIT = f"{PACKAGE}/__init__.py"


def _bridge_jobs() -> list[Job]:
    """Two trees of the release: one of links only, one whose megatron/bridge/__init__.py differs (it sets a mark)."""
    base, work = release(pins()["megatron-bridge"]).root, WORK / "runner"
    changed = {INIT: (base / INIT).read_text() + "\nMTP_FIX_MARK = True\n"}
    trees = [materialise(base, work / "linked"), materialise(base, work / "changed", rewrite=changed)]
    return [Job((BRIDGE_SESSION,), tree) for tree in trees]


def start_early(session) -> None:
    """The base's session, then the runner's two where the session runs TestRunner, queued by tests/conftest.py once
    (tests/support/sessions.py: one warm runner for them and the wrong-fix variants; the first job's tree is the one
    whose megatron.bridge the runner imports before it forks)."""
    EARLY["base"] = sessions.BATCH.add([_base_job(session.config)])
    if any(item.cls is TestRunner for item in session.items):
        EARLY["bridge"] = sessions.BATCH.add(_bridge_jobs())


@pytest.fixture(scope="module")
def base_tree() -> Path:
    return release(pins()["megatron-bridge"]).root


@pytest.fixture(scope="module")
def runs(base_tree, pytestconfig):
    """Per suite: the base's run, and the view's (this session's, or run here if this session did not run it)."""
    patched = {suite: _this_session(pytestconfig, path) for suite, path in SUITES.items()}
    missing = [suite for suite, run in patched.items() if not run.outcomes]
    views = run_many([Job((SUITES[suite], *_tier(pytestconfig)), VIEW) for suite in missing]) if missing else []
    base = (EARLY["base"]() if "base" in EARLY else run_many([_base_job(pytestconfig)]))[0]
    patched |= dict(zip(missing, views))
    return {suite: {"base": base, "patched": patched[suite], "ids": list(patched[suite].outcomes)} for suite in SUITES}


def _report(side_runs, nodeids, title, base_tree) -> str:
    """One line per test function: how its cases ended on the base and patched."""
    cases = defaultdict(list)
    for nodeid in nodeids:
        cases[nodeid.split("[")[0]].append(nodeid)
    lines = [f"{title}: base = {base_tree.relative_to(REPO)} (pinned release), patched = {VIEW.relative_to(REPO)}"]
    for name, ids in cases.items():
        sides = []
        for side in ("base", "patched"):
            counts = Counter(side_runs[side].of(nodeid).value for nodeid in ids)
            sides.append(f"{side}: " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
        lines.append(f"  {name.split('::', 1)[1]:<95} {'  '.join(sides)}")
    return "\n".join(lines)


class TestRedGreen:
    @pytest.mark.parametrize("suite", SUITES)
    def test_fail_to_pass_red_on_base_by_assertion_and_green_patched(self, runs, suite, base_tree, capsys):
        fail_to_pass = [n for n in runs[suite]["patched"].outcomes if n in runs[suite]["patched"].marked]
        assert fail_to_pass, f"no test of {SUITES[suite]} is marked fail_to_pass"
        with capsys.disabled():  # the proof belongs in CI's log
            print("\n" + _report(runs[suite], fail_to_pass, f"FAIL_TO_PASS, {SUITES[suite]}", base_tree))
        assert problems(runs[suite]["base"], runs[suite]["patched"], fail_to_pass, []) == []

    @pytest.mark.parametrize("suite", SUITES)
    def test_pass_to_pass_green_on_both(self, runs, suite):
        pass_to_pass = [n for n in runs[suite]["patched"].outcomes if n not in runs[suite]["patched"].marked]
        assert problems(runs[suite]["base"], runs[suite]["patched"], [], pass_to_pass) == []

    @pytest.mark.parametrize("suite", SUITES)
    def test_each_side_ran_its_own_tree(self, runs, suite, base_tree):
        for side, tree in (("base", base_tree), ("patched", VIEW)):
            files = runs[suite][side].module_files
            assert files and all(is_gpt_step_of(f, tree) for f in files), f"{side} imported {files}"


@pytest.fixture(scope="module")
def bridge_found():
    """What each of the runner's two sessions recorded of megatron.bridge."""
    if "bridge" in EARLY:
        linked, changed = EARLY["bridge"]()
    else:  # a runner of their own, warmed from the release as the suite's batch is (its first job: the base)
        warm = Job((BRIDGE_SESSION,), release(pins()["megatron-bridge"]).root)
        linked, changed = run_many([warm, *_bridge_jobs()])[1:]
    return {
        name: json.loads(run.reasons[f"{BRIDGE_SESSION}::test_record_megatron_bridge"])
        for name, run in (("linked", linked), ("changed", changed))
    }


@pytest.mark.slow  # a tree whose megatron.bridge differs imports it again: about 20 CPU-s
class TestRunner:
    """The runner imports megatron.bridge once from the first session's tree; each session must still run its own."""

    def test_a_tree_of_links_keeps_the_warm_import_searched_in_itself(self, bridge_found):
        base = release(pins()["megatron-bridge"]).root
        assert bridge_found["linked"]["file"] == str(base / INIT)  # imported before the fork, not again
        assert bridge_found["linked"]["path"] == [str(WORK / "runner" / "linked" / PACKAGE)]
        assert not bridge_found["linked"]["marked"]

    def test_a_tree_whose_megatron_bridge_differs_imports_its_own(self, bridge_found):
        assert bridge_found["changed"]["file"] == str(WORK / "runner" / "changed" / INIT)
        assert bridge_found["changed"]["marked"]
