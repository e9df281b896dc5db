"""A tiny real megatron-core GPTModel with MTP, stepped on CPU through core's schedule and Bridge's ``forward_step``.

Nothing of the code under test is re-implemented: batches go through Bridge's ``get_batch``, the model is
megatron-core's GPTModel (local spec, MTP block, optionally MoE), the MTP loss and its metrics are core's, and every
step - one rank, TP2, PP2, EP2, pretraining, SFT, evaluation - is ``run_step``: core's ``get_forward_backward_func()``
driving ``gpt_step.forward_step``. The harness only builds inputs and records what happened; the CPU workarounds are
in cpu_runtime.

Which Megatron-Bridge runs is whichever tree comes first on the import path (see maintain.trees); this module
never imports ``megatron.bridge`` at import time. Multi-rank runs start a process a rank (``tinymodel.worker``).
"""

import hashlib
import re
from dataclasses import dataclass, field
from functools import partial

import torch

from mtp_mask_fix.probe import global_state
from tinymodel import cpu_runtime


VOCAB = 128
HIDDEN = 64
NUM_LAYERS = 2
NUM_HEADS = 4
MAX_SEQ = 64
PAD = 1  # the report's SFT set pads with eos (id 1)
SEED = cpu_runtime.SEED
# (prompt tokens, answer tokens incl. eos): answer-only loss, 2 to 5 loss tokens, padded to the longest sample.
SFT_SAMPLES = ((10, 3), (17, 5), (6, 2))


# ---------------------------------------------------------------- model


def moe_fields(dispatcher: str = "allgather", aux_loss_coeff: float = 0.0) -> dict:
    """TransformerConfig fields for MoE layers: 4 routed experts (top-2) plus a shared expert, no token dropping."""
    return {
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": HIDDEN,
        "moe_shared_expert_intermediate_size": HIDDEN,
        "moe_token_dispatcher_type": dispatcher,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": aux_loss_coeff,
        # A shared expert refuses bias (and with bias mlp.py edits a view of a TP-region output in place).
        "add_bias_linear": False,
    }


def build_model(
    mtp_num_layers: int = 1, *, seed: int = SEED, hidden: int = HIDDEN, max_seq: int = MAX_SEQ, **config_fields
):
    """fp32 GPTModel (local spec, untied embeddings) with ``mtp_num_layers`` MTP layers (0: none); this rank's part of
    the parallel layout that cpu_runtime.init_distributed set up. ``config_fields`` go to TransformerConfig.

    Same weights for any TP size: CPU initialisation draws each full weight, then takes this rank's shard. Not for PP
    stages (a stage's draws start elsewhere): load them from the full model (pipeline.stage_state_dict).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=hidden,
        num_attention_heads=NUM_HEADS,
        mtp_num_layers=mtp_num_layers or None,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
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
        **cpu_runtime.CONFIG_FIELDS,
        **config_fields,
    )
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    with cpu_runtime.CudaAsCpu():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=VOCAB,
            max_sequence_length=max_seq,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
            if mtp_num_layers
            else None,
        )
    if config.pipeline_model_parallel_size > 1:
        cpu_runtime.sync_pipeline_embedding_grads(model)
    model.train()
    return model


def weights_sha256(model) -> str:
    """Hash of a model's tensors, by name: equal hashes mean bit-identical weights."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        if torch.is_tensor(value):
            digest.update(name.encode())
            digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- data


def make_sft_batch(samples=SFT_SAMPLES, seed: int = 0, seq: int | None = None) -> dict[str, torch.Tensor]:
    """Answer-only SFT batch, label-aligned as Bridge produces it.

    Each text is prompt + answer (its last token eos); ``tokens = text[:-1]``, ``labels = text[1:]``, padded with
    PAD to ``seq`` (default: the longest sample); ``loss_mask[t] = 1`` iff ``labels[t]`` is an answer token.
    """
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for prompt_len, answer_len in samples:
        text = torch.randint(2, VOCAB, (prompt_len + answer_len,), generator=gen)
        text[-1] = PAD
        texts.append(text)
    seq = seq or max(len(t) for t in texts) - 1
    tokens = torch.full((len(samples), seq), PAD, dtype=torch.long)
    labels = torch.full((len(samples), seq), PAD, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), seq)
    for i, (text, (prompt_len, answer_len)) in enumerate(zip(texts, samples)):
        tokens[i, : len(text) - 1] = text[:-1]
        labels[i, : len(text) - 1] = text[1:]
        loss_mask[i, prompt_len - 1 : prompt_len - 1 + answer_len] = 1.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def _data_iterator(batches: list[dict[str, torch.Tensor]]):
    """What a Bridge data loader yields, one dict per micro-batch (get_batch picks what this stage needs)."""
    for batch in batches:
        rows, seq = batch["tokens"].shape
        item = {key: batch[key].clone() for key in ("tokens", "labels", "loss_mask")}
        item["position_ids"] = torch.arange(seq).repeat(rows, 1)
        item["attention_mask"] = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(diagonal=1)  # True = masked
        yield item


# ---------------------------------------------------------------- one step


@dataclass
class Forward:
    """What one micro-batch's forward produced on the stage with the output layer."""

    lm_logits: torch.Tensor  # [b, s, vocab], gathered over TP
    mtp_logits: list[torch.Tensor]  # per depth, [b, s, vocab]
    mtp_loss_weights: list[torch.Tensor]  # per depth, [b, s]: d(step loss)/d(CE_t); empty when forward-only


@dataclass
class StepResult:
    """What one step (a global batch through the schedule) produced on this rank."""

    lm_loss: float | None  # Bridge's LM loss: sum of masked CE sums / token count; None off the last stage
    logged: dict[str, float]  # what core's track_mtp_metrics wrote ("mtp_1 loss", "mtp_1_acceptance_rate" in %, ...)
    grad_norm: float | None  # None when forward-only, or with expert parallel (see grad_norm)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's gradients (recorded steps)
    forwards: list[Forward] = field(default_factory=list)  # per micro-batch (recorded steps, last stage)

    @property
    def mtp_losses(self) -> list[float]:
        """The logged MTP loss of each depth."""
        depths = sorted(int(m.group(1)) for key in self.logged if (m := re.fullmatch(r"mtp_(\d+) loss", key)))
        return [self.logged[f"mtp_{k} loss"] for k in depths]

    def _only_forward(self) -> Forward:
        if len(self.forwards) != 1:
            raise ValueError(f"{len(self.forwards)} recorded forwards: use .forwards")
        return self.forwards[0]

    @property
    def lm_logits(self) -> torch.Tensor:
        """The LM logits of a one-micro-batch step."""
        return self._only_forward().lm_logits

    @property
    def mtp_logits(self) -> list[torch.Tensor]:
        """The MTP logits per depth of a one-micro-batch step."""
        return self._only_forward().mtp_logits

    @property
    def mtp_loss_weights(self) -> list[torch.Tensor]:
        """Each position's weight in the MTP loss per depth, of a one-micro-batch step."""
        return self._only_forward().mtp_loss_weights


class _Recorder:
    """Every output-layer call's logits (per forward: the MTP depths, then the LM head) and, for a backward step,
    every per-position CE tensor with its grad retained: that grad is the weight each position has in the loss."""

    def __init__(self, model, with_weights: bool):
        self.model, self.logits, self.ce = model, [], []
        # Clone: core's cross-entropy edits logits in place.
        self.handle = model.output_layer.register_forward_hook(
            lambda module, inputs, output: self.logits.append(output[0].detach().clone())
        )
        if with_weights:
            compute = model.compute_language_model_loss

            def recording_loss(labels, logits):
                loss = compute(labels, logits)
                loss.retain_grad()
                self.ce.append(loss)
                return loss

            model.compute_language_model_loss = recording_loss

    def remove(self) -> None:
        self.handle.remove()
        self.model.__dict__.pop("compute_language_model_loss", None)

    def forwards(self, depth: int) -> list[Forward]:
        if len(self.logits) % (depth + 1) or (self.ce and len(self.ce) != len(self.logits)):
            raise RuntimeError(f"{len(self.logits)} output-layer calls, {len(self.ce)} CE tensors, depth {depth}")
        out = []
        for start in range(0, len(self.logits), depth + 1):
            logits = [_gather_vocab(x) for x in self.logits[start : start + depth + 1]]
            weights = [ce.grad.detach().clone() for ce in self.ce[start : start + depth]]
            out.append(Forward(lm_logits=logits[-1], mtp_logits=logits[:-1], mtp_loss_weights=weights))
        return out


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """[s, b, v/tp] vocab shard -> [b, s, v], with core's own all-gather along the last dimension."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits).transpose(0, 1).contiguous()


class ScalarRecorder:
    """SummaryWriter stand-in: what track_mtp_metrics writes to TensorBoard, as floats."""

    def __init__(self):
        self.values: dict[str, float] = {}

    def add_scalar(self, name, value, iteration):
        """Record the last value written under ``name``."""
        self.values[name] = float(value)


def logged_mtp_metrics(num_microbatches: int, iteration: int = 1) -> dict[str, float]:
    """The MTP metrics as Bridge's training_log has core log them: ``track_mtp_metrics(1 / num_microbatches, ...)``
    with a writer (it reduces over the DP group, then zeroes the step's values; cumulative counts persist)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    writer = ScalarRecorder()
    MTPLossLoggingHelper.track_mtp_metrics(1 / num_microbatches, iteration, writer, None, {})
    return writer.values


def reset_mtp_tracker() -> None:
    """Empty core's class-level MTP tracker, cumulative acceptance counts included: a new run starts."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def _drop_step_values() -> None:
    # The tracker is class-level and sized by the first model's depth: drop the (already logged) step values so a
    # model of another depth can follow; the cumulative counts of a training run stay.
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    for key in ("loss_values", "correct_values", "total_values"):
        MTPLossLoggingHelper.tracker.pop(key, None)


def grad_norm(model) -> float | None:
    """The grad norm Megatron's optimizer logs: core's get_grad_norm_fp32 over the model-parallel group, each
    parameter counted once. None with expert parallel (core's optimizer norms expert parameters over other groups)."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return None
    grads = [
        p.grad
        for p in model.parameters()
        if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
    ]
    # Core's own norm (not a re-implementation): CudaAsCpu covers the device="cuda" accumulator that kept it off CPU.
    with cpu_runtime.CudaAsCpu():
        return float(get_grad_norm_fp32(grads, grad_stats_parallel_group=parallel_state.get_model_parallel_group()))


def run_step(model, batches, *, record: bool = True, forward_only: bool = False, iteration: int = 1) -> StepResult:
    """One global batch (a batch dict or a list of micro-batches) through core's ``get_forward_backward_func()`` with
    Bridge's ``gpt_step.forward_step``; grads start at zero and are left for an optimizer.

    ``record``: keep grads and each micro-batch's logits (and MTP loss weights). ``forward_only``: no backward and
    nothing logged (an evaluation; wrap it in torch.no_grad()).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import megatron.bridge.training.gpt_step as gpt_step

    batches = [batches] if isinstance(batches, dict) else list(batches)
    _drop_step_values()
    model.zero_grad(set_to_none=True)
    recorder = _Recorder(model, with_weights=not forward_only) if record and model.post_process else None
    try:
        with cpu_runtime.CudaAsCpu():
            store = get_forward_backward_func()(
                forward_step_func=partial(gpt_step.forward_step, global_state()),
                data_iterator=_data_iterator(batches),
                model=[model],
                num_microbatches=len(batches),
                seq_length=batches[0]["tokens"].shape[1],
                micro_batch_size=batches[0]["tokens"].shape[0],
                forward_only=forward_only,
            )
    finally:
        if recorder is not None:
            recorder.remove()
    lm_loss = None
    if store:
        loss_sum, num_tokens = torch.stack([entry["lm loss"] for entry in store]).sum(0).tolist()
        lm_loss = loss_sum / num_tokens
    return StepResult(
        lm_loss=lm_loss,
        logged={} if forward_only else logged_mtp_metrics(len(batches), iteration),
        grad_norm=None if forward_only else grad_norm(model),
        grads={n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if record
        else {},
        forwards=recorder.forwards(model.config.mtp_num_layers or 0) if recorder is not None else [],
    )
