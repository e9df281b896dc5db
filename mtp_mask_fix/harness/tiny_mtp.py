"""A tiny real megatron-core GPTModel with MTP, stepped on CPU through Bridge's real ``gpt_step.forward_step``.

Nothing of the code under test is re-implemented: the batch goes through Bridge's ``get_batch``, the model is
megatron-core's GPTModel (local spec, MTP block), the MTP loss is core's ``process_mtp_loss`` and the step is driven by
core's ``schedules.forward_step`` / ``backward_step``. The harness only builds inputs and records what happened.

Which Megatron-Bridge runs is whichever tree comes first on the import path (see mtp_mask_fix.trees); this module
never imports ``megatron.bridge`` at import time. Multi-rank runs start ``mtp_mask_fix.harness.worker`` under torchrun.
"""

import os
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from mtp_mask_fix.harness.fakes import NoCudaTensor, make_state


VOCAB = 128
HIDDEN = 64
NUM_LAYERS = 2
NUM_HEADS = 4
MAX_SEQ = 64
PAD = 1  # the report's SFT set pads with eos (id 1)
SEED = 1234
# (prompt tokens, answer tokens incl. eos): answer-only loss, 2 to 5 loss tokens, padded to the longest sample.
SFT_SAMPLES = ((10, 3), (17, 5), (6, 2))


# ---------------------------------------------------------------- process set-up


_CUDA_CURRENT_DEVICE = torch.cuda.current_device


def _cpu_current_device():
    return torch.device("cpu")


def init_distributed(tensor_parallel: int = 1) -> None:
    """gloo process group (torchrun's env, else a 1-rank in-memory store) and megatron-core's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as core_tp

    # Core's global memory buffer, rotary embedding and MTP loss tracker allocate on torch.cuda.current_device().
    torch.cuda.current_device = _cpu_current_device
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel, 1)
    assert parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel
    # The default tracker calls torch.cuda.get_rng_state; the inference tracker's fork is a null context.
    core_tp.model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True, force_reset_rng=True)


def init_distributed_from_env() -> int:
    """init_distributed with tensor parallel = torchrun's world size (1 outside torchrun); returns it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    init_distributed(world)
    return world


def shutdown_distributed() -> None:
    """Undo init_distributed, so later tests in the same process see a clean slate."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.cuda.current_device = _CUDA_CURRENT_DEVICE


# ---------------------------------------------------------------- model and data


def build_model(mtp_num_layers: int, tensor_parallel: int = 1, seed: int = SEED):
    """fp32 GPTModel with the local spec and ``mtp_num_layers`` MTP layers (0: none).

    Same weights for any TP size: CPU initialisation draws each full weight, then takes this rank's shard.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=NUM_HEADS,
        mtp_num_layers=mtp_num_layers or None,
        tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        # Wider than the 0.02 default so per-position CE varies: masked, unmasked and shifted means then differ.
        init_method_std=0.1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )
    spec = get_gpt_layer_local_spec()
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=MAX_SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp_num_layers else None,
    )
    model.train()
    return model


def make_sft_batch(samples=SFT_SAMPLES, seed: int = 0) -> dict[str, torch.Tensor]:
    """Answer-only SFT batch, label-aligned as Bridge produces it.

    Each text is prompt + answer (its last token eos); ``tokens = text[:-1]``, ``labels = text[1:]``, padded with
    PAD to the longest sample; ``loss_mask[t] = 1`` iff ``labels[t]`` is an answer token.
    """
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for prompt_len, answer_len in samples:
        text = torch.randint(2, VOCAB, (prompt_len + answer_len,), generator=gen)
        text[-1] = PAD
        texts.append(text)
    seq = max(len(t) for t in texts) - 1
    tokens = torch.full((len(samples), seq), PAD, dtype=torch.long)
    labels = torch.full((len(samples), seq), PAD, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), seq)
    for i, (text, (prompt_len, answer_len)) in enumerate(zip(texts, samples)):
        tokens[i, : len(text) - 1] = text[:-1]
        labels[i, : len(text) - 1] = text[1:]
        loss_mask[i, prompt_len - 1 : prompt_len - 1 + answer_len] = 1.0
    position_ids = torch.arange(seq).repeat(len(samples), 1)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def _data_iterator(batch: dict[str, torch.Tensor]):
    loader_batch = dict(batch)
    # The dataset supplies the causal mask (True = masked): core's default one is built on device="cuda".
    seq = batch["tokens"].shape[1]
    loader_batch["attention_mask"] = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(diagonal=1)
    return iter([{key: value.clone().as_subclass(NoCudaTensor) for key, value in loader_batch.items()}])


# ---------------------------------------------------------------- one training step


@dataclass
class StepResult:
    """What one forward_step + backward produced."""

    lm_loss: float  # Bridge's masked LM loss: sum / num_tokens from its "lm loss" report
    mtp_losses: list[float]  # per depth, from MTPLossLoggingHelper.tracker["loss_values"]
    grads: dict[str, torch.Tensor]  # this rank's parameter gradients
    grad_norm: float  # over the whole (TP-sharded) model
    lm_logits: torch.Tensor  # [b, s, vocab], gathered over TP
    mtp_logits: list[torch.Tensor] = field(default_factory=list)  # per depth, [b, s, vocab]
    mtp_loss_weights: list[torch.Tensor] = field(default_factory=list)  # per depth, [b, s]: d(step loss)/d(CE_t)


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """[s, b, v/tp] vocab shard -> [b, s, v], with core's own all-gather along the last dimension."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits).transpose(0, 1).contiguous()


def grad_norm(model) -> float:
    """L2 norm of all gradients, counting TP-replicated parameters once (core's get_grad_norm_fp32 allocates on
    device="cuda", so it cannot run here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

    square = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.grad is not None and param_is_not_tensor_parallel_duplicate(param):
            square += param.grad.double().pow(2).sum()
    dist.all_reduce(square, group=parallel_state.get_tensor_model_parallel_group())
    return square.sqrt().item()


def run_step(model, batch: dict[str, torch.Tensor], *, record: bool = True) -> StepResult | None:
    """One micro-batch forward (Bridge's forward_step under core's schedule) and backward; grads start at zero."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    import megatron.bridge.training.gpt_step as gpt_step

    # Class-level, sized by the first model's mtp_num_layers: start each step from an empty tracker.
    MTPLossLoggingHelper.tracker.clear()
    model.zero_grad(set_to_none=True)
    logits, ce_tensors, handle = [], [], None
    if record:
        # The output layer runs once per MTP depth, then for the LM head. Clone: core's CE edits logits in place.
        handle = model.output_layer.register_forward_hook(lambda mod, inp, out: logits.append(out[0].detach().clone()))
        original_loss = model.compute_language_model_loss

        def recording_loss(labels, lm_logits):
            loss = original_loss(labels, lm_logits)
            loss.retain_grad()  # its grad is the weight each position has in the step's loss
            ce_tensors.append(loss)
            return loss

        model.compute_language_model_loss = recording_loss
    try:
        store: list = []
        output, _ = schedules.forward_step(
            partial(gpt_step.forward_step, make_state()),
            _data_iterator(batch),
            model,
            num_microbatches=1,
            input_tensor=None,
            forward_data_store=store,
            config=model.config,
            cp_group_size=1,
            is_last_stage=True,
        )
        schedules.backward_step(None, output, None, model.config)
    finally:
        if record:
            handle.remove()
            del model.compute_language_model_loss
    if not record:
        return None
    depth = model.config.mtp_num_layers or 0
    assert len(logits) == depth + 1 and len(ce_tensors) == depth + 1, (len(logits), len(ce_tensors))
    loss_sum, num_tokens = store[0]["lm loss"].tolist()
    tracker = MTPLossLoggingHelper.tracker
    return StepResult(
        lm_loss=loss_sum / num_tokens,
        mtp_losses=tracker["loss_values"].tolist() if depth else [],
        grads={name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None},
        grad_norm=grad_norm(model),
        lm_logits=_gather_vocab(logits[-1]),
        mtp_logits=[_gather_vocab(x) for x in logits[:-1]],
        mtp_loss_weights=[ce.grad.detach().clone() for ce in ce_tensors[:-1]],
    )


# ---------------------------------------------------------------- reference values (plain torch, no megatron)


def mtp_positions(seq: int, depth: int) -> slice:
    """Positions t that have a depth-``depth`` target: t + depth < seq."""
    return slice(0, seq - depth)


def mtp_ce_per_position(logits: torch.Tensor, labels: torch.Tensor, depth: int) -> torch.Tensor:
    """Cross-entropy of depth ``depth`` at each position t < s - depth, whose target is labels[t + depth]."""
    seq = labels.shape[1]
    kept = logits[:, mtp_positions(seq, depth)].float()
    return F.cross_entropy(kept.transpose(1, 2), labels[:, depth:], reduction="none")


def mtp_mask(loss_mask: torch.Tensor, depth: int, mask_offset: int = 0) -> torch.Tensor:
    """Mask for the positions t < s - depth: loss_mask[t + depth + mask_offset], zero past the end."""
    seq = loss_mask.shape[1]
    out = torch.zeros(loss_mask.shape[0], seq - depth)
    out[:, : seq - depth - mask_offset] = loss_mask[:, depth + mask_offset :]
    return out


def reference_mtp_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, depth: int, mask_offset: int = 0
) -> float:
    """Masked mean CE of depth ``depth``; ``mask_offset=1`` is the value a once-more-shifted mask would give."""
    ce = mtp_ce_per_position(logits, labels, depth)
    mask = mtp_mask(loss_mask, depth, mask_offset)
    return ((ce * mask).sum() / mask.sum()).item()


def perturb_masked_positions(batch: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """Change every label whose loss_mask is 0, and every token strictly after each sample's answer.

    Those tokens feed only later, all-masked positions (causal attention; MTP depth k at t embeds token t + k and
    counts iff loss_mask[t + k]), so a correctly masked loss is exactly unchanged. Prompt tokens stay: later
    answer positions attend to them.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {key: value.clone() for key, value in batch.items()}
    masked = out["loss_mask"] == 0
    out["labels"][masked] = torch.randint(2, VOCAB, (int(masked.sum()),), generator=gen)
    seq = out["tokens"].shape[1]
    for row in range(out["tokens"].shape[0]):
        last_loss = int(out["loss_mask"][row].nonzero().max())
        first_free = last_loss + 2  # tokens[last_loss + 1] is the last answer token (labels[last_loss])
        if first_free < seq:
            out["tokens"][row, first_free:] = torch.randint(2, VOCAB, (seq - first_free,), generator=gen)
    return out
