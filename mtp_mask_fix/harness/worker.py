"""Worker entry for the tiny model, one rank or one of torchrun's ranks (tensor parallel = world size):

    PYTHONPATH=TREE python -m torch.distributed.run --standalone --nproc-per-node 2 -m mtp_mask_fix.harness.worker MODE --out DIR

Each rank saves what MODE returns to DIR/rank<r>.pt: raw measurements only; the tests make every assertion.
TREE (first on the import path) is the Megatron-Bridge under test.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mtp_mask_fix.harness import cpu_shims, tiny_mtp
from mtp_mask_fix.patch import REPO


def launch(mode: str, tree: Path, ranks: int, out: Path, *args: str) -> list[dict]:
    """Run MODE on `ranks` ranks under torchrun with TREE first on the import path; returns each rank's payload."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    command += ["-m", "mtp_mask_fix.harness.worker", mode, "--out", str(out), *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} on {ranks} rank(s) with {tree} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(ranks)]


def suite(tensor_parallel: int) -> dict:
    """One step on the SFT batch and one on the batch with masked positions perturbed, for 1 and 2 MTP layers."""
    batch = tiny_mtp.make_sft_batch()
    perturbed = tiny_mtp.perturb_masked_positions(batch)
    results = {"batch": batch, "perturbed": perturbed}
    for mtp_num_layers in (1, 2):
        model = tiny_mtp.build_model(mtp_num_layers, tensor_parallel)
        results[mtp_num_layers] = {
            "step": tiny_mtp.run_step(model, batch),
            "perturbed": tiny_mtp.run_step(model, perturbed),
        }
    return results


def repro(tensor_parallel: int) -> dict:
    """One step of the mtp_num_layers=1 model on the SFT batch, with per-position MTP data for the figure."""
    batch = tiny_mtp.make_sft_batch()
    model = tiny_mtp.build_model(1, tensor_parallel)
    step = tiny_mtp.run_step(model, batch)
    seq = batch["labels"].shape[1]
    return {
        "step": step,
        "batch": batch,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "mtp_ce": tiny_mtp.mtp_ce_per_position(step.mtp_logits[0], batch["labels"], 1),
        "mtp_mask": tiny_mtp.mtp_mask(batch["loss_mask"], 1),
        # Each position's weight in the MTP loss (the gradient of the step loss w.r.t. its CE), as core applied it.
        "mtp_loss_weight": step.mtp_loss_weights[0][:, tiny_mtp.mtp_positions(seq, 1)],
    }


def bench(tensor_parallel: int, steps: int) -> dict:
    """Forward+backward step times of the mtp_num_layers=1 model (after 3 warm-up steps)."""
    model = tiny_mtp.build_model(1, tensor_parallel)
    batch = tiny_mtp.make_sft_batch()
    times = []
    for index in range(steps + 3):
        start = time.perf_counter()
        tiny_mtp.run_step(model, batch, record=False)
        times.append(time.perf_counter() - start)
    return {"steps": steps, "median_step_s": statistics.median(times[3:])}


MODES = {"suite": suite, "repro": repro, "bench": bench}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--out", type=Path, required=True, help="directory for rank<r>.pt")
    parser.add_argument("--steps", type=int, default=30, help="timed steps (bench)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # two threads were several times slower than one on this 2-core machine
    cpu_shims.install()
    started = time.perf_counter()
    world = tiny_mtp.init_distributed_from_env()
    import torch.distributed as dist

    import megatron.bridge.training.gpt_step as gpt_step

    payload = bench(world, args.steps) if args.mode == "bench" else MODES[args.mode](world)
    payload.update(
        rank=dist.get_rank(),
        tensor_parallel=world,
        gpt_step_file=gpt_step.__file__,
        seconds=time.perf_counter() - started,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports KiB
    )
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(payload, args.out / f"rank{dist.get_rank()}.pt")
    tiny_mtp.shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
