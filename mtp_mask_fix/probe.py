"""verify's probe: the target's own `forward_step` and `get_batch` with MTP on, and a model that records its kwargs."""

# Run by its source on stdin in the interpreter that trains, the target first on PYTHONPATH, it prints one JSON object
# (`where`: its megatron.bridge's folder). The tool's one module that imports torch and megatron, and none of the tool.

import importlib.util
import json
import os
import sys
from types import SimpleNamespace


LOSS_MASK = [[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]  # asymmetric: no other tensor of the batch equals it


def global_state():
    """The parts of Bridge's GlobalState that forward_step reads, with no packing and timers that do nothing."""
    from unittest.mock import MagicMock  # timers and the straggler timer: called, started, entered, they do nothing

    dataset = SimpleNamespace(
        enable_offline_packing=False, offline_packing_specs=None, skip_getting_attention_mask_from_dataset=True
    )
    rerun = SimpleNamespace(check_for_nan_in_loss=False, check_for_spiky_loss=False)
    model = SimpleNamespace(pipeline_model_parallel_layout=None, virtual_pipeline_model_parallel_size=None)
    cfg = SimpleNamespace(dataset=dataset, model=model, rerun_state_machine=rerun)
    return SimpleNamespace(cfg=cfg, timers=MagicMock(), straggler_timer=MagicMock())


def probe() -> dict:
    """The gpt_step.py that ran, whether the model received the batch's loss_mask, and why."""
    import torch
    from megatron.core import parallel_state

    import megatron.bridge.training.gpt_step as gpt_step

    class Resident(torch.Tensor):  # one micro-batch as Bridge's datasets yield it, kept on the CPU by `.cuda()`
        def cuda(self, *args, **kwargs):
            return self

    tensors = dict(tokens=[[5, 6, 7, 8], [9, 10, 11, 0]], labels=[[6, 7, 8, 0], [10, 11, 0, 0]], loss_mask=LOSS_MASK)
    tensors["position_ids"] = [[0, 1, 2, 3], [0, 1, 2, 3]]
    batch = {key: torch.tensor(value).as_subclass(Resident) for key, value in tensors.items()}
    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return torch.zeros(2, 4)

    # A job of one rank: every process group (pipeline, context, tensor parallel) is that rank's world, set up as
    # megatron-core sets it up, for the lines whose get_batch asks parallel_state which stage it runs.
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    world = torch.distributed.group.WORLD
    config = SimpleNamespace(
        mtp_num_layers=1, is_hybrid_model=False, seq_length=4, overlap_moe_expert_parallel_comm=False
    )
    gpt_step.get_model_config = lambda model: config  # what a model built by Bridge carries, and its groups
    gpt_step.get_pg_collection = lambda model: SimpleNamespace(pp=world, cp=world, tp=world)
    gpt_step.forward_step(global_state(), iter([batch | {"attention_mask": None}]), model)
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


def where() -> str:
    """The folder of the megatron.bridge this interpreter imports wherever it runs: not the cwd's, unless named."""
    named = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    sys.path = [p for p in sys.path if p and (p != os.getcwd() or p in named)]
    return importlib.util.find_spec("megatron.bridge").submodule_search_locations[0]


if __name__ == "__main__":
    print(where() if sys.argv[1:] == ["where"] else json.dumps(probe()))
