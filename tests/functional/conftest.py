from pathlib import Path

import pytest
import torch

from mtp_mask_fix.paths import GPT_STEP
from tinymodel import cpu_runtime, worker


torch.set_num_threads(1)  # on this 2-core machine two threads were several times slower than one


@pytest.fixture(scope="session")
def tree() -> Path:
    """The Megatron-Bridge tree this session imports. Workers get the same one."""
    return worker.this_tree()


@pytest.fixture(scope="session")
def gpt_step_file(tree) -> str:
    """The gpt_step.py this session (and a worker given `tree`) imports."""
    return str(tree / GPT_STEP)


@pytest.fixture(scope="module")
def one_rank():
    """World size 1, no model parallelism, for one test module."""
    cpu_runtime.init_distributed()
    yield
    cpu_runtime.shutdown_distributed()
