"""The one set of runtime workarounds that lets megatron-core's real code step a tiny model on CPU with gloo.

Every step the tiny model takes (1 rank, TP2, PP2, MoE/EP2, acceptance, effect) goes through these. Each says which CPU
failure it avoids; none touches Megatron-Bridge or the patch. Import-time shims (Python 3.11, no TransformerEngine)
are in site/sitecustomize.py.
"""

import contextlib
import os

import torch
from torch.overrides import TorchFunctionMode


SEED = 1234
_CUDA_CURRENT_DEVICE = torch.cuda.current_device

# TransformerConfig fields that only a CPU run needs.
CONFIG_FIELDS = {
    # "When using pipeline parallelism, pipeline_dtype must be specified" (model_parallel_config.py).
    "pipeline_dtype": torch.float32,
    # p2p_communication calls torch.cuda.synchronize() after a batched isend/irecv unless this is off.
    "batch_p2p_sync": False,
}


def _cpu_device():
    return torch.device("cpu")


class CudaAsCpu(TorchFunctionMode):
    """Inside: tensors asked for on "cuda" are made on the CPU, and ``Tensor.cuda()`` returns the tensor itself.

    Entered only around model construction, the schedule call and core's grad norm, where core and Bridge allocate
    with device="cuda" or move with .cuda() ("Torch not compiled with CUDA enabled" from language_module's embedding
    copy, the schedules' token counter, Bridge's get_batch and clip_grads' accumulator).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def init_distributed(tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1) -> None:
    """gloo process group (the worker's env:// rendezvous, else a 1-rank in-memory store) and megatron-core's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as core_tp

    # Core's memory buffer, rotary embedding, MTP tracker and p2p shapes allocate on torch.cuda.current_device().
    torch.cuda.current_device = _cpu_device
    if not dist.is_initialized():
        if "RANK" in os.environ and os.environ.get("WORLD_SIZE") != "1":  # one rank needs no port, which may be taken
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            expert_model_parallel_size=expert_parallel,
        )
    layout = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
    )
    assert layout == (tensor_parallel, pipeline_parallel, expert_parallel), layout
    # The default tracker calls torch.cuda.get_rng_state; the inference tracker's fork is a null context.
    core_tp.model_parallel_cuda_manual_seed(SEED, inference_rng_tracker=True, force_reset_rng=True)


def reset_model_parallel() -> None:
    """Drop megatron-core's parallel state but keep the process group, to set up another layout."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def shutdown_distributed() -> None:
    """Undo init_distributed, so later tests in the same process see a clean slate."""
    import torch.distributed as dist

    reset_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.cuda.current_device = _CUDA_CURRENT_DEVICE


def sync_pipeline_embedding_grads(model) -> None:
    """Have core's schedule sum the word-embedding grads of the first stage and of the last stage's copy (MTP embeds
    input_ids there), the part of finalize_model_grads that pipeline parallelism needs.

    Core's own finalize_model_grads needs a DDP-wrapped model, and DDP's grad sync calls torch.cuda.current_stream()
    ("Torch not compiled with CUDA enabled"); without the sum each copy keeps a partial grad.
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_word_embedding_grads

    model.ddp_config = DistributedDataParallelConfig()  # read by core's embedding-grad all-reduce

    def finalize(models, num_tokens, pg_collection=None, force_all_reduce=False):
        _allreduce_word_embedding_grads(models, models[0].config)

    model.config.finalize_model_grads_func = finalize


class _HostStream:
    """The alltoall dispatcher's device-to-host side stream, on a machine with one (host) stream."""

    def wait_stream(self, other):
        return None

    def record_event(self):
        return type("HostEvent", (), {"synchronize": lambda self: None})()


@contextlib.contextmanager
def alltoall_dispatch_on_cpu():
    """What the alltoall token dispatcher needs on CPU, undone on exit (enter it before building the model).

    Its class-level DtoH stream is a torch.cuda.Stream ("torch.cuda.Stream requires CUDA support" when a
    TransformerLayer is built) used with torch.cuda.current_stream()/torch.cuda.stream(); and on CPU its split sizes
    stay tensors (maybe_move_tensor_to_cpu converts only CUDA tensors), which gloo's all_to_all_single refuses
    ("incompatible function arguments"): they go to core's all_to_all as lists.
    """
    from megatron.core.transformer.moe import token_dispatcher

    stream = _HostStream()
    all_to_all = token_dispatcher.all_to_all
    saved = (
        torch.cuda.current_stream,
        torch.cuda.stream,
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream,
    )

    def as_list(splits):
        return splits.tolist() if torch.is_tensor(splits) else splits

    def all_to_all_with_list_splits(group, input_, output_split_sizes_=None, input_split_sizes=None, **kwargs):
        return all_to_all(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes), **kwargs)

    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    token_dispatcher.all_to_all = all_to_all_with_list_splits
    try:
        yield
    finally:
        torch.cuda.current_stream, torch.cuda.stream, token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = (
            saved
        )
        token_dispatcher.all_to_all = all_to_all
