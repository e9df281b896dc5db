"""Training loops outside Bridge, right and wrong, each one call of the tiny GPTModel (as Megatron-LM's pretrain_gpt.py
calls it, or as an RL step does with no labels) and its backward; packed THD sequences call core's MTP loss itself,
as GPTModel hands it packed_seq_params (the local attention of the CPU model has no THD).

    python tests/watch/loops.py LOOP [--steps N] [--then exit-3|sleep]

runs LOOP N times, then exits 3 or sleeps (a job to stop) after writing `steps-done` in its working directory.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tinymodel import cpu_runtime, gpt  # noqa: E402


def _sft(samples=gpt.SFT_SAMPLES) -> dict:
    """The answer-only SFT batch with each text kept: prompt + answer (its last token EOS, which also pads)."""
    batch = gpt.make_sft_batch(samples)
    batch["spans"] = [(prompt, answer) for prompt, answer in samples]
    return batch


def _response_mask(batch: dict, width: int | None = None) -> torch.Tensor:
    """The answer mask over the inputs, as an RL step has it: the input tokens of each answer, its EOS included."""
    mask = torch.zeros(len(batch["spans"]), width or batch["loss_mask"].shape[1])
    for row, (prompt, answer) in enumerate(batch["spans"]):
        mask[row, prompt : prompt + answer] = 1.0
    return mask


def _pretraining() -> dict:
    """Rows cut from a token stream: no padding, every position counts; one row ends in a token repeated 5 times."""
    text = torch.randint(2, gpt.VOCAB, (3, 25), generator=torch.Generator().manual_seed(1))
    text[0, -5:] = 7  # text, not padding
    return {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": torch.ones(3, 24)}


def _double_shifted() -> dict:
    """The SFT batch whose labels were shifted once more: label[i] = input[i + 2]."""
    batch = _sft()
    batch["labels"] = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], gpt.PAD)], 1)
    return batch


def _rl() -> dict:
    """Prompt + answer + EOS padding as input_ids, no labels (core derives them), the response mask over inputs."""
    batch = _sft()
    tokens = torch.cat([batch["tokens"], torch.full_like(batch["tokens"][:, :1], gpt.PAD)], 1)  # each text whole
    return {"tokens": tokens, "labels": None, "loss_mask": _response_mask(batch, tokens.shape[1])}


LOOPS = {  # name: (the batch, what the loop hands the model as loss_mask, the model's mode, backward)
    "pretraining": (_pretraining, "mask", "train", True),
    "sft": (_sft, "mask", "train", True),
    "rl": (_rl, "mask", "train", True),
    "eval with grad": (_sft, None, "eval", False),
    "double-shifted labels": (_double_shifted, "mask", "train", True),
    "input-aligned mask": (_sft, _response_mask, "train", True),
    "ones over padding": (_sft, lambda batch: torch.ones_like(batch["loss_mask"]), "train", True),
    "no mask": (_sft, None, "train", True),
    "eval-mode training": (_sft, None, "eval", True),
}


def build_model():
    """The one-MTP-layer tiny model on a one-rank world."""
    cpu_runtime.init_distributed()
    return gpt.build_model(1)


def run(model, loop: str) -> torch.Tensor:
    """One call of LOOP's model and its backward, if it has one; what the loop would back-propagate."""
    make, mask, mode, backward = LOOPS[loop]
    batch = make()
    mask = batch["loss_mask"] if mask == "mask" else mask(batch) if callable(mask) else None
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    attention_mask = torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(diagonal=1)
    model.train(mode == "train")
    model.zero_grad(set_to_none=True)
    with cpu_runtime.CudaAsCpu():
        out = model(tokens, position_ids, attention_mask, labels=batch["labels"], loss_mask=mask)
    loss = out.float().sum()
    if backward:
        loss.backward()
    return loss


def run_packed(model) -> torch.Tensor:
    """Core's MTP loss on the three SFT texts packed into one row (THD), with their cu_seqlens, then its backward."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.multi_token_prediction import process_mtp_loss

    batch, texts = _sft(), []
    for row, (prompt, answer) in enumerate(batch["spans"]):
        texts.append({key: batch[key][row, : prompt + answer - 1] for key in ("tokens", "labels", "loss_mask")})
    packed = {key: torch.cat([text[key] for text in texts])[None] for key in texts[0]}
    bounds = torch.tensor([0, *torch.tensor([len(t["tokens"]) for t in texts]).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds)
    width = packed["tokens"].shape[1]
    hidden = torch.randn(2 * width, 1, gpt.HIDDEN, generator=torch.Generator().manual_seed(2), requires_grad=True)
    model.train()
    with cpu_runtime.CudaAsCpu():
        out = process_mtp_loss(
            hidden_states=hidden,
            labels=packed["labels"],
            loss_mask=packed["loss_mask"],
            output_layer=model.output_layer,
            output_weight=None,
            runtime_gather_output=None,
            is_training=True,
            compute_language_model_loss=model.compute_language_model_loss,
            config=model.config,
            packed_seq_params=params,
            input_ids=packed["tokens"],
        )
    loss = out.sum()
    loss.backward()
    return loss


def main() -> None:
    """LOOP --steps times, then what --then says."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loop", choices=LOOPS)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--then", choices=("exit-3", "sleep"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model()
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
