"""verify's behaviour probe as a test of a wrong-fix variant's session (tests/test_wrong_fixes.py adds this file to each
one's arguments): the probe runs the session's own gpt_step.py (run_many checks which file each session imported),
and passes only if it finds the batch's loss_mask delivered. Its outcome and reason are read by
tests/test_wrong_fixes.py, which pins the verdict per variant. Not a test_ file: the suite's own session does not
collect it."""

import torch

from mtp_mask_fix.probe import probe


STUBBED = ("get_model_config", "get_pg_collection")  # what probe() replaces in gpt_step


def test_verify_probe_finds_the_batchs_loss_mask(monkeypatch, record_property):
    import megatron.bridge.training.gpt_step as gpt_step

    for name in STUBBED:  # put back after the test, whatever runs next in the session
        monkeypatch.setattr(gpt_step, name, getattr(gpt_step, name))
    alone = not torch.distributed.is_initialized()
    try:
        found = probe()
    finally:
        if alone and torch.distributed.is_initialized():  # the probe's one-rank job ends with it
            torch.distributed.destroy_process_group()
    record_property("reason", found["reason"])  # the session's record carries it (Run.reasons)
    assert found["delivered"], found["reason"]
