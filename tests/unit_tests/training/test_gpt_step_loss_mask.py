# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""The GPT forward step hands the batch's loss_mask to a model with MTP (#6103), and none to a model without MTP.

MCore's MTP loss falls back to an all-ones mask without it and trains on padding and prompt tokens. These tests run
the real batch path (get_batch) of every forward step built on ``_forward_step_common``.
"""

import importlib
from unittest.mock import Mock

import pytest
import torch

import megatron.bridge.training.gpt_step as gpt_step
from tests.support import upstream_helpers as upstream
from tests.support.upstream_helpers import _as_nocuda, _Iterator, _make_cfg, _MockPGCollection, _NoopTimer


def _forward_steps():
    """Every forward step built on ``_forward_step_common`` that this Megatron-Bridge has (found by import: the
    DeepSeek-V4 step arrived in 0.6)."""
    steps = {
        "gpt_step.forward_step": gpt_step.forward_step,
        "gpt_step.forward_step_modelopt": gpt_step.forward_step_modelopt,
    }
    try:
        deepseek_v4_step = importlib.import_module("megatron.bridge.models.deepseek.deepseek_v4_step")
    except ModuleNotFoundError:
        return steps
    return steps | {"deepseek_v4_step.forward_step": deepseek_v4_step.forward_step}


# Two answer-only SFT samples: prompt, a short answer, padding. Label-aligned, as get_batch returns it.
LOSS_MASK = [[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
FORWARD_STEPS = _forward_steps()


class _RecordingModel(upstream._RecordingModel):
    """Upstream's recording model, with the LM logits the loss function reads and a `training` flag."""

    def __init__(self, *, training=True):
        super().__init__(output=torch.arange(16, dtype=torch.float32).reshape(2, 8))
        self.training = training


class _ScheduleOnlyModel(_RecordingModel):
    """A model on the schedule-plan path (EP A2A overlap): its forward must not be called."""

    def __call__(self, **kwargs):
        raise AssertionError("forward called on the schedule-plan path")


class _ModelWithoutLossMask:
    """A model whose forward takes neither loss_mask nor **kwargs, like Bridge's FalconH1Model."""

    def __call__(
        self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, inference_context=None
    ):
        return torch.zeros(2, 8)


def _sft_batch(*, packed=False):
    tokens = torch.tensor([[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 8, 9, 10, 11, 0]])
    labels = torch.tensor([[6, 7, 8, 9, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11, 0, 0]])
    batch = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.tensor(LOSS_MASK),
        "attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(diagonal=1),
        "position_ids": torch.arange(8).repeat(2, 1),
    }
    if packed:  # THD: both samples in one row; the model gets PackedSeqParams, the mask stays token-aligned
        batch = {key: value.reshape(1, -1) for key, value in batch.items() if key != "attention_mask"}
        cu_seqlens = torch.tensor([0, 8, 16], dtype=torch.int32)
        batch.update(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=torch.tensor(8))
        batch["max_seqlen_kv"] = torch.tensor(8)
    return {key: _as_nocuda(value) for key, value in batch.items()}


def make_state(*, packed=False, attention_mask_from_dataset=True):
    state = Mock()
    state.cfg = _make_cfg(
        enable_offline_packing=packed,
        offline_packing_specs=object() if packed else None,
        skip_getting_attention_mask_from_dataset=packed or not attention_mask_from_dataset,
    )
    state.cfg.rerun_state_machine = Mock(check_for_nan_in_loss=False, check_for_spiky_loss=False)
    state.timers = state.straggler_timer = _NoopTimer()
    return state


def _expected_mask(*, packed=False):
    return torch.tensor(LOSS_MASK).reshape(1, -1) if packed else torch.tensor(LOSS_MASK)


def _set_pp_stage(monkeypatch, *, first, last):
    """The pipeline stage, as this gpt_step asks for it: its process groups, or (v0.2) megatron-core's parallel_state."""
    if hasattr(gpt_step, "is_pp_first_stage"):
        monkeypatch.setattr("megatron.bridge.training.gpt_step.is_pp_first_stage", lambda pg: first)
        monkeypatch.setattr("megatron.bridge.training.gpt_step.is_pp_last_stage", lambda pg: last)
    else:
        monkeypatch.setattr(gpt_step.parallel_state, "is_pipeline_first_stage", lambda *args, **kwargs: first)
        monkeypatch.setattr(gpt_step.parallel_state, "is_pipeline_last_stage", lambda *args, **kwargs: last)


@pytest.fixture
def config(monkeypatch):
    """A single-rank, last-pipeline-stage model with one MTP layer."""
    config = type(
        "Config",
        (),
        {"is_hybrid_model": False, "mtp_num_layers": 1, "overlap_moe_expert_parallel_comm": False, "seq_length": 8},
    )()
    monkeypatch.setattr("megatron.bridge.training.gpt_step.get_model_config", lambda model: config)
    if hasattr(gpt_step, "get_pg_collection"):
        monkeypatch.setattr("megatron.bridge.training.gpt_step.get_pg_collection", lambda model: _MockPGCollection())
    _set_pp_stage(monkeypatch, first=True, last=True)
    for module in {step.__module__ for step in FORWARD_STEPS.values()}:
        monkeypatch.setattr(
            f"{module}.get_batch_on_this_cp_rank",
            lambda batch, is_hybrid_cp=False, cp_group=None, hybrid_cp_group_func=None: batch,
        )
    return config


class TestModelWithMtpReceivesLossMask:
    @pytest.mark.fail_to_pass
    @pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
    @pytest.mark.parametrize("forward_step", FORWARD_STEPS)
    def test_model_receives_batch_loss_mask(self, config, forward_step, packed):
        model = _RecordingModel()

        FORWARD_STEPS[forward_step](make_state(packed=packed), _Iterator(_sft_batch(packed=packed)), model)

        assert "loss_mask" in model.forward_kwargs
        assert torch.equal(model.forward_kwargs["loss_mask"], _expected_mask(packed=packed))

    @pytest.mark.fail_to_pass
    def test_model_in_eval_mode_receives_batch_loss_mask(self, config):
        """Validation logs the MTP loss too: no grad, model.training False."""
        model = _RecordingModel(training=False)

        with torch.no_grad():
            gpt_step.forward_step(make_state(), _Iterator(_sft_batch()), model)

        assert "loss_mask" in model.forward_kwargs
        assert torch.equal(model.forward_kwargs["loss_mask"], _expected_mask())

    @pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
    def test_schedule_plan_receives_batch_loss_mask(self, config, packed):
        config.overlap_moe_expert_parallel_comm = True
        model = _ScheduleOnlyModel()

        gpt_step.forward_step(make_state(packed=packed), _Iterator(_sft_batch(packed=packed)), model, True)

        assert "loss_mask" in model.forward_kwargs
        assert torch.equal(model.forward_kwargs["loss_mask"], _expected_mask(packed=packed))

    @pytest.mark.parametrize("is_first", [True, False], ids=["first_pp_stage", "middle_pp_stage"])
    def test_stage_without_labels_passes_no_mask(self, monkeypatch, config, is_first):
        _set_pp_stage(monkeypatch, first=is_first, last=False)
        model = _RecordingModel()

        gpt_step.forward_step(make_state(attention_mask_from_dataset=False), _Iterator(_sft_batch()), model)

        assert model.forward_kwargs.get("loss_mask") is None


class TestModelWithoutMtp:
    def test_model_without_loss_mask_parameter_still_trains(self, config):
        config.mtp_num_layers = 0

        output, _ = gpt_step.forward_step(make_state(), _Iterator(_sft_batch()), _ModelWithoutLossMask())

        assert torch.equal(output, torch.zeros(2, 8))

    def test_lm_loss_sums_only_masked_tokens(self, config):
        output, loss_function = gpt_step.forward_step(make_state(), _Iterator(_sft_batch()), _RecordingModel())

        loss, num_tokens, report = loss_function(output)

        # Loss tokens: row 0 positions 2, 3; row 1 positions 3, 4, 5 (flat 11, 12, 13) of arange(16).
        assert loss.item() == 2.0 + 3.0 + 11.0 + 12.0 + 13.0
        assert num_tokens.item() == 5
        assert report["lm loss"].tolist() == [41.0, 5.0]
