"""Pipeline parallel: the tiny MTP model split into one stage per rank (MTP on the last), stepped through core's 1F1B
schedule (``run_step``) on two micro-batches, and on a copy of them with masked positions perturbed.

Each stage is loaded with the full model's weights: building a stage with the same seed does not reproduce them
(a later stage's random draws start elsewhere). The worker builds the full model under PP=1 first to get them, and
reports their hash, so a test can check its own 1-rank run starts from the same weights.
"""

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


def full_model_name(name: str, stage: int, layers_per_stage: int) -> str:
    """A stage's parameter name in the full model: decoder layer i of stage r is layer r * layers_per_stage + i."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    index, rest = name[len(prefix) :].split(".", 1)
    return f"{prefix}{int(index) + stage * layers_per_stage}.{rest}"


def measure(pipeline_parallel: int) -> dict:
    """This rank's stage: names, the full model's hash, and the step on the micro-batches and on the perturbed copy."""
    from megatron.core import parallel_state

    cpu_runtime.init_distributed()
    full = gpt.build_model(1)
    full_state, full_hash = full.state_dict(), gpt.weights_sha256(full)
    cpu_runtime.reset_model_parallel()

    cpu_runtime.init_distributed(pipeline_parallel=pipeline_parallel)
    stage_index = parallel_state.get_pipeline_model_parallel_rank()
    stage = gpt.build_model(1)
    layers = len(stage.decoder.layers)
    names = {name: full_model_name(name, stage_index, layers) for name in stage.state_dict()}
    stage.load_state_dict({name: full_state[source] for name, source in names.items()}, strict=True)
    return {
        "stage": stage_index,
        "has_mtp": stage.mtp_process,
        "full_model_sha256": full_hash,
        "full_model_names": names,
        "step": gpt.run_step(stage, micro_batches()),
        "perturbed": gpt.run_step(stage, perturbed_micro_batches()),
    }
