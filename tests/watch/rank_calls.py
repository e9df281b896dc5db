"""A rank of test_tiny_model's torchrun jobs: the tiny GPTModel called directly, then one backward.

    rank_calls.py mixed | data-parallel

mixed: rank 0 calls it as Megatron-LM's pretrain_gpt.py does (labels and loss_mask), rank 1 as a label-less RL step
does (core then derives the labels from input_ids). data-parallel: each rank Megatron-LM's way on an SFT batch of its
own (the ranks differ only in their data: their tokens, and how many positions their masks mask)."""

import os
import sys

import torch

from tinymodel import cpu_runtime, gpt


torch.set_num_threads(1)
cpu_runtime.init_distributed()  # torchrun's env:// rendezvous: a data-parallel world of 2
rank = int(os.environ["RANK"])
data_parallel = sys.argv[1] == "data-parallel"
samples = ((8, 4), (17, 5), (6, 3)) if data_parallel and rank else gpt.SFT_SAMPLES
model, batch = gpt.build_model(1), gpt.make_sft_batch(samples, seed=rank if data_parallel else 0)
tokens = batch["tokens"]
position_ids = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
attention_mask = torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(diagonal=1)
with cpu_runtime.CudaAsCpu():
    if rank == 0 or data_parallel:
        out = model(tokens, position_ids, attention_mask, labels=batch["labels"], loss_mask=batch["loss_mask"])
    else:
        out = model(tokens, position_ids, attention_mask)
out.float().sum().backward()
cpu_runtime.shutdown_distributed()
