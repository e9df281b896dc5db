"""The regression gate (tests/unit_tests) must be tight and fair: every plausible wrong fix turns at least one of its
tests red, and every correct fix written another way keeps all of them green.

Each variant rewrites the fix in a copy of the view and runs tests/unit_tests with that tree first on the import
path; all sessions are forked from one warm process.
"""

import pytest

from mtp_mask_fix.paths import GPT_STEP, VIEW, WORK
from mtp_mask_fix.redgreen import Job, Outcome, run_many
from mtp_mask_fix.trees import materialise


GATE = "    if use_mtp:\n"
FIX = 'forward_args["loss_mask"] = loss_mask\n'
BLOCK = GATE + "        # MCore's MTP loss falls back to an all-ones mask without it (#6103).\n        " + FIX
CALL = "output_tensor = model(**forward_args)\n"
PLAN = "labels=labels, loss_mask=loss_mask\n"
WRONG_FIXES = {
    "reverted": [(BLOCK, "")],
    "another kwarg name": [(FIX, 'forward_args["mtp_loss_mask"] = loss_mask\n')],
    "a shifted mask": [(FIX, 'forward_args["loss_mask"] = None if loss_mask is None else loss_mask.roll(-1, -1)\n')],
    "an all-ones mask": [
        (FIX, 'forward_args["loss_mask"] = None if loss_mask is None else torch.ones_like(loss_mask)\n')
    ],
    "labels as the mask": [(FIX, 'forward_args["loss_mask"] = labels\n')],
    "the attention mask as the mask": [(FIX, 'forward_args["loss_mask"] = attention_mask\n')],
    "the schedule-plan path loses it": [(PLAN, "labels=labels\n")],
    "only packed batches": [(GATE, "    if use_mtp and packed_seq_metadata is not None:\n")],
    "only dense batches": [(GATE, "    if use_mtp and packed_seq_metadata is None:\n")],
    "only in training mode": [(GATE, '    if use_mtp and getattr(model, "training", True):\n')],
    "only with gradients on": [(GATE, "    if use_mtp and torch.is_grad_enabled():\n")],
    "only gpt_step's own get_batch (not deepseek_v4_step)": [(GATE, "    if use_mtp and _get_batch_fn is None:\n")],
    "passed to every model, one without loss_mask too (#6105)": [(GATE, "    if True:\n")],
}
CORRECT_REWRITES = {
    "a copy of the mask": [(FIX, 'forward_args["loss_mask"] = None if loss_mask is None else loss_mask.clone()\n')],
    "only when a mask exists": [(GATE, "    if use_mtp and loss_mask is not None:\n")],
    "mtp_num_layers read again": [(GATE, '    if getattr(config, "mtp_num_layers", None):\n')],
    "a keyword of the model call": [
        (BLOCK, ""),
        (CALL, 'output_tensor = model(**forward_args, **({"loss_mask": loss_mask} if use_mtp else {}))\n'),
    ],
    "an entry of the forward_args literal": [
        (BLOCK, ""),
        (
            '"labels": labels,\n    }\n',
            '"labels": labels,\n        **({"loss_mask": loss_mask} if use_mtp else {}),\n    }\n',
        ),
    ],
}


@pytest.fixture(scope="module")
def runs():
    """tests/unit_tests once per variant, each against a copy of the view with its rewrite."""
    view = (VIEW / GPT_STEP).read_text()
    variants = {**WRONG_FIXES, **CORRECT_REWRITES}
    jobs = []
    for index, edits in enumerate(variants.values()):
        text = view
        for old, new in edits:
            assert text.count(old) == 1, f"the view no longer holds {old!r} exactly once"
            text = text.replace(old, new)
        tree = materialise(VIEW, WORK / "variants" / str(index), rewrite={GPT_STEP: text})
        jobs.append(Job(("tests/unit_tests",), tree))
    jobs.append(Job(("tests/unit_tests",), VIEW))  # the fix as carried: every variant must run the same tests
    *variant_runs, carried = run_many(jobs)
    return dict(zip(variants, variant_runs)) | {"carried": carried}


class TestWrongFixesTurnRed:
    @pytest.mark.parametrize("name", WRONG_FIXES)
    def test_wrong_fix_is_caught(self, runs, name):
        assert runs["carried"].outcomes, "the view ran no unit test"
        assert set(runs[name].outcomes) == set(runs["carried"].outcomes), f"{name}: the variant ran other tests"
        red = [n for n, o in runs[name].outcomes.items() if o in (Outcome.ASSERTION, Outcome.OTHER_FAILURE)]
        assert red, f"no test of tests/unit_tests notices: {name}"


class TestCorrectRewritesStayGreen:
    @pytest.mark.parametrize("name", CORRECT_REWRITES)
    def test_correct_rewrite_passes(self, runs, name):
        assert {n: o for n, o in runs[name].outcomes.items() if o != Outcome.PASSED} == {}
        assert set(runs[name].outcomes) == set(runs["carried"].outcomes)
