"""Training and evaluation of the tiny model: every forward is ``gpt.run_step`` (Bridge's forward_step under
core's schedule), every update torch's Adam, so the tree on the import path is the only thing two arms differ in."""

import torch

from experiments.synthetic import ROLES
from tinymodel import gpt
from tinymodel.reference import mtp_ce_per_position, mtp_mask, top1_hits


def adam_steps(model, batches, lr: float, *, record=lambda step: False):
    """One Adam step per batch; yields (step, StepResult) after each (1-based). ``record(step)``: keep that step's
    grads and logits."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step, batch in enumerate(batches, start=1):
        result = gpt.run_step(model, batch, record=record(step), iteration=step)
        optimizer.step()
        yield step, result


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
    sums = dict.fromkeys(
        (
            "mtp_hits",
            "mtp_counted",
            "mtp_ce_sum",
            "lm_hits",
            "lm_counted",
            "lm_ce_sum",
            "mtp_answer_hits",
            "mtp_answer_counted",
        ),
        0.0,
    )
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
def speculative(model, batches, new_tokens: int, roles=ROLES) -> dict[str, float]:
    """Self-speculative decoding with the MTP head as a k=1 drafter, on the held-out prompts: sums over samples.

    Each sample's prompt (through SEP) is continued greedily by the LM head for up to ``new_tokens`` tokens (stopping
    at the first EOS); that is exactly what speculative decoding produces, since verification keeps the output
    greedy. At the step that produced token j, the MTP head (at the position before it, fed token j) drafts token
    j + 1; the next verify step accepts the draft iff it equals the LM head's greedy token there, and then yields
    two tokens, otherwise one. Sums: ``spec_accepted`` / ``spec_proposed`` drafts, ``spec_steps`` verify steps and
    ``spec_tokens`` the tokens they produced (every token after the first, which the prompt's forward yields).
    """
    from experiments.synthetic import EOS, PAD

    sums = dict.fromkeys(("spec_accepted", "spec_proposed", "spec_steps", "spec_tokens"), 0.0)
    model.eval()  # core logs nothing from these forwards
    try:
        for batch in batches:
            sep = (batch["roles"] == roles.index("prompt")).sum(1)  # tokens[p] is SEP, p = the prompt's length
            rows = torch.arange(len(sep))
            seq = torch.full((len(sep), int(sep.max()) + 1 + new_tokens), PAD, dtype=torch.long)
            for row, p in enumerate(sep.tolist()):
                seq[row, : p + 1] = batch["tokens"][row, : p + 1]
            for j in range(new_tokens):  # greedy: token j + 1 after SEP
                forward = _forward(model, seq)
                seq[rows, sep + j + 1] = forward.lm_logits[rows, sep + j].argmax(-1)
            drafts = forward.mtp_logits[0].argmax(-1)  # at t: the draft for seq[t + 2], fed seq[t + 1]
            for row, p in enumerate(sep.tolist()):
                made = seq[row, p + 1 : p + 1 + new_tokens]
                eos = (made == EOS).nonzero()
                n = int(eos[0]) + 1 if len(eos) else new_tokens  # tokens produced, the EOS included
                # token j (1-based, at p + j) is drafted at p + j - 2 (for j >= 2)
                accepted = [bool(drafts[row, p + j - 2] == made[j - 1]) for j in range(2, n + 1)]
                position = 1
                while position < n:  # one verify step: check the draft of token position + 1
                    sums["spec_steps"] += 1
                    sums["spec_proposed"] += 1
                    hit = accepted[position - 1]
                    sums["spec_accepted"] += hit
                    position += 2 if hit else 1
                sums["spec_tokens"] += n - 1
    finally:
        model.train()
    return sums


def _forward(model, tokens: torch.Tensor) -> gpt.Forward:
    """One forward of token rows through Bridge's forward_step (labels: the next token; all ones mask)."""
    labels = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(tokens.shape)}
    (forward,) = gpt.run_step(model, batch, forward_only=True).forwards
    return forward
