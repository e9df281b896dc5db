"""Training and evaluation of the tiny model: every forward is ``tiny_mtp.run_step`` (Bridge's forward_step under
core's schedule), every update torch's Adam, so the tree on the import path is the only thing two arms differ in."""

import torch

from tests.support import tiny_mtp
from tests.support.reference import mtp_ce_per_position, mtp_mask, top1_hits


def adam_steps(model, batches, lr: float, *, record=lambda step: False):
    """One Adam step per batch; yields (step, StepResult) after each (1-based). ``record(step)``: keep that step's
    grads and logits."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step, batch in enumerate(batches, start=1):
        result = tiny_mtp.run_step(model, batch, record=record(step), iteration=step)
        optimizer.step()
        yield step, result


def pretrain(model, batches, lr: float) -> list[float]:
    """Adam on batches with an all-ones loss mask and no padding (where patched and unpatched agree); LM losses."""
    losses = [result.lm_loss for _, result in adam_steps(model, batches, lr)]
    tiny_mtp.reset_mtp_tracker()  # what follows starts its own logging
    return losses


@torch.no_grad()
def evaluate(model, batches) -> dict[str, float]:
    """Held-out sums over the positions each batch's loss mask counts: top-1 hits, counted positions and summed CE of
    MTP depth 1 (whose target at t is labels[t + 1]) and of the LM head."""
    sums = dict.fromkeys(("mtp_hits", "mtp_counted", "mtp_ce_sum", "lm_hits", "lm_counted", "lm_ce_sum"), 0.0)
    model.eval()  # core logs nothing from an eval forward
    try:
        for batch in batches:
            (forward,) = tiny_mtp.run_step(model, batch, forward_only=True).forwards
            for prefix, depth, logits in (("mtp", 1, forward.mtp_logits[0]), ("lm", 0, forward.lm_logits)):
                hits, counted = top1_hits(logits, batch["labels"], batch["loss_mask"], depth)
                ce = mtp_ce_per_position(logits, batch["labels"], depth) * mtp_mask(batch["loss_mask"], depth)
                sums[f"{prefix}_hits"] += hits
                sums[f"{prefix}_counted"] += counted
                sums[f"{prefix}_ce_sum"] += float(ce.sum())
    finally:
        model.train()
    return sums
