"""The behaviour probe behind `verify`, run as a script (its source through `-c`) under the interpreter that trains,
with the target's import root first on PYTHONPATH. It calls that Megatron-Bridge's real `gpt_step.forward_step`
(MTP on, last pipeline stage) with a recording model and prints one JSON object: the gpt_step.py it ran, whether
the model received the batch's loss_mask, and why. Exit 0 means the probe ran, whatever it found.

The one module of the tool that imports torch and megatron, only inside the target's interpreter, and nothing of
the tool, so it runs where only the target's own packages are installed. `make_state` is also the test suite's
stand-in for Bridge's GlobalState (one copy).
"""

import json
from types import SimpleNamespace


def make_state(*, packed: bool = False, attention_mask_from_dataset: bool = True):
    """The parts of Bridge's GlobalState that gpt_step.forward_step reads; timers do nothing."""
    from unittest.mock import MagicMock  # here: the tool imports this module and its commands need no mock

    dataset = SimpleNamespace(
        enable_offline_packing=packed,
        offline_packing_specs=None,
        skip_getting_attention_mask_from_dataset=packed or not attention_mask_from_dataset,
    )
    rerun = SimpleNamespace(check_for_nan_in_loss=False, check_for_spiky_loss=False)
    model = SimpleNamespace(pipeline_model_parallel_layout=None)
    cfg = SimpleNamespace(dataset=dataset, model=model, rerun_state_machine=rerun)
    return SimpleNamespace(cfg=cfg, timers=MagicMock(), straggler_timer=MagicMock())


def probe() -> dict:
    """Run forward_step once and report what the model received."""
    import torch

    import megatron.bridge.training.gpt_step as gpt_step

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    tokens, labels = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]]), torch.tensor([[6, 7, 8, 0], [10, 11, 0, 0]])
    batch = (tokens, labels, mask.clone(), None, torch.arange(4).repeat(2, 1), None)
    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return torch.zeros(2, 4)

    group = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    config = SimpleNamespace(
        mtp_num_layers=1, is_hybrid_model=False, seq_length=4, overlap_moe_expert_parallel_comm=False
    )
    gpt_step.get_model_config = lambda model: config
    gpt_step.get_pg_collection = lambda model: SimpleNamespace(pp=group, cp=group)
    gpt_step.get_batch = lambda *args, **kwargs: batch
    gpt_step.forward_step(make_state(), iter(()), model)
    given = seen.get("loss_mask")
    delivered = isinstance(given, torch.Tensor) and torch.equal(given, mask)
    if delivered:
        reason = "the model receives the batch's loss_mask with MTP on"
    elif "loss_mask" not in seen:
        reason = "the model received no loss_mask with MTP on: the MTP loss falls back to an all-ones mask (#6103)"
    else:
        shown = given.tolist() if isinstance(given, torch.Tensor) else given  # one line, whatever its shape
        reason = f"the model received loss_mask={shown!r}, not the batch's mask {mask.tolist()}"
    return {"file": gpt_step.__file__, "delivered": delivered, "reason": reason}


if __name__ == "__main__":
    print(json.dumps(probe()))
