"""CPU shims for megatron-core's own unit tests on this machine (no CUDA, no NCCL), a pytest plugin that `./run gate`
loads into its sessions of Megatron-LM trees (`-p core_unit_tests_cpu`). Nothing here enters a patch.

- tests/unit_tests/test_utilities.py's Utils.initialize_distributed calls torch.cuda.set_device(local_rank %
  torch.cuda.device_count()) and starts an NCCL process group: no device to set, gloo instead of NCCL.
- It meets its peers at MASTER_PORT, 29500 by default, and gate runs two sessions at once: a free port each, unless
  a launcher (torchrun) started several ranks, which share the port it set.
- Its rendezvous gives up after one minute, and on a loaded machine one rank may still be importing the test module
  minutes after another: several ranks meet here first, before collection, with torch's own timeout.
- MTPLossLoggingHelper allocates its tracker on torch.cuda.current_device(): the CPU.
"""

import os
import socket

import torch


def pytest_configure(config):
    """Before any test: CUDA calls answered on the CPU, gloo for NCCL; several ranks meet, one gets a free MASTER_PORT."""
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    init = torch.distributed.init_process_group
    torch.distributed.init_process_group = lambda backend=None, *args, **kwargs: init("gloo", *args, **kwargs)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as the launcher set them
        return
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
