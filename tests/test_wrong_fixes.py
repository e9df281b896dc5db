"""The tests must be tight and fair: every plausible wrong fix turns at least one of them red, and every correct fix
written another way keeps all of them green.

Two test sets are held to it, each on its own:
- this repo's regression gate (tests/unit_tests);
- the upstream-bound tests: what the patch adds to upstream's test_gpt_step.py. Once upstream merges and the patch
  retires, they are all that is left. In every run they run over stand-ins for that file's helpers
  (tests/support/upstream_helpers.py), next to tests/unit_tests on copies of the view; in `--all` with
  `--upstream-checkout DIR` and `--upstream-python $(./run python DIR)` (by default this interpreter), also inside
  upstream's real file on patched copies of the base-commit (or `--upstream-rev`, v0.6.0 say).
  The upstream-bound tests need not catch the wrong fixes in UPSTREAM_BLIND: nothing upstream gives a reason to fear
  them, so they are the fork's unit tests' alone.

Tests of the tests, so in `--all` only. Each variant rewrites the fix (a regex edit that must match exactly once) and runs the tests with that tree first on
the import path; all sessions are forked from one warm process. Each session also runs `verify`'s behaviour probe
(tests/support/probe_session.py), whose verdict per variant is pinned here apart from both test sets.
"""

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from maintain.gate import checkout_row
from maintain.redgreen.client import Job, run_many
from maintain.redgreen.contract import Outcome
from maintain.repo import FIXED_FILE, UPSTREAM_TEST, VIEW, WORK, checkout
from maintain.trees import materialise
from maintain.upstreams import base_commit, load
from mtp_mask_fix.paths import GPT_STEP
from tests.support import sessions


pytestmark = pytest.mark.slow


GATE = r"    if use_mtp:\n"
FIX = r'forward_args\["loss_mask"\] = loss_mask\n'
BLOCK = GATE + r"(?:        #.*\n)*        " + FIX  # the fix with whatever comment it carries
CALL = r"output_tensor = model\(\*\*forward_args\)\n"
PLAN = r", loss_mask=loss_mask(?=\n)|\n +loss_mask=loss_mask,(?=\n)"  # in build_schedule_plan's call (0.6 | main)
MASK = 'forward_args["loss_mask"] = None if loss_mask is None else '
WRONG_FIXES = {
    "reverted": [(BLOCK, "")],
    "another kwarg name": [(FIX, 'forward_args["mtp_loss_mask"] = loss_mask\n')],
    "a shifted mask": [(FIX, MASK + "loss_mask.roll(-1, -1)\n")],
    "an all-ones mask": [(FIX, MASK + "torch.ones_like(loss_mask)\n")],
    "the positions reversed": [(FIX, MASK + "loss_mask.flip(-1)\n")],
    "the samples reversed": [(FIX, MASK + "loss_mask.flip(0)\n")],
    "the first sample's mask for every sample": [(FIX, MASK + "loss_mask[:1].expand_as(loss_mask)\n")],
    "labels as the mask": [(FIX, 'forward_args["loss_mask"] = labels\n')],
    "the attention mask as the mask": [(FIX, 'forward_args["loss_mask"] = attention_mask\n')],
    "the schedule-plan path loses it": [(PLAN, "")],
    "only packed batches": [(GATE, "    if use_mtp and packed_seq_metadata is not None:\n")],
    "only dense batches": [(GATE, "    if use_mtp and packed_seq_metadata is None:\n")],
    "only in training mode": [(GATE, '    if use_mtp and getattr(model, "training", True):\n')],
    "only with gradients on": [(GATE, "    if use_mtp and torch.is_grad_enabled():\n")],
    "only gpt_step's own get_batch (not deepseek_v4_step)": [(GATE, "    if use_mtp and _get_batch_fn is None:\n")],
    "passed to every model, one without loss_mask too (#6105)": [(GATE, "    if True:\n")],
}
# Wrong fixes that only the fork's unit tests must catch: nothing in _forward_step_common reads grad mode or
# model.training, and get_batch is its default batch function, so upstream has no reason to test for them.
UPSTREAM_BLIND = {
    "only in training mode",
    "only with gradients on",
    "only gpt_step's own get_batch (not deepseek_v4_step)",
}
UPSTREAM_BOUND = [name for name in WRONG_FIXES if name not in UPSTREAM_BLIND]
CORRECT_REWRITES = {
    "a copy of the mask": [(FIX, MASK + "loss_mask.clone()\n")],
    "only when a mask exists": [(GATE, "    if use_mtp and loss_mask is not None:\n")],
    "mtp_num_layers read again": [(GATE, '    if getattr(config, "mtp_num_layers", None):\n')],
    "a keyword of the model call": [
        (BLOCK, ""),
        (CALL, 'output_tensor = model(**forward_args, **({"loss_mask": loss_mask} if use_mtp else {}))\n'),
    ],
    "an entry of the forward_args literal": [
        (BLOCK, ""),
        (
            r'"labels": labels,\n    }\n',
            '"labels": labels,\n        **({"loss_mask": loss_mask} if use_mtp else {}),\n    }\n',
        ),
    ],
}
VARIANTS = {**WRONG_FIXES, **CORRECT_REWRITES}
RED = (Outcome.ASSERTION, Outcome.OTHER_FAILURE)
# The wrong fixes verify's probe judges delivered, by design: its one forward_step call is dense, with gradients on, to
# a plain function (no `training`), through gpt_step's own get_batch and not the schedule plan; and #6105's
# unconditional kwarg does hand the batch's mask to a model with MTP on (what it breaks is a model without MTP).
PROBE_BLIND = {
    "the schedule-plan path loses it",
    "only dense batches",
    "only in training mode",
    "only with gradients on",
    "only gpt_step's own get_batch (not deepseek_v4_step)",
    "passed to every model, one without loss_mask too (#6105)",
}
PROBE_FILE = "tests/support/probe_session.py"
PROBE = f"{PROBE_FILE}::test_verify_probe_finds_the_batchs_loss_mask"


def rewrite(text: str, edits: list[tuple[str, str]], where: str) -> str:
    """The file with each edit made; an edit that does not match exactly once is a stale variant, not a pass."""
    for pattern, new in edits:
        text, count = re.subn(pattern, lambda _: new, text)
        assert count == 1, f"{where} holds {pattern!r} {count} times, not once"
    return text


def variant_jobs(base: Path, path: str, job: Job, work: Path, variants: dict = VARIANTS) -> list[Job]:
    """One session per variant: `job`'s session on a copy of `base` whose `path` has the variant's rewrite; then
    `job` itself ("carried": the fix as carried), so that every variant is held to the tests the fix runs."""
    text, jobs = (base / path).read_text(), []
    for index, edits in enumerate(variants.values()):
        tree = materialise(base, work / str(index), rewrite={path: rewrite(text, edits, str(base / path))})
        where = {"tree": tree / job.tree.relative_to(base), "cwd": tree if job.cwd == base else job.cwd}
        jobs.append(dataclasses.replace(job, **where))
    return [*jobs, job]


def by_variant(runs: list) -> dict:
    """variant_jobs' runs by variant name, and "carried"."""
    *variants, carried = runs
    return dict(zip(VARIANTS, variants)) | {"carried": carried}


def run_variants(base: Path, path: str, job: Job, work: Path, python: str = sys.executable) -> dict:
    return by_variant(run_many(variant_jobs(base, path, job, work), python))


ADDED = WORK / "upstream-bound" / "test_gpt_step_added.py"


def _upstream_bound_tests() -> Path:
    """The tests the patch adds to upstream's test_gpt_step.py, as a module over tests/support/upstream_helpers (the
    stand-ins for that file's helpers): in push CI they run without an upstream checkout."""
    (tests,) = [file for file in load().files if file.path == UPSTREAM_TEST]
    added = "".join(line.value for hunk in tests for line in hunk if line.is_added)
    ADDED.parent.mkdir(parents=True, exist_ok=True)
    ADDED.write_text(f"from tests.support.upstream_helpers import *  # noqa: F403\n\n\nclass TestGetBatch:\n{added}")
    return ADDED


def _variant_jobs() -> list[Job]:
    job = Job(("tests/unit_tests", str(_upstream_bound_tests()), PROBE_FILE), VIEW)
    return variant_jobs(VIEW, GPT_STEP, job, WORK / "variants")


EARLY = {}


def start_early(session) -> None:
    """The variants' sessions, queued by tests/conftest.py once the suite is collected (tests/support/sessions.py:
    one warm runner for them and red/green's base session)."""
    EARLY["runs"] = sessions.BATCH.add(_variant_jobs())


@pytest.fixture(scope="module")
def runs():
    """tests/unit_tests and the upstream-bound tests once per variant, each against a copy of the view with its
    rewrite, and once on the view."""
    return by_variant(EARLY["runs"]() if "runs" in EARLY else run_many(_variant_jobs()))


def _suites(run) -> dict[str, dict]:
    """A run's outcomes split into the fork's unit tests and the upstream-bound ones; the probe is neither."""
    unit = {n: o for n, o in run.outcomes.items() if n.startswith("tests/unit_tests/")}
    upstream = {n: o for n, o in run.outcomes.items() if n not in unit and not n.startswith(f"{PROBE_FILE}::")}
    return {"tests/unit_tests": unit, "upstream": upstream}


class TestWrongFixesTurnRed:
    def test_the_upstream_blind_spots_are_wrong_fixes(self):
        assert UPSTREAM_BLIND <= WRONG_FIXES.keys()

    @pytest.mark.parametrize(
        "name, suite",
        [(name, "tests/unit_tests") for name in WRONG_FIXES] + [(name, "upstream") for name in UPSTREAM_BOUND],
    )
    def test_wrong_fix_is_caught(self, runs, name, suite):
        """Each wrong fix turns a test of the fork's gate red, and each but UPSTREAM_BLIND a test that travels
        upstream (all that is left once the patch retires)."""
        carried, variant = _suites(runs["carried"])[suite], _suites(runs[name])[suite]
        assert carried and set(carried.values()) == {Outcome.PASSED}, f"the carried fix does not pass {suite}"
        assert set(variant) == set(carried), f"{name}: the variant ran other tests"
        assert [n for n, o in variant.items() if o in RED], f"no test of {suite} notices: {name}"


class TestCorrectRewritesStayGreen:
    @pytest.mark.parametrize("name", CORRECT_REWRITES)
    def test_correct_rewrite_passes(self, runs, name):
        assert {n: o for n, o in runs[name].outcomes.items() if o != Outcome.PASSED} == {}
        assert set(runs[name].outcomes) == set(runs["carried"].outcomes)


class TestVerifyProbeVerdict:
    """The judgement of verify's probe (probe.probe(), in the variant's warm session; the CLI's cold run and exit
    codes are tests/tool's unpatched and patched cases) on each variant's tree: delivered for the carried fix, every
    correct rewrite and the wrong fixes it is blind to (PROBE_BLIND, #6105's among them); not delivered for every other
    wrong fix, with verify's reason."""

    def test_the_blind_spots_are_wrong_fixes(self):
        assert PROBE_BLIND <= WRONG_FIXES.keys()

    @pytest.mark.parametrize("name", ["carried", *VARIANTS])
    def test_probe_verdict(self, runs, name):
        delivered = name not in WRONG_FIXES or name in PROBE_BLIND
        assert runs[name].of(PROBE) == (Outcome.PASSED if delivered else Outcome.ASSERTION)
        reason = runs[name].reasons.get(PROBE, "")
        if delivered:
            assert reason == "the model receives the batch's loss_mask with MTP on"
        elif name in ("reverted", "another kwarg name", "only packed batches"):
            assert reason.startswith("the model received no loss_mask with MTP on"), reason
        else:  # a value, but not the mask: verify names it
            assert "not the batch's mask" in reason, reason


@pytest.fixture(scope="module")
def upstream(upstream_checkout, pytestconfig):
    """The tests the patch adds or changes in upstream's file, and the runs of that file per variant, on a patched
    copy of --upstream-checkout at --upstream-rev (the base-commit), built as gate builds it."""
    python = pytestconfig.getoption("upstream_python") or sys.executable
    patch = load()
    rev = pytestconfig.getoption("upstream_rev") or base_commit(patch) or "HEAD"
    row = checkout_row(checkout(upstream_checkout), patch, rev=rev)
    patched = row.patched.cwd  # upstream + the whole patch
    return row.touched, run_variants(patched, FIXED_FILE, row.patched, WORK / "upstream-variants", python)


class TestUpstreamBoundTestsAreAsTight:
    """The tests the patch adds to upstream's test_gpt_step.py catch every wrong fix but UPSTREAM_BLIND on their own."""

    @pytest.mark.parametrize("name", UPSTREAM_BOUND)
    def test_wrong_fix_is_caught_by_an_added_test(self, upstream, name):
        added, runs = upstream
        outcomes = runs[name].outcomes
        assert outcomes, f"{name}: nothing ran ({runs[name].collection_errors()[:1]})"
        red = [n for n, o in outcomes.items() if o in RED and n.split("[")[0] in added]
        assert red, f"no test the patch adds to upstream's test_gpt_step.py notices: {name}"

    @pytest.mark.parametrize("name", CORRECT_REWRITES)
    def test_correct_rewrite_passes_upstreams_file(self, upstream, name):
        outcomes = upstream[1][name].outcomes
        assert outcomes and {n: o for n, o in outcomes.items() if o != Outcome.PASSED} == {}
