"""The upstream-bound tests must be tight: each plausible but wrong fix turns at least one of them red.

Each variant rewrites the patched lines of the generated view (our own lines, plus the schedule-plan call
that the fix must keep) and runs tests/unit_tests against it, all sessions forked from one warm process.
"""

import pytest

from mtp_mask_fix.patch import VIEW, WORK
from mtp_mask_fix.redgreen import Job, Manifest, run_many


FIX = '"loss_mask": loss_mask,'
WRONG_FIXES = {
    "only when MTP is on": (FIX, '**({"loss_mask": loss_mask} if use_mtp else {}),'),
    "only when a mask exists": (FIX, '**({"loss_mask": loss_mask} if loss_mask is not None else {}),'),
    "another tensor (labels)": (FIX, '"loss_mask": labels,'),
    "a copy of the mask": (FIX, '"loss_mask": None if loss_mask is None else loss_mask.clone(),'),
    "a bool mask": (FIX, '"loss_mask": None if loss_mask is None else loss_mask.bool(),'),
    "a shifted mask": (FIX, '"loss_mask": None if loss_mask is None else torch.roll(loss_mask, -1, dims=-1),'),
    "another kwarg name": (FIX, '"mtp_loss_mask": loss_mask,'),
    "only gpt_step's own get_batch (not deepseek_v4_step)": (
        FIX,
        '**({"loss_mask": loss_mask} if _get_batch_fn is None else {}),',
    ),
    "mask dropped from the schedule-plan path": ("labels=labels, loss_mask=loss_mask", "labels=labels"),
}


@pytest.fixture(scope="module")
def red_counts():
    """For each wrong fix: how many upstream-bound tests fail by assertion against it."""
    view = VIEW.read_text()
    variants_dir = WORK / "wrong_fixes"
    variants_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for index, (old, new) in enumerate(WRONG_FIXES.values()):
        assert view.count(old) == 1, f"the view no longer holds {old!r} exactly once"
        variant = variants_dir / f"gpt_step_{index}.py"
        variant.write_text(view.replace(old, new))
        jobs.append(Job(["tests/unit_tests"], env={"MTP_FIX_GPT_STEP": str(variant)}))
    runs = run_many(jobs)
    unit_ids = set(Manifest.load().fail_to_pass["unit"]) | set(Manifest.load().pass_to_pass["unit"])
    counts = {}
    for name, run in zip(WRONG_FIXES, runs):
        assert set(run.outcomes) == unit_ids, f"{name}: the variant did not run every unit test"
        counts[name] = sum(outcome == "assertion" for outcome in run.outcomes.values())
    return counts


class TestWrongFixesTurnRed:
    @pytest.mark.parametrize("name", WRONG_FIXES)
    def test_wrong_fix_is_caught(self, red_counts, name):
        assert red_counts[name] > 0, f"no upstream-bound test notices: {name}"
