"""Stand-ins for the module-level helpers of upstream's tests/unit_tests/training/test_gpt_step.py: the same names,
called the same way and behaving the same for what the tests use, written here (no upstream code is carried).

Two users: the tests the patch adds to upstream's file, run in this repo's suite without an upstream checkout
(releases ship no tests; tests/test_wrong_fixes.py runs them on every variant), and the fork's own unit tests, so
each helper exists once.
"""

from types import SimpleNamespace
from unittest.mock import Mock  # noqa: F401  (the added tests use it)

import pytest  # noqa: F401
import torch

from megatron.bridge.training.gpt_step import _forward_step_common  # noqa: F401


# What upstream's test module has at module level and the added tests use (`import *` skips _names otherwise).
__all__ = [
    "Mock",
    "pytest",
    "torch",
    "_forward_step_common",
    "_Iterator",
    "_MockPGCollection",
    "_NoCudaTensor",
    "_as_nocuda",
    "_make_cfg",
    "_NoopTimer",
    "_RecordingModel",
]


class _Iterator:
    """Yields its one batch, then stops."""

    def __init__(self, batch):
        self._batches = iter([batch])

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._batches)


def _group(rank=0, size=1):
    return SimpleNamespace(rank=lambda: rank, size=lambda: size)


class _MockPGCollection:
    """One rank of everything (pp, tp, cp) unless told otherwise."""

    def __init__(self, cp_size=1, pp_rank=0, pp_size=1, tp_size=1):
        self.pp, self.tp, self.cp = _group(pp_rank, pp_size), _group(size=tp_size), _group(size=cp_size)


class _NoCudaTensor(torch.Tensor):
    """get_batch moves batches with .cuda(); on CPU that returns the tensor itself."""

    def cuda(self, non_blocking=False):  # type: ignore[override]
        return self


def _as_nocuda(tensor):
    return tensor.as_subclass(_NoCudaTensor)


def _make_cfg(*, mtp_num_layers=0, pipeline_model_parallel_layout=None, **dataset):
    """The config fields the forward step reads: the dataset's packing and attention-mask switches, the model's
    pipeline layout."""
    dataset = {
        "enable_offline_packing": False,
        "offline_packing_specs": None,
        "skip_getting_attention_mask_from_dataset": True,
    } | dataset
    model = {"pipeline_model_parallel_layout": pipeline_model_parallel_layout, "mtp_num_layers": mtp_num_layers}
    return SimpleNamespace(dataset=SimpleNamespace(**dataset), model=SimpleNamespace(**model))


class _NoopTimer:
    """Timers and the straggler timer: called, started, stopped or entered, they do nothing."""

    def __call__(self, *args, **kwargs):
        return self

    def start(self, *args, **kwargs):
        pass

    def stop(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _RecordingModel:
    """Stands in for GPTModel: `forward_kwargs` holds what the last forward call or build_schedule_plan received."""

    def __init__(self, *, vp_stage=None, output=None, pre_process=True):
        self.vp_stage, self.pre_process, self.forward_kwargs = vp_stage, pre_process, None
        self.output = torch.tensor(1.0) if output is None else output

    def __call__(self, **kwargs):
        self.forward_kwargs = kwargs
        return self.output

    def build_schedule_plan(self, input_ids, position_ids, attention_mask, **kwargs):
        self.forward_kwargs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask)
        self.forward_kwargs.update(kwargs)
        return self.output
