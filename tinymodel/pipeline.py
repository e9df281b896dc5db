"""Pipeline parallel: the tiny MTP model split into one stage per rank (MTP on the last), stepped through core's 1F1B
schedule (``run_step``) on two micro-batches, and on a copy of them with masked positions perturbed."""

import torch

from tinymodel import cpu_runtime, gpt
from tinymodel.reference import perturb_masked_positions


SEQ = 24  # every micro-batch padded to the schedule's one sequence length
MICRO_BATCHES = (((10, 3), (17, 5)), ((6, 2), (12, 4)))  # (prompt, answer) per sample: 2 to 5 loss tokens


def micro_batches() -> list[dict[str, torch.Tensor]]:
    """The two answer-only SFT micro-batches every pipeline run steps."""
    return [gpt.make_sft_batch(samples, seed=i, seq=SEQ) for i, samples in enumerate(MICRO_BATCHES)]


def perturbed_micro_batches() -> list[dict[str, torch.Tensor]]:
    """The same micro-batches with every masked label and every token after each answer changed."""
    return [perturb_masked_positions(b, vocab=gpt.VOCAB, seed=10 + i) for i, b in enumerate(micro_batches())]


def measure(pipeline_parallel: int) -> dict:
    """This rank's stage and its step on the micro-batches and on the perturbed copy."""
    from megatron.core import parallel_state

    cpu_runtime.init_distributed(pipeline_parallel=pipeline_parallel)
    stage = gpt.build_model(1)
    return {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "has_mtp": stage.mtp_process,
        "step": gpt.run_step(stage, micro_batches()),
        "perturbed": gpt.run_step(stage, perturbed_micro_batches()),
    }
