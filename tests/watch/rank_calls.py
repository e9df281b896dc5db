"""A rank of test_tiny_model's torchrun jobs: one loop of tests/watch/loops.py on a data-parallel world of 2.

    rank_calls.py mixed | data-parallel

mixed: rank 0 calls the model as Megatron-LM's pretrain_gpt.py does (labels, loss_mask, its loss_func), rank 1 as an
RL step without a mask does (no labels: core derives them from input_ids). data-parallel: each rank right, on a batch
of its own (rank 1's prompts padded on the left)."""

import os
import sys

import torch

from tests.watch import loops
from tinymodel import cpu_runtime


torch.set_num_threads(1)
loop = {"mixed": ("pretraining", "rl, no mask"), "data-parallel": ("sft", "left-padded sft")}[sys.argv[1]]
loops.run(loops.build_model(), loop[int(os.environ["RANK"])])  # torchrun's env:// rendezvous: a world of 2
cpu_runtime.shutdown_distributed()
