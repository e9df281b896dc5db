"""The worker function of the launcher's rendezvous test (`tinymodel.worker call --function tests.support.meet:ranks`):
this rank joins the run's process group."""

import torch.distributed as dist

from tinymodel import cpu_runtime


def ranks(_: str) -> dict:
    cpu_runtime.init_distributed()
    return {"world": dist.get_world_size()}
