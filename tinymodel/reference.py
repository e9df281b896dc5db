"""Reference values in plain torch (no megatron): what the logged MTP figures should equal, and the perturbation.

Label-aligned convention (Bridge's): labels[t] = tokens[t + 1]; loss_mask[t] = 1 iff labels[t] counts. MTP depth k at
position t predicts labels[t + k] and counts iff loss_mask[t + k] (core rolls labels and mask left once per depth, and
without a mask falls back to all ones, rolled the same way).
"""

import torch
import torch.nn.functional as F


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


REL = 1e-5  # fp32: core's vocab-parallel CE vs torch's cross_entropy on the same logits


def masked_ce(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, depth: int, mask_offset: int = 0
) -> tuple[float, float]:
    """(sum of the CE of depth ``depth`` (0: the LM head) over the positions the mask counts, their number)."""
    ce = mtp_ce_per_position(logits, labels, depth)
    mask = mtp_mask(loss_mask, depth, mask_offset)
    return float((ce * mask).sum()), float(mask.sum())


def reference_mtp_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, depth: int, mask_offset: int = 0
) -> float:
    """Masked mean CE of depth ``depth``; ``mask_offset=1`` is the value a once-more-shifted mask would give."""
    total, count = masked_ce(logits, labels, loss_mask, depth, mask_offset)
    return total / count


def top1_hits(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, depth: int) -> tuple[int, int]:
    """(correct, counted): top-1 predictions of depth ``depth`` (0: the LM head) that hit their target, over the
    positions the mask counts."""
    seq = labels.shape[1]
    mask = mtp_mask(loss_mask, depth).bool()
    hits = (logits[:, mtp_positions(seq, depth)].argmax(-1) == labels[:, depth:]) & mask
    return int(hits.sum()), int(mask.sum())


def loss_mass_on_masked(ce: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of the MTP loss at masked positions: sum of weight * CE there over the sum everywhere.

    ``weight`` is each position's weight in the step loss as core applied it (the gradient reaching its CE), so with
    an all-ones mask this is sum(CE at masked) / sum(CE), and with the right mask it is 0.
    """
    counted = weight * ce
    return float(counted[mask == 0].sum() / counted.sum())


def perturb_masked_positions(batch: dict[str, torch.Tensor], *, vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Change every label whose loss_mask is 0, and every token strictly after each sample's answer.

    Those tokens feed only later, all-masked positions (causal attention; MTP depth k at t embeds token t + k and
    counts iff loss_mask[t + k]), so a correctly masked loss is exactly unchanged. Prompt tokens stay: later
    answer positions attend to them.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {key: value.clone() for key, value in batch.items()}
    masked = out["loss_mask"] == 0
    out["labels"][masked] = torch.randint(2, vocab, (int(masked.sum()),), generator=gen)
    seq = out["tokens"].shape[1]
    for row in range(out["tokens"].shape[0]):
        last_loss = int(out["loss_mask"][row].nonzero().max())
        first_free = last_loss + 2  # tokens[last_loss + 1] is the last answer token (labels[last_loss])
        if first_free < seq:
            out["tokens"][row, first_free:] = torch.randint(2, vocab, (seq - first_free,), generator=gen)
    return out


def changed_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the gradients that are not bit-identical (or exist on one side only)."""
    return sorted(a.keys() ^ b.keys()) + [name for name in a if name in b and not torch.equal(a[name], b[name])]
