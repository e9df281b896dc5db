"""Training loops outside Bridge, right and wrong, each one call of the tiny GPTModel and its backward, written as the
frameworks write them: Megatron-LM's `loss_func(loss_mask, output_tensor)`, Bridge's `masked_next_token_loss`, and a
GRPO-style policy loss on the logits of a call without labels (core derives them). Packed THD rows call core's MTP loss
and LM loss as GPTModel._postprocess does (the local attention of the CPU model has no THD).

    python tests/watch/loops.py LOOP [--steps N] [--then exit-3|sleep]

runs LOOP N times, then exits 3 or sleeps (a job to stop) after writing `steps-done` in its working directory.
"""

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.core.models.common.language_module.language_module import LanguageModule  # noqa: E402

from tinymodel import cpu_runtime, gpt  # noqa: E402


EOS, PAD = gpt.PAD, 0  # the report's data pads with EOS; other data with a token of its own


def _text(rows: int, length: int, vocab: int = gpt.VOCAB - 2, repeat: float = 0.0, seed: int = 1) -> torch.Tensor:
    """Rows of tokens 2.. (vocab of them), each token the last one again with probability repeat."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(2, 2 + vocab, (rows, length), generator=gen)
    again = torch.rand(rows, length, generator=gen) < repeat
    for t in range(1, length):
        text[:, t] = torch.where(again[:, t], text[:, t - 1], text[:, t])
    return text


def pretraining(text: torch.Tensor) -> dict:
    """Rows cut from a token stream: labels the inputs shifted by one, every position trained."""
    return {"tokens": text[:, :-1], "labels": text[:, 1:], "mask": torch.ones(text.shape[0], text.shape[1] - 1)}


def ending_in_runs(rows: int = 4, run: int = 10, every: bool = True) -> dict:
    """Pretraining rows whose text ends in a run of one token ("========"): every row, or the first only."""
    text = _text(rows, 33)
    text[: rows if every else 1, -run:] = 7
    return pretraining(text)


def sft(samples=((10, 3), (17, 5), (6, 2)), pad: int = EOS, left: bool = False, ending=(), loss="answer") -> dict:
    """Prompt + answer (its last token EOS) per row, padded to the longest with pad, on the right or the left.

    Args:
        samples: (prompt tokens, answer tokens) per row.
        pad: the padding token.
        left: pad on the left, as prompts are padded for generation.
        ending: the answer's last tokens, EOS after them.
        loss: what the loss trains: the "answer" (answer-only SFT) or the "text" (all of it but the padding).

    Returns:
        tokens and labels (label[t] = token[t + 1]), the loss's mask (label-aligned), each row's (offset, prompt,
        answer) in the tokens.
    """
    gen = torch.Generator().manual_seed(0)
    width = max(p + a for p, a in samples) - 1
    batch = {key: torch.full((len(samples), width), pad) for key in ("tokens", "labels")}
    batch.update(mask=torch.zeros(len(samples), width), spans=[])
    for row, (prompt, answer) in enumerate(samples):
        text = torch.randint(2, gpt.VOCAB, (prompt + answer,), generator=gen)
        text[len(text) - 1 - len(ending) : -1] = torch.tensor(ending, dtype=text.dtype)
        text[-1] = EOS
        offset = width - len(text) + 1 if left else 0
        batch["tokens"][row, offset : offset + len(text) - 1] = text[:-1]
        batch["labels"][row, offset : offset + len(text) - 1] = text[1:]
        first = offset + (prompt - 1 if loss == "answer" else 0)
        batch["mask"][row, first : offset + len(text) - 1] = 1.0
        batch["spans"].append((offset, prompt, answer))
    return batch


def packed(texts: int = 3, tail: int = 5) -> dict:
    """Texts one after another in one row, BOS..EOS each, then a pad tail the loss masks (pretraining's packing)."""
    text = torch.cat([torch.cat([torch.tensor([2]), row, torch.tensor([EOS])]) for row in _text(texts, 8)])
    row = torch.cat([text, torch.full((tail,), PAD)])[None]
    batch = pretraining(row)
    batch["mask"][0, len(text) - 1 :] = 0.0
    return batch


def rl(samples=((10, 3), (17, 5), (6, 2)), left: bool = True, advantages=(1.0, 0.0, -1.0)) -> dict:
    """A rollout batch: prompt + response + EOS as input_ids (left-padded prompts, as generation has them), no labels;
    the response mask over the inputs and each row's advantage (0 where a group's rewards were equal)."""
    batch = sft(samples, left=left)
    tokens = torch.cat([batch["tokens"], batch["labels"][:, -1:]], 1)  # each text whole
    mask = torch.zeros_like(tokens, dtype=torch.float)
    for row, (offset, prompt, answer) in enumerate(batch["spans"]):
        mask[row, offset + prompt : offset + prompt + answer] = 1.0
    return {"tokens": tokens, "labels": None, "mask": mask, "advantages": torch.tensor(advantages)[:, None]}


def megatron_lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> torch.Tensor:
    """pretrain_gpt.py's loss_func: the masked sum over the masked count."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    return torch.sum(losses * loss_mask) / loss_mask.sum()


def bridge_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> torch.Tensor:
    """Megatron-Bridge's own loss function, as its forward_step hands it the batch's mask."""
    from megatron.bridge.training.losses import masked_next_token_loss

    loss, tokens, _ = masked_next_token_loss(loss_mask, output_tensor)
    return loss / tokens


def logprobs(batch: dict, logits: torch.Tensor) -> torch.Tensor:
    """Each next token's log-probability, as RL frameworks score a rollout: logits at t score token t + 1."""
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["tokens"][:, 1:, None])[..., 0]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's and NeMo-RL's masked mean: over the positions the mask keeps."""
    return (values * mask).sum() / mask.sum()


def policy_loss(batch: dict, logits: torch.Tensor, clip: float = 0.2, drift=0.5, band=None) -> torch.Tensor:
    """A PPO/GRPO clipped policy loss on the response tokens, its mean token-level as DAPO takes it. The old policy's
    log-probabilities are off by `drift` (a number, or one per token), so clipping zeroes those tokens' gradient; with
    `band`, tokens whose probability ratio leaves it are dropped (masked importance sampling)."""
    logp = logprobs(batch, logits)
    ratio, advantages = torch.exp(logp - (logp.detach() - drift)), batch["advantages"]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    if band is not None:
        surrogate = surrogate * ((ratio > band[0]) & (ratio < band[1]))
    return -masked_mean(surrogate, batch["mask"][:, 1:])


def grpo_loss(batch: dict, logits: torch.Tensor) -> torch.Tensor:
    """A GRPO-style loss whose old policy is off by 0.5 on every other token, so that clipping zeroes their
    gradient."""
    return policy_loss(batch, logits, drift=0.5 * (torch.arange(logits.shape[1] - 1) % 2))


def one_unclipped_per_row(batch: dict, logits: torch.Tensor) -> torch.Tensor:
    """PPO with every response token clipped but one per row: each row's loss trains a single token."""
    drift = torch.full(batch["mask"][:, 1:].shape, 0.5)
    for row, first in enumerate(batch["mask"][:, 1:].argmax(1)):
        drift[row, first] = 0.0
    return policy_loss(batch, logits, drift=drift)


def _above_reference(batch: dict, losses: torch.Tensor) -> torch.Tensor:
    """Rho-1's selection: of the masked tokens, those whose loss exceeds a reference model's most (the top half)."""
    excess = (losses - batch["reference"]).masked_fill(batch["mask"] == 0, float("nan")).detach()
    return excess >= excess.nanquantile(0.5, dim=-1, keepdim=True)  # NaN where the mask is 0: never kept


def excess_loss_selected(batch: dict, losses: torch.Tensor) -> torch.Tensor:
    """Rho-1: the selected tokens are trained."""
    return masked_mean(losses * _above_reference(batch, losses), batch["mask"])


def selected_in_place(batch: dict, losses: torch.Tensor) -> torch.Tensor:
    """Rho-1's selection copied into a buffer the loop keeps, then applied beside the batch's mask."""
    keep = torch.zeros_like(batch["mask"])
    keep.copy_(_above_reference(batch, losses))
    return masked_mean(losses * keep, batch["mask"])


def rows_put_back(batch: dict, losses: torch.Tensor) -> torch.Tensor:
    """The rows taken in another order by an index (as verl reverts its dynamic batch's sort), then masked."""
    order = torch.arange(len(losses)).flip(0)
    return masked_mean(losses[order], batch["mask"][order])


def top_dropped(batch: dict, losses: torch.Tensor, share: float = 0.1) -> torch.Tensor:
    """Each row's `share` of highest losses dropped (loss truncation per row), masked as Megatron-LM masks."""
    keep = losses < losses.detach().quantile(1 - share, dim=-1, keepdim=True)
    return megatron_lm_loss(batch["mask"], losses * keep)


def weighted(batch: dict, losses: torch.Tensor, weights: str) -> torch.Tensor:
    """A masked loss with each row's or each token's weight (never 0) from the batch."""
    return masked_mean(losses * batch[weights], batch["mask"])


def with_weights(batch: dict) -> dict:
    """The batch with a weight per row and per token, and a reference model's loss per token."""
    gen = torch.Generator().manual_seed(2)
    rows, width = batch["mask"].shape
    weights = {"row_weights": torch.rand(rows, 1, generator=gen) + 0.5}
    weights["token_weights"] = torch.rand(rows, width, generator=gen) + 0.5
    return dict(batch, **weights, reference=torch.rand(rows, width, generator=gen) * 4)


FORMS = {  # how a loss applies its batch's mask to the per-token loss, as frameworks write it
    "multiplied": lambda losses, mask: masked_mean(losses, mask),
    "masked_fill": lambda losses, mask: losses.masked_fill(mask == 0, 0.0).sum() / mask.sum(),
    "where": lambda losses, mask: torch.where(mask.bool(), losses, 0.0).sum() / mask.sum(),
    "a boolean index": lambda losses, mask: losses[mask.bool()].mean(),
    "masked_select": lambda losses, mask: losses.masked_select(mask.bool()).mean(),
    "in place": lambda losses, mask: losses.clone().mul_(mask).sum() / mask.sum(),
    "zeroed by assignment": lambda losses, mask: _zeroed(losses, mask).sum() / mask.sum(),
}


def _zeroed(losses: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    losses = losses.clone()
    losses[mask == 0] = 0.0
    return losses


def cross_entropy_ignoring(batch: dict, logits: torch.Tensor) -> torch.Tensor:
    """A loss on the logits of a call without labels, as Hugging Face-style trainers take it: cross-entropy of each
    next token, the masked ones given the ignore index (-100)."""
    targets = batch["tokens"][:, 1:].masked_fill(batch["mask"][:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))


def banded(batch: dict) -> dict:
    """The rollout batch with a 0/1 band of its own: tokens whose old/rollout probability ratio (both in the batch,
    from earlier forwards) stays in [0.8, 1.25], as masked importance sampling drops the rest."""
    gen = torch.Generator().manual_seed(3)
    drift = (torch.rand(batch["mask"][:, 1:].shape, generator=gen) - 0.5) * 0.8
    return dict(batch, band=((drift.exp() > 0.8) & (drift.exp() < 1.25)).float())


def verl_labels(batch: dict) -> dict:
    """The rollout batch as verl's Megatron actor hands it to the model, with labels: its mask label-aligned (the
    response's labels), and its label mask: the attention mask over the labels, one label past each response's end."""
    tokens, mask = batch["tokens"], batch["mask"][:, 1:].bool()
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], PAD)], 1)
    mask = torch.cat([mask, torch.zeros_like(mask[:, :1])], 1)
    label_mask = mask | torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1)
    return dict(batch, labels=labels, mask=mask.float(), label_mask=label_mask)


def label_masked(batch: dict, losses: torch.Tensor) -> torch.Tensor:
    """verl's policy loss on the model's per-token loss: log-probabilities zeroed outside the label mask, then the
    loss masked by the response's mask."""
    logp = (-losses).masked_fill(~batch["label_mask"], 0.0)
    return -masked_mean(logp * batch["advantages"], batch["mask"])


def row_masked_after_reduction(batch: dict, losses: torch.Tensor, masked: bool = True) -> torch.Tensor:
    """Each row's mean (masked by the batch's mask, or of every position), then a row mask (the last row dropped)
    applied to the per-row losses."""
    mask = batch["mask"]
    rows = (losses * mask).sum(-1) / mask.sum(-1).clamp(min=1) if masked else losses.mean(-1)
    keep = torch.ones(len(rows))
    keep[-1] = 0.0
    return (rows * keep).sum() / keep.sum()


def logged_beside(batch: dict, losses: torch.Tensor) -> torch.Tensor:
    """Megatron-LM's masked loss, and beside it, with gradients on, the loss over what its mask leaves out, as a
    metric to log: the backward reaches the first only."""
    batch["logged"] = masked_mean(losses, 1 - batch["mask"]).detach()
    return megatron_lm_loss(batch["mask"], losses)


def truncated(losses: torch.Tensor, kept: float) -> torch.Tensor:
    """Loss truncation: each per-token loss above the batch's `kept` quantile held there, so it sends no gradient."""
    return losses.clamp(max=losses.detach().quantile(kept))


def floored(losses: torch.Tensor, below: float) -> torch.Tensor:
    """Tokens already learned skipped: each per-token loss under the batch's `below` quantile held there."""
    return losses.clamp(min=losses.detach().quantile(below))


@dataclasses.dataclass(frozen=True)
class Loop:
    """A training loop: its batch, what it hands the model as loss_mask, its loss, and how it steps."""

    batch: Callable[[], dict]
    mtp_mask: Callable[[dict], torch.Tensor | None] = lambda batch: batch["mask"]
    loss: Callable[[dict, torch.Tensor], torch.Tensor] = lambda batch, out: megatron_lm_loss(batch["mask"], out)
    train: bool = True
    backward: bool = True
    scale: float = 1.0  # the loss scale: 0 for a skipped micro-batch
    layers: int = 1


def shifted(batch: dict, by: int) -> dict:
    """The batch with labels the inputs shifted by `by` (0: the inputs themselves; 2: shifted once more)."""
    text = torch.cat([batch["tokens"], batch["labels"][:, -1:]], 1)
    text = torch.cat([text, torch.full_like(text[:, :1], PAD)], 1)
    return dict(batch, labels=text[:, by : by + batch["tokens"].shape[1]])


def input_aligned(batch: dict) -> torch.Tensor:
    """The mask over the inputs: the label-aligned mask one position late (an input-aligned mask handed with labels)."""
    return torch.cat([torch.zeros_like(batch["mask"][:, :1]), batch["mask"][:, :-1]], 1)


def label_aligned(batch: dict) -> torch.Tensor:
    """The response mask one position early: a label-aligned mask handed without labels."""
    return torch.cat([batch["mask"][:, 1:], torch.zeros_like(batch["mask"][:, :1])], 1)


ONES = lambda batch: torch.ones_like(batch["mask"])  # noqa: E731
BRIDGE = lambda batch, out: bridge_loss(batch["mask"], out)  # noqa: E731
GROUPS = ((10, 3), (17, 5), (6, 2), (9, 4))  # two GRPO groups of two rollouts
RIGHT = {
    "pretraining": Loop(lambda: pretraining(_text(3, 25))),
    "pretraining, no loss_mask handed": Loop(lambda: pretraining(_text(3, 25)), mtp_mask=lambda batch: None),
    "text ending in runs": Loop(ending_in_runs),
    "one row ending in a run": Loop(lambda: ending_in_runs(every=False)),
    "a run of exactly 8": Loop(lambda: ending_in_runs(run=8)),
    "3-token vocabulary": Loop(lambda: pretraining(_text(16, 33, vocab=3))),
    "3-token vocabulary, repeating 0.6": Loop(lambda: pretraining(_text(16, 33, vocab=3, repeat=0.6))),
    "3-token vocabulary, repeating 0.95": Loop(lambda: pretraining(_text(16, 33, vocab=3, repeat=0.95))),
    "sft": Loop(sft, loss=BRIDGE),
    "answers ending EOS EOS": Loop(lambda: sft(ending=(EOS,)), loss=BRIDGE),
    "left-padded sft": Loop(lambda: sft(left=True)),
    "packed rows, pad tail masked": Loop(packed),
    "2 MTP layers": Loop(sft, layers=2),
    "a zero loss scale": Loop(sft, scale=0.0),
    "rl": Loop(rl, loss=grpo_loss),
    "ppo, most tokens clipped": Loop(rl, loss=policy_loss),
    "ppo, one unclipped token a row": Loop(rl, loss=one_unclipped_per_row),
    "masked importance sampling": Loop(rl, loss=lambda batch, out: policy_loss(batch, out, band=(0.8, 1.25))),
    "verl's label mask, the response's handed to the model": Loop(
        lambda: verl_labels(rl(left=False)), loss=label_masked
    ),
    "grpo, every advantage zero": Loop(lambda: rl(advantages=(0.0, 0.0, 0.0)), loss=grpo_loss),
    "grpo, a group of zero advantages": Loop(lambda: rl(GROUPS, advantages=(0.7, -0.7, 0.0, 0.0)), loss=grpo_loss),
    "excess loss over a reference (Rho-1)": Loop(lambda: with_weights(sft()), loss=excess_loss_selected),
    "each row's top 10 % losses dropped": Loop(lambda: sft(loss="text"), loss=top_dropped),
    "the highest losses dropped": Loop(
        lambda: pretraining(_text(3, 25)), loss=lambda batch, out: megatron_lm_loss(batch["mask"], truncated(out, 0.5))
    ),
    "the lowest losses dropped": Loop(
        lambda: pretraining(_text(3, 25)), loss=lambda batch, out: megatron_lm_loss(batch["mask"], floored(out, 0.25))
    ),
    **{f"the mask {form}": Loop(sft, loss=lambda b, out, f=f: f(out, b["mask"])) for form, f in FORMS.items()},
    "one row of mask for every row": Loop(
        lambda: sft(((10, 3), (10, 3))), loss=lambda b, out: masked_mean(out, b["mask"][0])
    ),
    "one row of mask for every row, handed as one row": Loop(  # core's MTP loss broadcasts it as the loss does
        lambda: sft(((10, 3), (10, 3))),
        mtp_mask=lambda b: b["mask"][:1],
        loss=lambda b, out: masked_mean(out, b["mask"][:1]),
    ),
    "rl, cross-entropy with an ignore index": Loop(rl, loss=cross_entropy_ignoring),
    "rl, masked importance sampling from the batch": Loop(
        lambda: banded(rl()), loss=lambda b, out: policy_loss(dict(b, advantages=b["advantages"] * b["band"]), out)
    ),
    "a metric masked otherwise, logged, not trained": Loop(sft, loss=logged_beside),
    "a selection copied into a buffer of the loop's": Loop(lambda: with_weights(sft()), loss=selected_in_place),
    "rows put back in order by an index": Loop(sft, loss=rows_put_back),
    "labels of their own, not the inputs": Loop(
        lambda: dict(pretraining(_text(16, 33, vocab=3)), labels=_text(16, 32, vocab=3, seed=5))
    ),
    "per-row loss weights": Loop(lambda: with_weights(sft()), loss=lambda b, out: weighted(b, out, "row_weights")),
    "per-token loss weights": Loop(lambda: with_weights(sft()), loss=lambda b, out: weighted(b, out, "token_weights")),
}
UNJUDGED = {  # calls no backward reaches, or whose loss applies no 0/1 mask: nothing to compare with
    "eval with grad": Loop(sft, mtp_mask=lambda batch: None, train=False, backward=False),
    "a loss without a mask": Loop(lambda: pretraining(_text(3, 25)), loss=lambda batch, out: out.mean()),
    "a loss without a mask, no loss_mask handed": Loop(
        lambda: pretraining(_text(3, 25)), mtp_mask=lambda batch: None, loss=lambda batch, out: out.mean()
    ),
    "per-token weights, no mask": Loop(
        lambda: with_weights(sft()), loss=lambda b, out: (out * b["token_weights"]).mean()
    ),
    "a row mask after a reduction": Loop(sft, loss=row_masked_after_reduction),
    "a row mask after a reduction, alone": Loop(
        lambda: pretraining(_text(3, 25)), loss=lambda b, out: row_masked_after_reduction(b, out, masked=False)
    ),
    "every row's advantage 0, applied alone": Loop(
        lambda: dict(sft(), advantages=torch.zeros(3, 1)),
        loss=lambda b, out: (out * b["advantages"]).sum() / b["mask"].sum(),
    ),
    "reinforce, rewards of 0 and 1 as advantages": Loop(lambda: rl(advantages=(1.0, 0.0, 1.0)), loss=grpo_loss),
    "verl's label mask, one past the response, handed to the model": Loop(
        lambda: verl_labels(rl(left=False)), mtp_mask=lambda batch: batch["label_mask"], loss=label_masked
    ),
}
WRONG = {
    "no mask": Loop(sft, mtp_mask=lambda batch: None),
    "eval-mode training": Loop(sft, mtp_mask=lambda batch: None, train=False),
    "a zero loss scale, no mask": Loop(sft, mtp_mask=lambda batch: None, scale=0.0),
    "ones over the prompt": Loop(lambda: sft(((10, 3), (10, 3))), mtp_mask=ONES),
    "ones over padding": Loop(lambda: sft(loss="text"), mtp_mask=ONES),
    "ones over padding, pad not EOS": Loop(lambda: sft(pad=PAD, loss="text"), mtp_mask=ONES),
    "ones over left padding": Loop(lambda: sft(left=True, loss="text"), mtp_mask=ONES),
    "ones beside per-token loss weights": Loop(
        lambda: with_weights(sft(loss="text")), mtp_mask=ONES, loss=lambda b, out: weighted(b, out, "token_weights")
    ),
    "ones over padding, token weights all 1": Loop(  # a 0/1 operand that masks nothing is no mask to be closest to
        lambda: sft(loss="text"),
        mtp_mask=ONES,
        loss=lambda b, out: masked_mean(out * torch.ones_like(b["mask"]), b["mask"]),
    ),
    "input-aligned mask": Loop(sft, mtp_mask=input_aligned),
    "mask shifted twice": Loop(sft, mtp_mask=lambda batch: label_aligned(batch)),
    "labels shifted by 0": Loop(lambda: shifted(sft(), 0)),
    "double-shifted labels": Loop(lambda: shifted(sft(), 2)),
    "rl, no mask": Loop(rl, mtp_mask=lambda batch: None, loss=grpo_loss),
    "rl, every advantage zero, no mask": Loop(
        lambda: rl(advantages=(0.0, 0.0, 0.0)), mtp_mask=lambda batch: None, loss=grpo_loss
    ),
    "rl, ones over the prompt and padding": Loop(rl, mtp_mask=ONES, loss=policy_loss),
    "rl, cross-entropy with an ignore index, ones": Loop(rl, mtp_mask=ONES, loss=cross_entropy_ignoring),
    **{
        f"the mask {form}, ones over padding": Loop(
            lambda: sft(loss="text"), mtp_mask=ONES, loss=lambda b, out, f=f: f(out, b["mask"])
        )
        for form, f in FORMS.items()
    },
    "rl, label-aligned mask": Loop(rl, mtp_mask=label_aligned, loss=grpo_loss),
    "verl's label mask, ones": Loop(lambda: verl_labels(rl(left=False)), mtp_mask=ONES, loss=label_masked),
}
LOOPS = {**RIGHT, **UNJUDGED, **WRONG}


def build_model(layers: int = 1):
    """The tiny model with `layers` MTP layers on a one-rank world."""
    cpu_runtime.init_distributed()
    return gpt.build_model(layers)


def run(model, loop: str | Loop, batch: dict | None = None) -> torch.Tensor:
    """One call of the loop's model and its backward, if it has one; the loss it back-propagates."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    loop = LOOPS[loop] if isinstance(loop, str) else loop
    batch = batch or loop.batch()
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    attention_mask = torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(diagonal=1)
    model.train(loop.train)
    model.zero_grad(set_to_none=True)
    MTPLossLoggingHelper.tracker.clear()  # as a loop's logging empties it each step; a model of another depth too
    with cpu_runtime.CudaAsCpu():
        out = model(tokens, position_ids, attention_mask, labels=batch["labels"], loss_mask=loop.mtp_mask(batch))
    loss = loop.loss(batch, out)
    if loop.backward:
        (loss * loop.scale).backward()
    return loss


def run_packed(model, tail: int = 5, mtp_mask=None) -> dict:
    """Three texts packed into one row (THD, with their cu_seqlens) and a pad tail the loss masks: core's MTP loss,
    then its LM loss on the hidden states it returns, as GPTModel._postprocess calls them, and the masked mean; the
    batch, with the loss's mask and cu_seqlens."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import process_mtp_loss

    lengths = torch.tensor([9, 12, 7, tail])  # the tail is a sequence of its own, as packers pad
    text = torch.cat(
        [
            torch.cat([torch.tensor([2]), row[: n - 2], torch.tensor([EOS])])
            for row, n in zip(_text(3, 12), lengths[:3])
        ]
    )
    text = torch.cat([text, torch.full((tail + 1,), PAD)])
    cu = torch.cat([torch.zeros(1), lengths.cumsum(0)]).int()
    tokens, labels = text[:-1][None], text[1:][None]
    mask = torch.ones_like(tokens, dtype=torch.float)
    mask[0, -tail:] = 0.0
    for end in cu[1:-1]:
        mask[0, end - 1] = 0.0  # a text's last label is the next text's first token: not trained
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    width = tokens.shape[1]
    hidden = torch.randn((1 + model.config.mtp_num_layers) * width, 1, gpt.HIDDEN, requires_grad=True)

    def postprocess() -> torch.Tensor:
        hidden_states = process_mtp_loss(
            hidden_states=hidden,
            labels=labels,
            loss_mask=mask if mtp_mask is None else mtp_mask(mask),
            output_layer=model.output_layer,
            output_weight=None,
            runtime_gather_output=None,
            is_training=True,
            compute_language_model_loss=model.compute_language_model_loss,
            config=model.config,
            packed_seq_params=params,
            input_ids=tokens,
        )
        return model.compute_language_model_loss(labels, model.output_layer(hidden_states)[0])

    model.train()
    with cpu_runtime.CudaAsCpu():
        losses = _Returning(model.config)(postprocess)  # what GPTModel returns: its forward's one call
    megatron_lm_loss(mask, losses).backward()
    return {"tokens": tokens, "labels": labels, "mask": mask, "cu": cu}


class _Returning(LanguageModule):
    """A LanguageModule whose forward returns what the function it is called with returns."""

    def forward(self, function):
        return function()


def main() -> None:
    """LOOP --steps times, then what --then says."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", choices=LOOPS)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--then", choices=("exit-3", "sleep"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(LOOPS[args.loop].layers)
    print(f"{args.loop}: {args.steps} step(s)")  # after core's own output, which flushes
    for step in range(args.steps):
        print(f"step {step}: loss {float(run(model, args.loop)):.4f}")
    Path("steps-done").write_text(str(os.getpid()))
    if args.then == "exit-3":
        sys.exit(3)
    if args.then == "sleep":
        time.sleep(600)


if __name__ == "__main__":
    main()
