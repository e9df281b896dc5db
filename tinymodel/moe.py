"""MoE under MTP: 4 routed experts (top-2) plus a shared expert in every layer, the MTP layer included; experts split
over the expert-parallel ranks. Each case steps this rank's SFT batch, and a copy with masked positions perturbed.

The aux (load-balancing) loss averages router probabilities over every token, padding included, on either tree: with
it on, a perturbation at masked positions reaches the routers and everything upstream of them, so only what the mask
governs can stay exact. Off (core's default) nothing may change. The tests hold each case to the right one.
"""

import contextlib

from tinymodel import cpu_runtime, gpt
from tinymodel.reference import perturb_masked_positions


SEQ = 24  # every rank's batch the same length
AUX_LOSS_COEFF = 1e-2
CASES = tuple((dispatcher, aux) for dispatcher in ("allgather", "alltoall") for aux in (0.0, AUX_LOSS_COEFF))


def batch_of_rank(rank: int) -> dict:
    """This rank's answer-only SFT batch (each data-parallel rank has its own)."""
    return gpt.make_sft_batch(seed=rank, seq=SEQ)


def run_case(dispatcher: str, aux_loss_coeff: float, rank: int) -> dict:
    """The step on this rank's batch and on its perturbed copy, with a freshly built MoE model."""
    batch = batch_of_rank(rank)
    perturbed = perturb_masked_positions(batch, vocab=gpt.VOCAB, seed=100 + rank)
    on_cpu = cpu_runtime.alltoall_dispatch_on_cpu() if dispatcher == "alltoall" else contextlib.nullcontext()
    with on_cpu:
        model = gpt.build_model(1, **gpt.moe_fields(dispatcher, aux_loss_coeff))
        return {
            "local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
            "step": gpt.run_step(model, batch),
            "perturbed": gpt.run_step(model, perturbed),
        }


def measure(expert_parallel: int, cases=CASES) -> dict:
    """Every case on this rank, EP = ``expert_parallel``: {(dispatcher, aux_loss_coeff): run_case(...)}."""
    import torch.distributed as dist

    cpu_runtime.init_distributed(expert_parallel=expert_parallel)
    rank = dist.get_rank()
    return {"cases": {case: run_case(*case, rank) for case in cases}, "batch": batch_of_rank(rank)}
