"""Synthetic text that the tiny model (and its MTP head) can learn: sparse random Markov chains. No megatron here.

Token ids: 1 = PAD = EOS (as in the report), 2 = SEP (ends a prompt), 3..vocab-1 content.
  pretraining: documents drawn from chain A (each token has ``branching`` successors with fixed probabilities),
               packed with EOS between documents, no padding, every position counts;
  SFT:         prompt (a chain's text, or uniform random tokens) + SEP + answer (the answer chain continuing from the
               last prompt token) + EOS, padded with PAD (= EOS) to the batch's longest sample (or to a fixed
               length); the loss covers the answer (the answer tokens and the EOS) or the whole sample (every label
               but the padding).
"""

from dataclasses import dataclass

import torch


PAD = EOS = 1
SEP = 2
FIRST = 3
ROLES = ("prompt", "answer", "padding")  # what a label position holds: sft_batch's "roles" are indices into this


@dataclass
class Chain:
    """A Markov chain over token ids: each token has the same number of successors, with the same probabilities."""

    successors: torch.Tensor  # [vocab, branching] next-token ids
    probs: torch.Tensor  # [branching], the same for every token

    def step(self, current: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """One successor of each token in ``current``."""
        pick = torch.multinomial(self.probs, current.numel(), replacement=True, generator=gen)
        return self.successors[current, pick]

    def walk(self, start: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
        """[n, length] continuation of each start token (start itself excluded)."""
        out, current = [], start
        for _ in range(length):
            current = self.step(current, gen)
            out.append(current)
        return torch.stack(out, 1) if out else start.new_zeros(len(start), 0)


def make_chain(vocab: int, seed: int, branching: int = 3, probs=(0.8, 0.15, 0.05)) -> Chain:
    """Random successors (content tokens only) for every token id, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(FIRST, vocab, (vocab, branching), generator=gen)
    return Chain(successors, torch.tensor(probs))


def pretrain_batch(chain: Chain, vocab: int, batch: int, seq: int, gen, mean_doc_len: int = 24) -> dict:
    """Packed documents of chain A with EOS between them (a document ends after each token with probability
    1/mean_doc_len; the next starts at a uniform random token); loss on every position."""
    current = torch.randint(FIRST, vocab, (batch,), generator=gen)
    columns = [current]
    for _ in range(seq):
        fresh = torch.randint(FIRST, vocab, (batch,), generator=gen)
        ends = torch.rand(batch, generator=gen) < 1 / mean_doc_len
        nxt = torch.where(current == EOS, fresh, chain.step(current.clamp(min=FIRST), gen))
        current = torch.where(ends & (current != EOS), torch.full_like(current, EOS), nxt)
        columns.append(current)
    text = torch.stack(columns, 1)
    return {"tokens": text[:, :-1].clone(), "labels": text[:, 1:].clone(), "loss_mask": torch.ones(batch, seq)}


@dataclass
class SftSetting:
    """How SFT samples are made: where prompts come from, their and the answers' lengths, the padding and the loss."""

    name: str
    random_prompts: bool  # prompts of uniform random tokens instead of the prompt chain's text
    prompt_len: tuple[int, int] = (8, 24)  # uniform in [min, max], or min + a long tail (prompt_tail) cut at max
    answer_len: tuple[int, int] = (3, 8)  # content tokens; + EOS
    pad_to: int | None = None  # None: pad to the batch's longest sample
    loss: str = "answer"  # "answer": answer tokens and the closing EOS; "sample": every label but the padding
    prompt_tail: float | None = None  # mean of an exponential tail added to prompt_len[0] (None: uniform lengths)

    def prompt_lengths(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        """Each sample's prompt length."""
        low, high = self.prompt_len
        if self.prompt_tail is None:
            return torch.randint(low, high + 1, (batch,), generator=gen)
        tail = -self.prompt_tail * torch.log1p(-torch.rand(batch, generator=gen))  # exponential, mean prompt_tail
        return (low + tail.floor().long()).clamp(max=high)


def sft_batch(chain_a: Chain, chain_b: Chain, setting: SftSetting, vocab: int, batch: int, gen) -> dict:
    """Label-aligned SFT batch (prompts from chain_a, answers continuing under chain_b), with the role (index into
    ROLES) of each label position."""
    p_lens = setting.prompt_lengths(batch, gen)
    a_lens = torch.randint(setting.answer_len[0], setting.answer_len[1] + 1, (batch,), generator=gen)
    start = torch.randint(FIRST, vocab, (batch,), generator=gen)
    if setting.random_prompts:
        prompts = torch.randint(FIRST, vocab, (batch, setting.prompt_len[1]), generator=gen)
    else:
        prompts = torch.cat([start[:, None], chain_a.walk(start, setting.prompt_len[1] - 1, gen)], 1)
    last = prompts[torch.arange(batch), p_lens - 1]
    answers = chain_b.walk(last, setting.answer_len[1], gen)
    texts = [
        torch.cat([prompts[i, :p], torch.tensor([SEP]), answers[i, :a], torch.tensor([EOS])])
        for i, (p, a) in enumerate(zip(p_lens.tolist(), a_lens.tolist()))
    ]
    seq = setting.pad_to or max(len(t) for t in texts) - 1
    tokens = torch.full((batch, seq), PAD, dtype=torch.long)
    labels = torch.full((batch, seq), PAD, dtype=torch.long)
    loss_mask = torch.zeros(batch, seq)
    roles = torch.full((batch, seq), ROLES.index("padding"), dtype=torch.long)
    for row, (text, p) in enumerate(zip(texts, p_lens.tolist())):
        n = len(text) - 1
        tokens[row, :n] = text[:-1]
        labels[row, :n] = text[1:]
        # labels[p:n] are the answer tokens and the closing EOS (text[p] is SEP); labels[:p] the prompt's and SEP
        loss_mask[row, p if setting.loss == "answer" else 0 : n] = 1.0
        roles[row, :p] = ROLES.index("prompt")
        roles[row, p:n] = ROLES.index("answer")
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "roles": roles}
