"""Synthetic text that the tiny model (and its MTP head) can learn: sparse random Markov chains. No megatron here.

Token ids: 0 = BOS, 1 = PAD = EOS (as in the report: pad id 1 = eos, and the model predicts token 0 after it), 2 = SEP
(ends a prompt), 3..vocab-1 content.
  pretraining: documents drawn from chain A (each token has ``branching`` successors with fixed probabilities), each
               BOS + text + EOS, packed back to back with no padding, every position counted: after EOS always
               comes BOS, which is what the report's model had learnt;
  SFT:         BOS + prompt (a chain's text, or uniform random tokens) + SEP + answer (the answer chain continuing from
               the last prompt token) + EOS, padded with PAD (= EOS) to the batch's longest sample or to a fixed
               length; the loss covers the answer (the answer tokens and the EOS) or the whole sample (every label but
               the padding).
"""

from dataclasses import dataclass

import torch


BOS = 0
PAD = EOS = 1
SEP = 2
FIRST = 3
ROLES = ("prompt", "answer", "padding")  # what a label position holds: sft_batch's "roles" are indices into this


@dataclass
class Chain:
    """A Markov chain over token ids of some order: the successors of each context of ``order`` tokens, with the same
    probabilities for every context."""

    successors: torch.Tensor  # [vocab] * order + [branching]: next-token ids
    probs: torch.Tensor  # [branching], the same for every context

    @property
    def order(self) -> int:
        return self.successors.dim() - 1

    def step(self, history: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """One successor of each row of ``history`` ([n, k]: its last tokens, the last one current); a history
        shorter than the order counts as preceded by BOS."""
        if history.dim() == 1:
            history = history[:, None]
        if history.shape[1] < self.order:
            history = torch.cat([history.new_full((len(history), self.order - history.shape[1]), BOS), history], 1)
        pick = torch.multinomial(self.probs, len(history), replacement=True, generator=gen)
        return self.successors[(*history[:, -self.order :].T, pick)]

    def walk(self, start: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
        """[n, length] continuation of each start ([n]: one token, or [n, k]: the last k), the start excluded."""
        history = start[:, None] if start.dim() == 1 else start
        out = []
        for _ in range(length):
            out.append(self.step(history, gen))
            history = torch.cat([history, out[-1][:, None]], 1)
        return torch.stack(out, 1) if out else history.new_zeros(len(history), 0)


def make_chain(
    vocab: int, seed: int, branching: int = 3, probs=(0.8, 0.15, 0.05), order: int = 1, alphabet=None
) -> Chain:
    """Random successors for every context of ``order`` token ids, drawn from ``seed`` among ``alphabet`` (a number
    of content tokens, the first ones; default: all of them)."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(
        FIRST, FIRST + (alphabet or vocab - FIRST), (vocab,) * order + (branching,), generator=gen
    )
    return Chain(successors, torch.tensor(probs))


def pretrain_batch(chain: Chain, vocab: int, batch: int, seq: int, gen, mean_doc_len: int = 24) -> dict:
    """Packed documents of chain A, each BOS + text + EOS, back to back from each row's start (a document's text
    ends after each token with probability 1/mean_doc_len; it starts at a uniform random token); loss on every
    position."""
    current = torch.full((batch,), BOS)
    columns = [current]
    for _ in range(seq):
        fresh = torch.randint(FIRST, vocab, (batch,), generator=gen)
        ends = torch.rand(batch, generator=gen) < 1 / mean_doc_len
        text = torch.where(ends, torch.full_like(current, EOS), chain.step(current, gen))
        current = torch.where(current == EOS, BOS, torch.where(current == BOS, fresh, text))
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
    loss: str = "answer"  # "answer": answer tokens and the closing EOS; "sample": every label but the padding
    prompt_tail: float | None = None  # mean of an exponential tail added to prompt_len[0] (None: uniform lengths)
    pad_to: int | None = None  # every batch padded to this many positions (None: to its longest sample)

    def prompt_lengths(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        """Each sample's prompt length."""
        low, high = self.prompt_len
        if self.prompt_tail is None:
            return torch.randint(low, high + 1, (batch,), generator=gen)
        tail = -self.prompt_tail * torch.log1p(-torch.rand(batch, generator=gen))  # exponential, mean prompt_tail
        return (low + tail.floor().long()).clamp(max=high)

    def longest(self) -> int:
        """The longest sample's length in tokens (BOS to the last answer token; its labels end with the EOS)."""
        return self.prompt_len[1] + self.answer_len[1] + 2


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
    rows = torch.arange(batch)
    last = torch.stack([prompts[rows, (p_lens - 2).clamp(min=0)], prompts[rows, p_lens - 1]], 1)
    answers = chain_b.walk(last, setting.answer_len[1], gen)
    texts = [
        torch.cat([torch.tensor([BOS]), prompts[i, :p], torch.tensor([SEP]), answers[i, :a], torch.tensor([EOS])])
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
        # labels[:p + 1] are the prompt's tokens and SEP (text[0] is BOS); labels[p + 1:n] the answer and its EOS
        loss_mask[row, p + 1 if setting.loss == "answer" else 0 : n] = 1.0
        roles[row, : p + 1] = ROLES.index("prompt")
        roles[row, p + 1 : n] = ROLES.index("answer")
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "roles": roles}
