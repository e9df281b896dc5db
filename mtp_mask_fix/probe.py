"""Behaviour probe: does this Megatron-Bridge hand the batch's loss_mask to the model?

Run as `python -m mtp_mask_fix.probe IMPORT_ROOT` (IMPORT_ROOT holds megatron/bridge) under the
interpreter that will train, so the answer is about the code that interpreter really imports. Prints
one JSON object. Exit code 0 means the probe ran, whatever it found.
"""

import json
import sys
from pathlib import Path


def probe(import_root: Path) -> dict:
    """Call the real `_forward_step_common` with a recording model and a fixed batch."""
    sys.path.insert(0, str(import_root))
    from mtp_mask_fix.harness import cpu_shims

    cpu_shims.install()  # no-op where Python >= 3.12 and TransformerEngine exist
    import torch

    import megatron.bridge.training.gpt_step as gpt_step
    from mtp_mask_fix.harness import tiny_mtp  # its fakes only; importing it builds nothing

    imported = Path(gpt_step.__file__).resolve()
    if not imported.is_relative_to(import_root.resolve()):
        return {"file": str(imported), "error": f"imported gpt_step from {imported}, not from {import_root}"}

    loss_mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    batch = (torch.tensor([[1, 2, 3, 0]]), torch.tensor([[2, 3, 0, 0]]), loss_mask, None, torch.arange(4)[None], None)
    seen = {}

    class Model:
        def __call__(self, **kwargs):
            seen.update(kwargs)
            return torch.zeros(1, 4)

    class Group:
        def size(self):
            return 1

        def rank(self):
            return 0

    state = tiny_mtp.make_state()
    config = type("Config", (), {"mtp_num_layers": 1, "is_hybrid_model": False, "seq_length": 4})()
    gpt_step.get_model_config = lambda model: config
    gpt_step.get_pg_collection = lambda model: type("PG", (), {"pp": Group(), "cp": Group()})()
    gpt_step.get_batch = lambda *args, **kwargs: batch
    _, returned_mask = gpt_step._forward_step_common(state, iter(()), Model())
    return {
        "file": str(imported),
        "passes_loss_mask": "loss_mask" in seen,
        "same_tensor_as_loss": seen.get("loss_mask") is loss_mask and returned_mask is loss_mask,
    }


def main() -> None:
    """Entry for `python -m mtp_mask_fix.probe IMPORT_ROOT`."""
    print(json.dumps(probe(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
