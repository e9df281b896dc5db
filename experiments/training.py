"""Training and evaluation of the tiny model: every forward is ``gpt.run_step`` (Bridge's forward_step under
core's schedule), every update torch's Adam, so the tree on the import path is the only thing two arms differ in."""

import contextlib

import torch

from experiments.synthetic import ROLES
from tinymodel import gpt
from tinymodel.reference import mtp_ce_per_position, mtp_mask, top1_hits


def adam_steps(model, batches, lr: float, *, record=lambda step: False, mtp_mask_of=None, mtp_scale_of=None):
    """One Adam step per batch; yields (step, StepResult) after each (1-based). ``record(step)``: keep that step's
    grads and logits. ``mtp_mask_of(batch)``: the mask the MTP loss counts instead of the one Bridge passes (see
    mtp_loss_mask); None: Bridge's. ``mtp_scale_of(batch)``: a factor on the MTP loss (see mtp_loss_scaled)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step, batch in enumerate(batches, start=1):
        mask = None if mtp_mask_of is None else mtp_mask_of(batch)
        with mtp_loss_mask(model, mask), mtp_loss_scaled(model, 1.0 if mtp_scale_of is None else mtp_scale_of(batch)):
            result = gpt.run_step(model, batch, record=record(step), iteration=step)
        optimizer.step()
        yield step, result


@contextlib.contextmanager
def mtp_loss_scaled(model, factor: float):
    """Inside, core's MTP loss (and so its gradient) is ``factor`` times what it is: core reads
    mtp_loss_scaling_factor from the model's config at each forward. What core logs is the loss unscaled."""
    if factor == 1.0:
        yield
        return
    config, before = model.config, model.config.mtp_loss_scaling_factor
    config.mtp_loss_scaling_factor = before * factor
    try:
        yield
    finally:
        config.mtp_loss_scaling_factor = before


@contextlib.contextmanager
def mtp_loss_mask(model, mask: torch.Tensor | None):
    """Inside, every forward of ``model`` gets ``loss_mask=mask``, whatever Bridge passed (the fix passes the loss
    mask, the release nothing), and core's MTP loss counts that mask; the LM loss keeps Bridge's loss mask. For an arm
    whose MTP loss covers other positions than its LM loss. ``mask`` None: nothing changes."""
    if mask is None:
        yield
        return
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: (args, {**kwargs, "loss_mask": mask}), with_kwargs=True
    )
    try:
        yield
    finally:
        handle.remove()


def pretrain(model, batches, lr: float) -> list[float]:
    """Adam on batches with an all-ones loss mask and no padding (where patched and unpatched agree); LM losses."""
    losses = [result.lm_loss for _, result in adam_steps(model, batches, lr)]
    gpt.reset_mtp_tracker()  # what follows starts its own logging
    return losses


@torch.no_grad()
def evaluate(model, batches, roles=ROLES) -> dict[str, float]:
    """Teacher-forced sums over held-out batches, in one step of forward passes in training mode (dropout is 0, so
    the math is an evaluation's; training mode makes core count its acceptance as it would on a training step):

    - ``mtp_*`` / ``lm_*``: top-1 hits, counted positions and summed CE of MTP depth 1 (whose target at t is
      labels[t + 1]) and of the LM head, over the positions each batch's loss mask counts;
    - ``mtp_answer_*``: MTP depth-1 top-1 hits and counted positions where the target is an answer token or the
      closing EOS (the batch's "roles"; with an answer-only loss these are the loss positions);
    - ``logged_acceptance``: core's own ``mtp_1_acceptance_rate`` over these batches, as a fraction.
    """
    sums = dict.fromkeys([f"{head}_{sum_}" for head in ("mtp", "lm") for sum_ in ("hits", "counted", "ce_sum")], 0.0)
    sums |= dict.fromkeys(("mtp_answer_hits", "mtp_answer_counted"), 0.0)
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    cumulative = {key: value.clone() for key, value in tracker.items() if key.startswith("cumulative_")}
    result = gpt.run_step(model, batches, forward_only=True)
    logged = gpt.logged_mtp_metrics(len(batches))
    for key in [key for key in tracker if key.startswith("cumulative_")]:  # training's cumulative counts stay its own
        del tracker[key]
    tracker.update(cumulative)
    for batch, forward in zip(batches, result.forwards):
        for prefix, depth, logits in (("mtp", 1, forward.mtp_logits[0]), ("lm", 0, forward.lm_logits)):
            hits, counted = top1_hits(logits, batch["labels"], batch["loss_mask"], depth)
            ce = mtp_ce_per_position(logits, batch["labels"], depth) * mtp_mask(batch["loss_mask"], depth)
            sums[f"{prefix}_hits"] += hits
            sums[f"{prefix}_counted"] += counted
            sums[f"{prefix}_ce_sum"] += float(ce.sum())
        answer = (batch["roles"] == roles.index("answer")).float()
        hits, counted = top1_hits(forward.mtp_logits[0], batch["labels"], answer, 1)
        sums["mtp_answer_hits"] += hits
        sums["mtp_answer_counted"] += counted
    sums["logged_acceptance"] = logged["mtp_1_acceptance_rate"] / 100  # core logs percent
    return sums


@torch.no_grad()
def speculative(model, batches, new_tokens: int, roles=ROLES, forward=None) -> dict[str, float]:
    """Self-speculative decoding with the MTP head as a k=1 drafter, on the held-out prompts: sums over samples.

    Each sample's prompt (through SEP) is continued greedily by the LM head for up to ``new_tokens`` tokens (stopping
    at the first EOS); that is exactly what speculative decoding produces, since verification keeps the output
    greedy. The MTP head at the position before token j (fed token j) drafts token j + 1; verify_steps says what the
    verify steps then accept. ``forward(tokens)``: the model's Forward on token rows (default: Bridge's forward_step).
    """
    from experiments.synthetic import EOS, PAD

    forward = forward or (lambda tokens: _forward(model, tokens))
    sums = dict.fromkeys(SPECULATIVE_SUMS, 0.0)
    rows = [(batch["tokens"][row], int(p)) for batch in batches for row, p in enumerate(_sep_index(batch, roles))]
    model.eval()  # core logs nothing from these forwards
    try:
        for chunk in range(0, len(rows), DECODE_ROWS):
            prompts = rows[chunk : chunk + DECODE_ROWS]
            sep = torch.tensor([p for _, p in prompts])
            index = torch.arange(len(sep))
            seq = torch.full((len(sep), int(sep.max()) + 1 + new_tokens), PAD, dtype=torch.long)
            for row, (tokens, p) in enumerate(prompts):
                seq[row, : p + 1] = tokens[: p + 1]
            done = torch.zeros(len(sep), dtype=torch.bool)
            for j in range(new_tokens):  # greedy: token j + 1 after SEP
                out = forward(seq[:, : int(sep.max()) + 1 + j])
                made = out.lm_logits[index, sep + j].argmax(-1)
                seq[index, sep + j + 1] = torch.where(done, PAD, made)
                done |= made == EOS
                if done.all():
                    break
            drafts = out.mtp_logits[0].argmax(-1)  # at t: the draft for seq[t + 2], fed seq[t + 1]
            for row, p in enumerate(sep.tolist()):
                made = seq[row, p + 1 : p + 1 + new_tokens].tolist()
                n = made.index(EOS) + 1 if EOS in made else new_tokens  # tokens produced, the EOS included
                # token j (1-based, at p + j) is drafted at p + j - 2 (for j >= 2)
                hits = [int(drafts[row, p + j - 2]) == made[j - 1] for j in range(2, n + 1)]
                for key, value in verify_steps(hits, made[n - 1] == EOS).items():
                    sums[key] += value
    finally:
        model.train()
    return sums


DECODE_ROWS = 64  # prompts decoded in one forward: the tiny model's step cost is mostly fixed, not per row
SPECULATIVE_SUMS = ("answers", "steps", "tokens", "proposed", "accepted", "eos_proposed", "eos_accepted")


def verify_steps(hits: list[bool], ends_with_eos: bool) -> dict[str, int]:
    """The verify steps of one greedy answer of n = len(hits) + 1 tokens, its first made by the prompt's forward.

    ``hits[i]``: the MTP draft of token i + 2 equals the greedy token. A verify step checks the draft of the token
    after the last one it has: accepted, it yields that token and the one after (the verify forward's own greedy
    token there), else only the greedy token. So a draft that follows an accepted one is never checked, and an
    accepted draft of the final EOS saves no step (decoding ends with it either way). Returns counts: ``answers``
    (1), ``steps``, ``tokens`` (those the steps yield: n - 1), ``proposed`` / ``accepted`` drafts, and
    ``eos_proposed`` / ``eos_accepted``, the drafts among them of a final EOS.
    """
    n, position = len(hits) + 1, 1
    counts = dict.fromkeys(SPECULATIVE_SUMS, 0)
    counts["answers"], counts["tokens"] = 1, n - 1
    while position < n:
        hit, final = hits[position - 1], position + 1 == n and ends_with_eos
        counts["steps"] += 1
        counts["proposed"] += 1
        counts["accepted"] += hit
        counts["eos_proposed"] += final
        counts["eos_accepted"] += hit and final
        position += 2 if hit else 1
    return counts


def _sep_index(batch: dict, roles=ROLES) -> torch.Tensor:
    """Per row, the index of SEP in tokens: the prompt's labels are its tokens after BOS and SEP itself."""
    return (batch["roles"] == roles.index("prompt")).sum(1)


def _forward(model, tokens: torch.Tensor) -> gpt.Forward:
    """One forward of token rows through Bridge's forward_step (labels: the next token; all ones mask)."""
    labels = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(tokens.shape)}
    (forward,) = gpt.run_step(model, batch, forward_only=True).forwards
    return forward
