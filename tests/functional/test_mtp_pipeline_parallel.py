"""Pipeline parallel 2: the MTP loss honours the loss mask on the last stage, through core's real 1F1B schedule.

One job of 2 forked ranks (gloo, this session's tree) splits the tiny model into two stages, MTP on the last, and
steps two answer-only SFT micro-batches with Bridge's forward_step, then a copy with masked positions perturbed.
"""

import pytest

from tinymodel import pipeline
from tinymodel.reference import (
    REL,
    changed_grads,
    reference_mtp_loss,
)
from tinymodel.worker import Launch, start


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tree, tmp_path_factory):
    """The job (2 forked ranks, this session's tree): started, not awaited."""
    return start(Launch("pipeline", tree, 2, tmp_path_factory.mktemp("pipeline")))


@pytest.fixture(scope="module")
def stages(job):
    """Both stages' payloads (rank order)."""
    return job.wait()[0]


@pytest.fixture(scope="module")
def last_stage(stages):
    return stages[-1]


def _masked_mean_over_micro_batches(step, depth: int, mask_offset: int = 0) -> float:
    """Masked MTP CE per micro-batch, averaged: core logs the sum of the micro-batches' masked means, and Bridge's
    training_log scales it by 1 / num_microbatches."""
    values = [
        reference_mtp_loss(forward.mtp_logits[depth - 1], batch["labels"], batch["loss_mask"], depth, mask_offset)
        for forward, batch in zip(step.forwards, pipeline.micro_batches())
    ]
    return sum(values) / len(values)


class TestPipelineParallel2:
    """PP=2 on forked ranks: what the 1-rank suite checks, on every stage."""

    def test_workers_ran_the_tree_under_test_with_mtp_on_the_last_stage(self, stages, gpt_step_file):
        assert [s["gpt_step_file"] for s in stages] == [gpt_step_file] * 2
        assert [(s["stage"], s["has_mtp"]) for s in stages] == [(0, False), (1, True)]
        assert stages[0]["step"].logged == {} and list(stages[1]["step"].logged)[0] == "mtp_1 loss"
        assert len(stages[1]["step"].forwards) == len(pipeline.MICRO_BATCHES)

    @pytest.mark.fail_to_pass
    def test_every_gradient_is_unchanged_on_every_stage(self, stages):
        for stage in stages:
            changed = changed_grads(stage["step"].grads, stage["perturbed"].grads)
            assert changed == [], f"stage {stage['stage']}: {len(changed)} of {len(stage['step'].grads)} changed"

    @pytest.mark.fail_to_pass
    def test_logged_losses_are_unchanged(self, last_stage):
        assert last_stage["perturbed"].lm_loss == last_stage["step"].lm_loss
        assert last_stage["perturbed"].mtp_losses == last_stage["step"].mtp_losses

    @pytest.mark.fail_to_pass
    def test_logged_mtp_loss_is_the_masked_cross_entropy(self, last_stage):
        step = last_stage["step"]
        expected = _masked_mean_over_micro_batches(step, depth=1)
        shifted = _masked_mean_over_micro_batches(step, depth=1, mask_offset=1)
        assert step.mtp_losses[0] == pytest.approx(expected, rel=REL)
        assert step.mtp_losses[0] != pytest.approx(shifted, rel=100 * REL)
