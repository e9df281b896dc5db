"""The worker function the watched one-rank jobs run (`tinymodel.worker call --function tests.watch.one_step:step`):
one step of the one-MTP-layer model on the SFT batch, the same step this session takes unwatched."""

from tinymodel import cpu_runtime, gpt


def step(_: str) -> dict:
    cpu_runtime.init_distributed()
    return {"step": gpt.run_step(gpt.build_model(1), gpt.make_sft_batch())}
