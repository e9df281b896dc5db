"""The MTP loss of a real GPTModel, stepped through Bridge's gpt_step.forward_step, honours the loss mask (#6103).

A tiny fp32 megatron-core GPTModel with MTP runs on CPU (gloo) through the real get_batch, forward_step, core's
schedule and process_mtp_loss, on answer-only SFT batches (prompt, 2 to 5 loss tokens, padding to the longest
sample, label-aligned mask). The Megatron-Bridge under test is the tree first on the import path: the view
(release + patch) by default, the release as shipped in the red/green run.
"""

import pytest
import torch

from tinymodel import gpt
from tinymodel.reference import (
    REL,
    changed_grads,
    mtp_ce_per_position,
    mtp_mask,
    mtp_positions,
    perturb_masked_positions,
    reference_mtp_loss,
)


MTP_DEPTHS = [(1, 1), (2, 1), (2, 2)]  # (mtp_num_layers, depth)


@pytest.fixture(scope="module")
def models(one_rank):
    return {k: gpt.build_model(k) for k in (0, 1, 2)}


@pytest.fixture(scope="module")
def batch():
    return gpt.make_sft_batch()


@pytest.fixture(scope="module")
def perturbed(batch):
    return perturb_masked_positions(batch, vocab=gpt.VOCAB)


@pytest.fixture(scope="module")
def steps(models, batch):
    return {k: gpt.run_step(model, batch) for k, model in models.items()}


@pytest.fixture(scope="module")
def perturbed_steps(models, perturbed):
    return {k: gpt.run_step(model, perturbed) for k, model in models.items()}


class TestBatchShape:
    """The batches are the report's SFT shape; the perturbation only touches what a correct mask ignores."""

    def test_sft_batch_is_answer_only_and_label_aligned(self, batch):
        tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
        lengths = [p + a - 1 for p, a in gpt.SFT_SAMPLES]
        assert tokens.shape[1] == max(lengths)
        for row, ((prompt, answer), length) in enumerate(zip(gpt.SFT_SAMPLES, lengths)):
            assert 2 <= answer <= 5 and mask[row].sum() == answer
            assert torch.equal(labels[row, : length - 1], tokens[row, 1:length])  # labels = tokens shifted by one
            assert mask[row].nonzero().flatten().tolist() == list(range(prompt - 1, prompt - 1 + answer))
            assert (tokens[row, length:] == gpt.PAD).all() and (labels[row, length - 1 :] == gpt.PAD).all()

    def test_perturbation_touches_only_masked_labels_and_tokens_after_the_answer(self, batch, perturbed):
        mask = batch["loss_mask"].bool()
        assert torch.equal(perturbed["labels"][mask], batch["labels"][mask])
        assert not torch.equal(perturbed["labels"][~mask], batch["labels"][~mask])
        for row in range(mask.shape[0]):
            last_loss = int(mask[row].nonzero().max())
            # Tokens up to last_loss + 1 (the last answer token) feed positions that carry loss.
            assert torch.equal(perturbed["tokens"][row, : last_loss + 2], batch["tokens"][row, : last_loss + 2])
        assert not torch.equal(perturbed["tokens"], batch["tokens"])


class TestGradientInvariance:
    """Labels at masked positions and tokens after the answer must not reach the loss or any gradient.

    Why this is exact with the fix: under causal attention a token at position j only influences positions >= j;
    MTP depth k at position t embeds token t + k and counts only if loss_mask[t + k] = 1. Every changed token
    sits after the last loss label + 1, so every position that carries loss (LM or MTP) sees bit-identical
    inputs, and the changed labels are multiplied by an exact 0 mask. Without the fix core counts every label
    (all-ones mask), so the changed padding and prompt labels enter the MTP loss: see
    test_perturbation_changes_the_ce_an_all_ones_mask_would_count.
    """

    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize("mtp_num_layers", [1, 2])
    def test_every_gradient_is_unchanged(self, steps, perturbed_steps, mtp_num_layers):
        changed = changed_grads(steps[mtp_num_layers].grads, perturbed_steps[mtp_num_layers].grads)
        assert changed == [], f"{len(changed)} of {len(steps[mtp_num_layers].grads)} gradients changed"

    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize("mtp_num_layers", [1, 2])
    def test_logged_losses_are_unchanged(self, steps, perturbed_steps, mtp_num_layers):
        assert perturbed_steps[mtp_num_layers].lm_loss == steps[mtp_num_layers].lm_loss
        assert perturbed_steps[mtp_num_layers].mtp_losses == steps[mtp_num_layers].mtp_losses

    @pytest.mark.parametrize(("mtp_num_layers", "depth"), MTP_DEPTHS)
    def test_perturbation_changes_the_ce_an_all_ones_mask_would_count(
        self, batch, perturbed, steps, perturbed_steps, mtp_num_layers, depth
    ):
        """The invariance above is not vacuous: masked-position CE moves, loss-position CE does not."""
        mask = mtp_mask(batch["loss_mask"], depth).bool()
        ce = mtp_ce_per_position(steps[mtp_num_layers].mtp_logits[depth - 1], batch["labels"], depth)
        ce_perturbed = mtp_ce_per_position(
            perturbed_steps[mtp_num_layers].mtp_logits[depth - 1], perturbed["labels"], depth
        )
        assert torch.equal(ce_perturbed[mask], ce[mask])
        assert not torch.allclose(ce_perturbed[~mask], ce[~mask])


class TestLoggedMtpLoss:
    """The MTP loss core logs is the masked CE of depth k, whose target at t is labels[t + k]."""

    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize(("mtp_num_layers", "depth"), MTP_DEPTHS)
    def test_logged_mtp_loss_is_the_masked_cross_entropy(self, batch, steps, mtp_num_layers, depth):
        step = steps[mtp_num_layers]
        expected = reference_mtp_loss(step.mtp_logits[depth - 1], batch["labels"], batch["loss_mask"], depth)
        unmasked = reference_mtp_loss(
            step.mtp_logits[depth - 1], batch["labels"], torch.ones_like(batch["loss_mask"]), depth
        )
        assert step.mtp_losses[depth - 1] == pytest.approx(expected, rel=REL), f"an all-ones mask gives {unmasked:.6f}"

    @pytest.mark.parametrize(("mtp_num_layers", "depth"), MTP_DEPTHS)
    def test_logged_mtp_loss_is_not_the_once_more_shifted_mask_value(self, batch, steps, mtp_num_layers, depth):
        """Tells the right alignment from a double shift (the mask rolled before core rolls it again)."""
        step = steps[mtp_num_layers]
        logits, labels, mask = step.mtp_logits[depth - 1], batch["labels"], batch["loss_mask"]
        shifted = reference_mtp_loss(logits, labels, mask, depth, mask_offset=1)
        assert shifted != pytest.approx(reference_mtp_loss(logits, labels, mask, depth), rel=100 * REL)
        assert step.mtp_losses[depth - 1] != pytest.approx(shifted, rel=100 * REL)

    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize(("mtp_num_layers", "depth"), MTP_DEPTHS)
    def test_mtp_gradient_weight_is_zero_exactly_at_masked_positions(self, batch, steps, mtp_num_layers, depth):
        """Each position's weight in the step loss (gradient reaching its CE) follows the rolled loss mask."""
        weights = steps[mtp_num_layers].mtp_loss_weights[depth - 1]
        seq = batch["labels"].shape[1]
        kept = weights[:, mtp_positions(seq, depth)]
        mask = mtp_mask(batch["loss_mask"], depth)
        wrong = ((kept != 0) != mask.bool()).nonzero().tolist()
        assert wrong == [], f"{len(wrong)} positions weighted against the mask, (row, position): {wrong[:8]}"
        assert (weights[:, seq - depth :] == 0).all()  # core zeroes the rolled-in tail


class TestLanguageModelLoss:
    """The fix only reaches the MTP loss: Bridge's LM loss stays the masked CE of the LM logits, with or without MTP
    (held here once: every other layer runs the same loss function)."""

    @pytest.mark.parametrize("mtp_num_layers", [0, 1, 2])
    def test_lm_loss_is_the_masked_cross_entropy(self, batch, steps, mtp_num_layers):
        step = steps[mtp_num_layers]
        expected = reference_mtp_loss(step.lm_logits, batch["labels"], batch["loss_mask"], depth=0)
        assert step.lm_loss == pytest.approx(expected, rel=REL)
