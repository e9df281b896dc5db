"""The logged MTP acceptance rate is top-1 accuracy of depth k over the loss positions only.

Core counts top-1 hits of each MTP depth with the same rolled mask as the loss, and Bridge's training_log has
``MTPLossLoggingHelper.track_mtp_metrics`` write ``mtp_{k}_acceptance_rate`` (percent) and a cumulative rate to its
writers; it never reaches the console line. Read here exactly that way, with a recording writer. Without the fix the
mask is all ones and the rate counts prompt and padding predictions too.

The model (2 MTP layers) is first pretrained a little on chain-A text (all-ones mask, no padding: both trees take the
same steps), and the SFT answers continue the prompt in that language, so the model predicts answers fairly well and
padding (EOS runs it never saw) poorly: the rate over loss positions is far from 0 and from the all-ones rate.
"""

import pytest
import torch

from experiments import synthetic, training
from tinymodel import gpt
from tinymodel.reference import top1_hits


MTP_LAYERS = 2
DEPTHS = [pytest.param(k, id=f"depth{k}") for k in range(1, MTP_LAYERS + 1)]
PRETRAIN_STEPS, PRETRAIN_LR = 20, 1e-2
SFT_STEPS, SFT_LR = 3, 1e-3
BATCH = 16
TOL = 1e-6  # core's float32 percent, read back as a fraction


@pytest.fixture(scope="module")
def sft_steps(one_rank):
    """[(batch, StepResult)] of each SFT step (Adam after each), logits recorded."""
    chain = synthetic.make_chain(gpt.VOCAB, seed=1)
    gen = torch.Generator().manual_seed(7)
    model = gpt.build_model(MTP_LAYERS)
    pretraining = [synthetic.pretrain_batch(chain, gpt.VOCAB, BATCH, 32, gen) for _ in range(PRETRAIN_STEPS)]
    training.pretrain(model, pretraining, PRETRAIN_LR)
    setting = synthetic.SftSetting("markov_prompts", random_prompts=False)
    batches = [synthetic.sft_batch(chain, chain, setting, gpt.VOCAB, BATCH, gen) for _ in range(SFT_STEPS)]
    steps = training.adam_steps(model, batches, SFT_LR, record=lambda step: True)
    return [(batch, result) for batch, (_, result) in zip(batches, steps)]


def _top1(result, batch, depth, all_ones=False) -> tuple[int, int]:
    mask = torch.ones_like(batch["loss_mask"]) if all_ones else batch["loss_mask"]
    return top1_hits(result.mtp_logits[depth - 1], batch["labels"], mask, depth)


class TestAcceptanceRate:
    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize("depth", DEPTHS)
    def test_logged_acceptance_rate_is_top1_over_loss_positions(self, sft_steps, depth):
        for step, (batch, result) in enumerate(sft_steps, start=1):
            hits, counted = _top1(result, batch, depth)
            logged = result.logged[f"mtp_{depth}_acceptance_rate"] / 100
            all_ones = _top1(result, batch, depth, all_ones=True)
            assert logged == pytest.approx(hits / counted, abs=TOL), (
                f"step {step}: logged {logged:.4f}, top-1 over loss positions {hits}/{counted}, "
                f"over every position {all_ones[0]}/{all_ones[1]}"
            )

    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize("depth", DEPTHS)
    def test_logged_cumulative_acceptance_rate_is_top1_over_loss_positions(self, sft_steps, depth):
        hits = counted = 0
        for step, (batch, result) in enumerate(sft_steps, start=1):
            step_hits, step_counted = _top1(result, batch, depth)
            hits, counted = hits + step_hits, counted + step_counted
            logged = result.logged[f"mtp_{depth}_cumulative_acceptance_rate"] / 100
            assert logged == pytest.approx(hits / counted, abs=TOL), f"step {step}"

    @pytest.mark.parametrize("depth", DEPTHS)
    def test_top1_over_loss_positions_is_neither_zero_nor_the_all_positions_value(self, sft_steps, depth):
        """The checks above can fail either way: the model predicts answers, and padding differently."""
        for step, (batch, result) in enumerate(sft_steps, start=1):
            hits, counted = _top1(result, batch, depth)
            all_hits, all_counted = _top1(result, batch, depth, all_ones=True)
            assert hits > 0, f"step {step}"
            assert abs(hits / counted - all_hits / all_counted) > 0.01, f"step {step}"
