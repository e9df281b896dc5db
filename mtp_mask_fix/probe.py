"""The behaviour probe behind `verify`, run as a script (its source through `-c`) under the interpreter that trains,
with the target's import root first on PYTHONPATH. It runs that Megatron-Bridge's real `gpt_step.forward_step` with
MTP on, on a one-rank last pipeline stage, over a data iterator that yields one batch as a dataset does, so that the
release's own `get_batch` reads it (each release line unpacks its own tuple). The model records what it receives.
It prints one JSON object: the gpt_step.py it ran, whether the model received the batch's loss_mask, and why. Exit 0
means the probe ran, whatever it found.

The one module of the tool that imports torch and megatron, only inside the target's interpreter, and nothing of
the tool, so it runs where only the target's own packages are installed.
"""

import json
import os
import signal
import sys
from types import SimpleNamespace


LOSS_MASK = [[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]  # asymmetric: no other tensor of the batch equals it


def _batch(torch):
    """One micro-batch as Bridge's datasets yield it; `.cuda()` keeps it on the CPU (get_batch moves it there)."""

    class Resident(torch.Tensor):
        def cuda(self, *args, **kwargs):
            return self

    tensors = {
        "tokens": [[5, 6, 7, 8], [9, 10, 11, 0]],
        "labels": [[6, 7, 8, 0], [10, 11, 0, 0]],
        "loss_mask": LOSS_MASK,
        "position_ids": [[0, 1, 2, 3], [0, 1, 2, 3]],
    }
    batch = {key: torch.tensor(value).as_subclass(Resident) for key, value in tensors.items()}
    return batch | {"attention_mask": None}


def _state():
    """The parts of Bridge's GlobalState that forward_step reads: no packing, no dataset attention mask, no pipeline
    layout; timers that do nothing."""
    timer = SimpleNamespace(start=lambda *a, **k: None, stop=lambda *a, **k: None)
    timers = lambda *args, **kwargs: timer  # noqa: E731

    class Straggler:
        def __call__(self, *args, **kwargs):
            return self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    dataset = SimpleNamespace(
        enable_offline_packing=False, offline_packing_specs=None, skip_getting_attention_mask_from_dataset=True
    )
    rerun = SimpleNamespace(check_for_nan_in_loss=False, check_for_spiky_loss=False)
    model = SimpleNamespace(pipeline_model_parallel_layout=None, virtual_pipeline_model_parallel_size=None)
    cfg = SimpleNamespace(dataset=dataset, model=model, rerun_state_machine=rerun)
    return SimpleNamespace(cfg=cfg, timers=timers, straggler_timer=Straggler())


def probe() -> dict:
    """Run forward_step once and report what the model received."""
    import torch

    import megatron.bridge.training.gpt_step as gpt_step

    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return torch.zeros(2, 4)

    # A job of one rank: every process group (pipeline, context, tensor parallel) is that rank's world.
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    world = torch.distributed.group.WORLD
    config = SimpleNamespace(
        mtp_num_layers=1, is_hybrid_model=False, seq_length=4, overlap_moe_expert_parallel_comm=False
    )
    # What a model built by Bridge carries: its config and its process groups.
    gpt_step.get_model_config = lambda model: config
    gpt_step.get_pg_collection = lambda model: SimpleNamespace(pp=world, cp=world, tp=world)
    gpt_step.forward_step(_state(), iter([_batch(torch)]), model)
    given, mask = seen.get("loss_mask"), torch.tensor(LOSS_MASK)
    delivered = isinstance(given, torch.Tensor) and torch.equal(given, mask)
    if delivered:
        reason = "the model receives the batch's loss_mask with MTP on"
    elif "loss_mask" not in seen:
        reason = "the model received no loss_mask with MTP on: the MTP loss falls back to an all-ones mask (#6103)"
    else:
        shown = given.tolist() if isinstance(given, torch.Tensor) else given  # one line, whatever its shape
        reason = f"the model received loss_mask={shown!r}, not the batch's mask {LOSS_MASK}"
    return {"file": gpt_step.__file__, "delivered": delivered, "reason": reason}


def _die_with_parent(parent: int) -> None:
    """A probe whose tool was killed (kill -9 leaves no one to stop it) ends at once: Linux's parent-death signal,
    and the check that the parent is not already gone."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own signal handling stops it
        pass
    if os.getppid() != parent:
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1:  # the tool's pid
        _die_with_parent(int(sys.argv[1]))
    print(json.dumps(probe()))
