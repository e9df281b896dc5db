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

"""The GPT forward step must hand the batch's loss_mask to the model (#6103).

MCore's GPTModel passes ``loss_mask`` to ``process_mtp_loss``; without it the MTP loss falls back to
an all-ones mask and trains on padding and prompt tokens.
"""

import pytest
import torch

import megatron.bridge.models.deepseek.deepseek_v4_step as deepseek_v4_step
import megatron.bridge.training.gpt_step as gpt_step


class _Missing:
    def __repr__(self):
        return "<loss_mask not passed>"


_MISSING = _Missing()
_PLAN = object()


class _Iterator:
    def __init__(self, batch):
        self.batch = batch

    def __iter__(self):
        return self

    def __next__(self):
        return self.batch


class _ProcessGroup:
    def __init__(self, rank=0, size=1):
        self._rank = rank
        self._size = size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class _PGCollection:
    def __init__(self, pp_rank=0, pp_size=1):
        self.pp = _ProcessGroup(rank=pp_rank, size=pp_size)
        self.cp = _ProcessGroup()


class _NoCudaTensor(torch.Tensor):
    def cuda(self, non_blocking=False):  # type: ignore[override]
        return self


def _as_nocuda(tensor):
    return tensor.as_subclass(_NoCudaTensor)


class _NoopTimer:
    def __call__(self, *args, **kwargs):
        return self

    def start(self):
        return None

    def stop(self):
        return None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        return False


class _RecordingModel:
    """Stands in for GPTModel: records the kwargs of the normal path and of the schedule-plan path."""

    def __init__(self):
        self.forward_kwargs = None
        self.schedule_plan_kwargs = None
        self.output = torch.zeros(2, 8)

    def __call__(self, **kwargs):
        self.forward_kwargs = kwargs
        return self.output

    def build_schedule_plan(self, *args, **kwargs):
        self.schedule_plan_kwargs = kwargs
        return _PLAN


def _make_state(*, offline_packing=False):
    cfg = type("Cfg", (), {})()
    cfg.dataset = type(
        "D",
        (),
        {
            "enable_offline_packing": offline_packing,
            "offline_packing_specs": None,
            "skip_getting_attention_mask_from_dataset": True,
        },
    )()
    cfg.model = type("M", (), {"pipeline_model_parallel_layout": None})()
    cfg.rerun_state_machine = type("R", (), {"check_for_nan_in_loss": False, "check_for_spiky_loss": False})()
    state = type("State", (), {})()
    state.cfg = cfg
    state.timers = _NoopTimer()
    state.straggler_timer = _NoopTimer()
    return state


def _sft_batch(*, packed=False):
    """Two answer-only SFT samples: prompt, a short answer, then padding (pad id 0)."""
    tokens = torch.tensor([[5, 6, 7, 8, 9, 0, 0, 0], [5, 6, 7, 8, 9, 10, 11, 0]])
    labels = torch.tensor([[6, 7, 8, 9, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11, 0, 0]])
    loss_mask = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    position_ids = torch.arange(8).repeat(2, 1)
    if packed:
        # THD: both samples packed into one row; the model gets PackedSeqParams, the mask stays token-aligned.
        tokens, labels, loss_mask = tokens.reshape(1, -1), labels.reshape(1, -1), loss_mask.reshape(1, -1)
        position_ids = position_ids.reshape(1, -1)
    batch = {
        "tokens": _as_nocuda(tokens),
        "labels": _as_nocuda(labels),
        "loss_mask": _as_nocuda(loss_mask),
        "attention_mask": None,
        "position_ids": _as_nocuda(position_ids),
    }
    if packed:
        cu_seqlens = _as_nocuda(torch.tensor([0, 8, 16], dtype=torch.int32))
        batch.update(
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=torch.tensor(8),
            max_seqlen_kv=torch.tensor(8),
        )
    return batch


@pytest.fixture
def model_config(monkeypatch):
    """A single-rank, last-pipeline-stage model; tests set mtp_num_layers and the overlap flag."""
    config = type(
        "Config",
        (),
        {"is_hybrid_model": False, "mtp_num_layers": 0, "overlap_moe_expert_parallel_comm": False, "seq_length": 8},
    )()
    monkeypatch.setattr("megatron.bridge.training.gpt_step.get_model_config", lambda model: config)
    monkeypatch.setattr("megatron.bridge.training.gpt_step.get_pg_collection", lambda model: _PGCollection())
    for module in ("megatron.bridge.training.gpt_step", "megatron.bridge.models.deepseek.deepseek_v4_step"):
        monkeypatch.setattr(
            f"{module}.get_batch_on_this_cp_rank",
            lambda batch, is_hybrid_cp=False, cp_group=None, hybrid_cp_group_func=None: batch,
        )
    return config


class TestForwardStepCommonPassesLossMask:
    """``_forward_step_common`` must give the model the loss mask that the loss function gets."""

    @pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
    @pytest.mark.parametrize("mtp_num_layers", [0, 1, 2])
    def test_model_receives_batch_loss_mask(self, model_config, mtp_num_layers, packed):
        """Normal path: the very tensor the data loader produced, unshifted, under the kwarg GPTModel reads."""
        model_config.mtp_num_layers = mtp_num_layers
        batch = _sft_batch(packed=packed)
        expected_mask = batch["loss_mask"].clone()
        model = _RecordingModel()

        output, returned_loss_mask = gpt_step._forward_step_common(
            _make_state(offline_packing=packed), _Iterator(batch), model
        )

        assert output is model.output
        assert model.forward_kwargs is not None
        assert model.forward_kwargs.get("loss_mask", _MISSING) is batch["loss_mask"]
        assert returned_loss_mask is batch["loss_mask"]
        assert torch.equal(model.forward_kwargs["loss_mask"], expected_mask)
        assert model.forward_kwargs["labels"] is batch["labels"]
        assert model.forward_kwargs["input_ids"] is batch["tokens"]
        assert ("packed_seq_params" in model.forward_kwargs) == packed

    @pytest.mark.parametrize("mtp_num_layers", [0, 1])
    def test_schedule_plan_receives_batch_loss_mask(self, model_config, mtp_num_layers):
        """Schedule-plan path (EP A2A overlap) keeps passing the same mask and never calls the model."""
        model_config.mtp_num_layers = mtp_num_layers
        model_config.overlap_moe_expert_parallel_comm = True
        batch = _sft_batch()
        model = _RecordingModel()

        plan, returned_loss_mask = gpt_step._forward_step_common(
            _make_state(), _Iterator(batch), model, return_schedule_plan=True
        )

        assert plan is _PLAN
        assert model.forward_kwargs is None
        assert model.schedule_plan_kwargs.get("loss_mask", _MISSING) is batch["loss_mask"]
        assert model.schedule_plan_kwargs["labels"] is batch["labels"]
        assert returned_loss_mask is batch["loss_mask"]

    @pytest.mark.parametrize(
        ("is_first", "is_last"), [(True, False), (False, False)], ids=["first_pp_stage", "middle_pp_stage"]
    )
    @pytest.mark.parametrize("mtp_num_layers", [0, 1])
    def test_stage_without_loss_mask_passes_none(self, monkeypatch, model_config, mtp_num_layers, is_first, is_last):
        """Stages that load no labels pass ``loss_mask=None`` explicitly, like every other batch field."""
        monkeypatch.setattr("megatron.bridge.training.gpt_step.is_pp_first_stage", lambda pg: is_first)
        monkeypatch.setattr("megatron.bridge.training.gpt_step.is_pp_last_stage", lambda pg: is_last)
        model_config.mtp_num_layers = mtp_num_layers
        model = _RecordingModel()

        output, returned_loss_mask = gpt_step._forward_step_common(_make_state(), _Iterator(_sft_batch()), model)

        assert output is model.output
        assert returned_loss_mask is None
        assert model.forward_kwargs.get("loss_mask", _MISSING) is None


class TestEntryPointsPassLossMask:
    """Every public step built on ``_forward_step_common`` gives the model and the loss the same mask."""

    @pytest.mark.parametrize(
        ("step_module", "forward_step_name", "loss_factory_name"),
        [
            (gpt_step, "forward_step", "_create_loss_function"),
            (gpt_step, "forward_step_modelopt", "_create_loss_function_modelopt"),
            (deepseek_v4_step, "forward_step", "_create_loss_function"),
        ],
        ids=["gpt_step.forward_step", "gpt_step.forward_step_modelopt", "deepseek_v4_step.forward_step"],
    )
    @pytest.mark.parametrize("mtp_num_layers", [0, 1])
    def test_model_and_loss_function_share_loss_mask(
        self, mocker, model_config, mtp_num_layers, step_module, forward_step_name, loss_factory_name
    ):
        model_config.mtp_num_layers = mtp_num_layers
        batch = _sft_batch()
        model = _RecordingModel()
        loss_factory = mocker.spy(step_module, loss_factory_name)

        output, _ = getattr(step_module, forward_step_name)(_make_state(), _Iterator(batch), model)

        assert output is model.output
        assert loss_factory.call_count == 1
        assert loss_factory.call_args.args[0] is batch["loss_mask"]
        assert model.forward_kwargs.get("loss_mask", _MISSING) is batch["loss_mask"]


class TestLanguageModelLossUnchanged:
    """Passing the mask to the model must not change how Bridge masks the LM loss."""

    def test_lm_loss_sums_only_masked_tokens(self, model_config):
        batch = _sft_batch()
        per_token_loss = torch.arange(16, dtype=torch.float32).reshape(2, 8)
        model = _RecordingModel()
        model.output = per_token_loss

        output, loss_function = gpt_step.forward_step(_make_state(), _Iterator(batch), model)
        loss, num_tokens, report = loss_function(output)

        # Loss tokens: row 0 positions 2, 3; row 1 positions 3, 4, 5 (flat 11, 12, 13).
        assert loss.item() == 2.0 + 3.0 + 11.0 + 12.0 + 13.0
        assert num_tokens.item() == 5
        assert report["lm loss"].tolist() == [41.0, 5.0]
