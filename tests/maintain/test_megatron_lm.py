"""The Megatron-LM patches through the same machinery as Megatron-Bridge's: read with their sources under src/, judged
by the rules of their upstream, rewritten by refresh from a commit, and (with an upstream checkout whose Megatron-LM
submodule holds their base-commits) held to red/green on core's own test file by `./run gate --megatron-lm`, and
that test, on two ranks, to telling the fix from plausible wrong ones as tests/test_wrong_fixes.py does."""

import datetime
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from maintain.gate import Row, at, judge, touched_tests
from maintain.redgreen.client import Job, read_run
from maintain.redgreen.contract import PYTEST, Outcome, Run
from maintain.refresh import build
from maintain.repo import REPO, WORK, megatron_lm_checkout
from maintain.trees import materialise
from maintain.upstreams import BRIDGE, MEGATRON_LM, MEGATRON_LM_PATCHES, base_commit, load, patched_tests, upstream_of
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.targets import Kind, Target
from tests.test_wrong_fixes import variant_jobs


pytestmark = pytest.mark.slow

PATCHES = {path.stem: load(path) for path in sorted(MEGATRON_LM_PATCHES.glob("*.patch"))}
SOURCE = "megatron/core/transformer/multi_token_prediction.py"
TEST_FILE = "tests/unit_tests/transformer/test_multi_token_prediction.py"


def _changed_lines(patch: Patch) -> list[tuple[str, str]]:
    return [(x.line_type, x.value) for f in patch.files for hunk in f for x in hunk if x.is_added or x.is_removed]


class TestTheirPatches:
    def test_one_per_branch_each_on_the_commit_it_names(self):
        assert set(PATCHES) == {"main", "dev", "core_r0.19.0"}
        assert all(re.fullmatch(r"[0-9a-f]{40}", base_commit(patch)) for patch in PATCHES.values())
        assert len({base_commit(patch) for patch in PATCHES.values()}) == 3

    @pytest.mark.parametrize("name", ["main", "dev", "core_r0.19.0"])
    def test_read_with_their_sources_under_src_and_their_own_text(self, name):
        patch = PATCHES[name]
        assert patch.paths() == [f"src/{SOURCE}", TEST_FILE] and patched_tests(patch) == [TEST_FILE]
        assert patch.text == (MEGATRON_LM_PATCHES / f"{name}.patch").read_text()
        assert f"diff --git a/{SOURCE} b/{SOURCE}" in patch.text and "src/megatron" not in patch.text
        assert upstream_of(patch) == MEGATRON_LM and upstream_of(load()) == BRIDGE

    def test_every_branch_gets_the_same_test(self):
        """The hunk that adds it; their imports differ."""
        added = {
            name: [line.value for file in p.files if file.path == TEST_FILE for line in file[-1] if line.is_added]
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


class TestApplies:
    """`./run refresh --applies`: a line per mailbox on its branch's tip, naming each hunk that no longer applies."""

    def test_a_line_per_mailbox_and_the_hunk_that_drifted(self, maintain, megatron_lm, git):
        git(megatron_lm, "branch", "main", "HEAD~1")  # the base, as main.patch's context reads it
        done = maintain("refresh", "--applies", "--upstream", megatron_lm)
        tip = git(megatron_lm, "rev-parse", "main").strip()[:10]
        assert done.returncode == 4 and done.stderr == "", done.stderr
        callers, *core = done.stdout.splitlines()
        assert core == [
            f"core_r0.19.0.patch: no origin/core_r0.19.0 nor core_r0.19.0 in {megatron_lm}",
            f"dev.patch: no origin/dev nor dev in {megatron_lm}",
            f"main.patch on main {tip}: applies",
        ]
        # The stand-in holds only core's files: every hunk of the callers' change is named as not applying.
        assert callers.startswith(f"callers/main.patch on main {tip}: does not apply: hunk 1/1 of examples/"), callers
        test_file = megatron_lm / TEST_FILE
        git(megatron_lm, "switch", "--quiet", "main")
        test_file.write_text(test_file.read_text().replace("    get_tensor_model_parallel_group,\n", "", 1))
        git(megatron_lm, "commit", "--quiet", "-am", "imports move")
        line = maintain("refresh", "--applies", "--upstream", megatron_lm).stdout.splitlines()[-1]
        hunk = str(PATCHES["main"].files[1][0]).splitlines()[0]
        assert line.endswith(f": does not apply: hunk 1/2 of {TEST_FILE} ({hunk})"), line


NCCL_CASES = """
import os

import torch


def test_a_cpu_collective_on_the_default_group():
    torch.distributed.all_reduce(torch.ones(1))


def test_a_cpu_collective_on_a_gloo_group():
    torch.distributed.all_reduce(torch.ones(1), group=torch.distributed.new_group(backend="gloo"))


def test_two_ranks():
    assert torch.distributed.get_world_size() == 2


def test_failing_on_rank_1_only():
    assert os.environ["RANK"] == "0"
"""


def test_nccl_ranks_refuse_cpu_collectives_as_nccl_does_and_rank_0_speaks_for_all(tmp_path, tool_env):
    """The CPU plugin's `--nccl-ranks 2`, which gate's second row per branch uses: rank 0's record is every rank's."""
    (tmp_path / "test_cases.py").write_text(NCCL_CASES)
    session = [sys.executable, "-m", "pytest", *PYTEST, "-p", "core_unit_tests_cpu", "--nccl-ranks=2"]
    done = subprocess.run(
        [*session, f"--outcomes={tmp_path / 'outcomes'}", "test_cases.py"], cwd=tmp_path, env=tool_env, timeout=600
    )
    outcomes = {name.split("::")[-1]: outcome for name, outcome in read_run(tmp_path / "outcomes").outcomes.items()}
    assert done.returncode == 1 and outcomes == {
        "test_a_cpu_collective_on_the_default_group": Outcome.OTHER_FAILURE,
        "test_a_cpu_collective_on_a_gloo_group": Outcome.PASSED,
        "test_two_ranks": Outcome.PASSED,
        "test_failing_on_rank_1_only": Outcome.ASSERTION,
    }


class TestRefusals:
    def test_gate_refuses_what_is_no_megatron_lm_repository(self, maintain, refused, tmp_path):
        refused(maintain("gate", "--megatron-lm", tmp_path, "--checkouts-only"), 2, "not a Megatron-LM git repository")

    def test_refresh_refuses_a_megatron_bridge_checkout_for_a_megatron_lm_patch(self, maintain, refused, checkout):
        patch = MEGATRON_LM_PATCHES / "main.patch"
        line = refused(maintain("refresh", "--upstream", checkout.root, "--patch", patch, "--no-verify"), 2)
        assert "not a Megatron-LM git repository" in line


@pytest.fixture(scope="module")
def megatron_lm_clone(upstream_checkout) -> Path:
    """The Megatron-LM clone of an upstream checkout, if it holds every base-commit of patches/megatron-lm."""
    clone = upstream_checkout / "3rdparty" / "Megatron-LM"
    held = [
        subprocess.run(["git", "-C", clone, "cat-file", "-e", f"{base_commit(p)}^{{commit}}"])
        for p in PATCHES.values()
    ]
    if any(done.returncode for done in held):
        pytest.skip(f"{clone} does not hold every base-commit of patches/megatron-lm: fetch them there")
    return clone


def test_gate_holds_every_megatron_lm_patch_on_core_s_own_tests(megatron_lm_clone, tool_env):
    """Red/green on each base-commit (its new tests once more on two ranks as NCCL) and on megatron-core 0.19.2, with
    the Megatron-LM clone of an upstream checkout that holds those commits (about half an hour on 2 cores)."""
    gate = [sys.executable, "-m", "maintain.gate", "--megatron-lm", megatron_lm_clone, "--checkouts-only"]
    result = subprocess.run(gate, cwd=REPO, env=tool_env, capture_output=True, text=True)
    rows = [line for line in result.stdout.splitlines() if line.startswith(("Megatron-LM ", "megatron-core "))]
    assert result.returncode == 0 and len(rows) == 7 and all(row.endswith("PASS") for row in rows), result.stdout


# Lines of the fix's helper as the patches add it, the same on every branch. Each edit is a regex that must match once.
GUARD = '    if is_training and torch.distributed.is_initialized() and "warned_no_loss_mask" not in tracker:\n'
LOG = "        log_on_each_pipeline_stage(\n            logger,\n"
LEVEL = "            logging.WARNING,\n"
FLAG = '        tracker["warned_no_loss_mask"] = True\n'
MESSAGE = '"MTP loss without a loss_mask: it falls back to all ones, so the MTP loss and its "\n'
STACKLEVEL = "            stacklevel=2,\n"
MESSAGE_END = '"language-model loss, aligned with labels (with input_ids when labels is None).",\n'
CORE_WRONG_FIXES = {
    "a warning on every call": [(re.escape(FLAG), "")],
    "a warning with a given loss_mask too": [
        (
            re.escape("    hidden_states = hidden_states_list[0]\n"),
            "    hidden_states = hidden_states_list[0]\n    _all_ones_mtp_loss_mask(hidden_states, is_training)\n",
        )
    ],
    "a warning in eval too": [(re.escape(GUARD), GUARD.replace("is_training and ", ""))],
    "a warning whenever gradients are on, eval too": [
        (re.escape(GUARD), GUARD.replace("is_training", "torch.is_grad_enabled()"))
    ],
    "silent when MTP derives the labels from input_ids": [
        (
            r"_all_ones_mtp_loss_mask\((?:mtp_labels|input_ids), is_training\)",
            "(torch.ones_like(input_ids) if derived_labels_from_input_ids"
            " else _all_ones_mtp_loss_mask(labels, is_training))",
        )
    ],
    "logged at INFO": [(re.escape(LEVEL), LEVEL.replace("WARNING", "INFO"))],
    "its record naming utils.py (no stacklevel)": [(re.escape(MESSAGE_END + STACKLEVEL), MESSAGE_END)],
    "logged on every rank": [(re.escape(LOG), "        logger.log(\n")],
    "logged on global rank 0 only (log_single_rank)": [
        (re.escape(LOG), LOG.replace("log_on_each_pipeline_stage", "log_single_rank")),
        (re.escape("    log_on_each_pipeline_stage,\n"), "    log_on_each_pipeline_stage,\n    log_single_rank,\n"),
    ],
}
CORE_CORRECT_REWRITES = {
    "another wording": [
        (re.escape(MESSAGE), '"process_mtp_loss got no loss_mask and uses all ones: the MTP loss and its "\n')
    ],
    "the stage's first rank found by hand": [
        (
            re.escape(LOG + LEVEL),
            "        if (\n"
            "            parallel_state.get_tensor_model_parallel_rank() == 0\n"
            "            and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0\n"
            "        ):\n"
            "            logger.warning(\n",
        )
    ],
    "the stage's groups passed": [
        (
            re.escape(MESSAGE_END),
            MESSAGE_END
            + "            tp_group=parallel_state.get_tensor_model_parallel_group(),\n"
            + "            dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True),\n",
        )
    ],
}
# The helper is the same on every branch, so only a rewrite of where it is called can differ between them: dev calls it
# from two fallbacks, main from one. dev is held to those rewrites alone, each session being minutes on 2 cores.
BRANCH_VARIANTS = {
    "main": CORE_WRONG_FIXES | CORE_CORRECT_REWRITES,
    "dev": {name: CORE_WRONG_FIXES[name] for name in ["silent when MTP derives the labels from input_ids"]},
}
RANKS = 2  # enough for the cases that need more than one (TP, CP or PP 2) and for a rank that must stay silent


def _on_ranks(job: Job) -> list[Run]:
    """`job`'s session on RANKS ranks, each started with the variables torchrun gives core's unit tests."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = str(probe.getsockname()[1])
    own = os.path.abspath(job.tree / (job.module.replace(".", "/") + ".py"))
    with tempfile.TemporaryDirectory() as tmp:
        # Collectives refuse CPU tensors as upstream's NCCL does (ranks launched here: no outcomes exchanged).
        as_nccl = f"--nccl-ranks={RANKS}"
        session = [sys.executable, "-m", "pytest", *PYTEST, "-o", f"pythonpath={job.tree}", *job.args, as_nccl]
        env = dict(os.environ, PYTHONPATH=str(REPO), WORLD_SIZE=str(RANKS), MASTER_ADDR="localhost", MASTER_PORT=port)
        ranks = []
        try:
            for rank in range(RANKS):
                variables = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
                session_of_rank = [*session, f"--outcomes={tmp}/{rank}", f"--outcomes-module={job.module}"]
                with open(f"{tmp}/{rank}.log", "w") as log:
                    ranks.append(subprocess.Popen(session_of_rank, cwd=job.cwd, env=variables, stdout=log, stderr=log))
            for process in ranks:
                process.wait()
        finally:  # a rank left waiting for its peer at a collective would wait for gloo's timeout
            for process in ranks:
                process.kill()
        runs = [read_run(Path(tmp, str(rank))) for rank in range(RANKS)]
        logs = [Path(tmp, f"{rank}.log").read_text()[-2000:] for rank in range(RANKS)]
    assert all(run.outcomes for run in runs), f"a rank recorded nothing: {logs}"
    assert all(run.module_files == {own} for run in runs), [run.module_files for run in runs]
    return runs


VARIANT_RUNS = {}


def _variant_runs(clone: Path, branch: str) -> dict[str, dict[str, set[Outcome]]]:
    """Per variant of the branch's fix, and "carried": each of its tests' outcomes over the ranks."""
    if branch not in VARIANT_RUNS:
        patch = PATCHES[branch]
        root = at(Target("Megatron-LM", clone, Kind.CHECKOUT), base_commit(patch), MEGATRON_LM).root
        work = WORK / "megatron-lm-variants" / branch
        carried = materialise(root, work / "carried", patch, strip=1)
        tests = sorted(touched_tests(patched_tests(patch), root, carried))
        job = Job((*tests, *MEGATRON_LM.options), carried / "src", carried, MEGATRON_LM.module)
        variants = BRANCH_VARIANTS[branch]
        jobs = variant_jobs(carried, f"src/{SOURCE}", job, work, variants)
        runs = [_on_ranks(job) for job in jobs]
        VARIANT_RUNS[branch] = {
            name: {n: {run.of(n) for run in ranks} for n in ranks[0].outcomes}
            for name, ranks in zip([*variants, "carried"], runs)
        }
    return VARIANT_RUNS[branch]


class TestCoreWrongFixes:
    """Core's own test, on RANKS ranks, tells the fix from plausible wrong ones and from correct ones written another
    way (about 10 sessions of 2 ranks: half an hour on 2 cores, longer under load)."""

    @pytest.mark.parametrize("branch", BRANCH_VARIANTS)
    def test_the_carried_fix_passes_every_case_on_every_rank(self, megatron_lm_clone, branch):
        carried = _variant_runs(megatron_lm_clone, branch)["carried"]
        assert carried and all(outcomes == {Outcome.PASSED} for outcomes in carried.values()), carried

    @pytest.mark.parametrize(
        "branch, name", [(b, n) for b, names in BRANCH_VARIANTS.items() for n in names if n in CORE_WRONG_FIXES]
    )
    def test_wrong_fix_is_caught(self, megatron_lm_clone, branch, name):
        variant = _variant_runs(megatron_lm_clone, branch)[name]
        # By assertion only: a rank that fails otherwise (a timeout, say) leaves its peer's cases out of step.
        assert [n for n, outcomes in variant.items() if Outcome.ASSERTION in outcomes], f"no case notices: {name}"

    @pytest.mark.parametrize(
        "branch, name", [(b, n) for b, names in BRANCH_VARIANTS.items() for n in names if n in CORE_CORRECT_REWRITES]
    )
    def test_correct_rewrite_passes(self, megatron_lm_clone, branch, name):
        runs = _variant_runs(megatron_lm_clone, branch)
        assert runs[name] == runs["carried"], name
