"""The behaviour probe behind `verify`: `python -m mtp_mask_fix.harness.probe` calls the real
`gpt_step.forward_step` of the Megatron-Bridge first on the import path (MTP on, last pipeline stage) with a
recording model, and prints one JSON object: the gpt_step.py it ran, whether the model received the batch's
loss_mask, and why. Exit 0 means the probe ran, whatever it found.
"""

import json


def probe() -> dict:
    """Run forward_step once and report what the model received."""
    from mtp_mask_fix.harness import cpu_shims

    cpu_shims.install()  # no-op where Python >= 3.12 and TransformerEngine exist
    import torch

    import megatron.bridge.training.gpt_step as gpt_step
    from mtp_mask_fix.harness.fakes import make_state

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    batch = (
        torch.tensor([[5, 6, 7, 8]]),
        torch.tensor([[6, 7, 8, 0]]),
        mask.clone(),
        None,
        torch.arange(4)[None],
        None,
    )
    seen = {}

    def model(**kwargs):
        seen.update(kwargs)
        return torch.zeros(1, 4)

    group = type("Group", (), {"size": lambda self: 1, "rank": lambda self: 0})()
    fields = {
        "mtp_num_layers": 1,
        "is_hybrid_model": False,
        "seq_length": 4,
        "overlap_moe_expert_parallel_comm": False,
    }
    config = type("Config", (), fields)()
    gpt_step.get_model_config = lambda model: config
    gpt_step.get_pg_collection = lambda model: type("PG", (), {"pp": group, "cp": group})()
    gpt_step.get_batch = lambda *args, **kwargs: batch
    gpt_step.forward_step(make_state(), iter(()), model)
    given = seen.get("loss_mask")
    delivered = isinstance(given, torch.Tensor) and torch.equal(given, mask)
    if delivered:
        reason = "the model receives the batch's loss_mask with MTP on"
    elif "loss_mask" not in seen:
        reason = "the model received no loss_mask with MTP on: the MTP loss falls back to an all-ones mask (#6103)"
    else:
        reason = f"the model received loss_mask={given!r}, not the batch's mask {mask!r}"
    return {"file": gpt_step.__file__, "delivered": delivered, "reason": reason}


if __name__ == "__main__":
    print(json.dumps(probe()))
