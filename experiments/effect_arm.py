"""One arm of the effect experiment (experiments.effect), run by the worker with one tree first on the import path.

Pretrain the tiny MTP model (mtp_num_layers 1) on packed chain-A text (all-ones mask, no padding: both trees take the
same steps, which the weights hash shows), then for each seed and data setting fine-tune copies of it with
answer-only SFT through Bridge's forward_step + Adam, and evaluate on held-out SFT batches of the same setting.
Returns raw figures only (counts, sums, per-position CE at step 1, logged values per step); effect.py derives the rest.
"""

import hashlib
import time
from dataclasses import asdict, dataclass

import torch

from experiments import synthetic as syn
from experiments import training
from tests.support import cpu_runtime, tiny_mtp
from tests.support.reference import mtp_ce_per_position, mtp_mask, mtp_positions


@dataclass(frozen=True)
class Plan:
    """How much of everything one arm does."""

    pretrain_steps: int
    sft_steps: int
    seeds: tuple[int, ...]  # each: its own SFT task (chain B) and batch stream
    settings: tuple[str, ...]
    eval_every: int  # held-out evaluation every this many SFT steps (and at step 0)
    eval_batches: int
    batch: int
    logged_tail: int  # the final logged acceptance is the mean over this many last SFT steps
    pretrain_seq: int = 32
    pretrain_lr: float = 3e-3
    sft_lr: float = 1e-3

    def eval_steps(self) -> list[int]:
        """The SFT steps after which the held-out batches are evaluated (0: before fine-tuning)."""
        return sorted({*range(0, self.sft_steps + 1, self.eval_every), self.sft_steps})


BOTH = ("markov_prompts", "random_prompts")
PLANS = {
    "full": Plan(300, 120, (0, 1, 2), BOTH, eval_every=15, eval_batches=4, batch=32, logged_tail=20),
    "small": Plan(30, 10, (0, 1), BOTH, eval_every=5, eval_batches=2, batch=16, logged_tail=3),  # the test's
    # Supplementary, outside the 3-minute budget: 4x the SFT steps; padding to 64.
    "long": Plan(300, 480, (0,), BOTH, eval_every=60, eval_batches=4, batch=32, logged_tail=80),
    "padding": Plan(
        300, 120, (0, 1, 2), ("markov_prompts_pad64",), eval_every=15, eval_batches=4, batch=32, logged_tail=20
    ),
}
SETTINGS = {
    "markov_prompts": syn.SftSetting("markov_prompts", random_prompts=False),
    "random_prompts": syn.SftSetting("random_prompts", random_prompts=True),
    "markov_prompts_pad64": syn.SftSetting("markov_prompts_pad64", random_prompts=False, pad_to=64),
}
CHAIN_A_SEED = 1  # the pretraining language; SFT prompts in the markov settings
CHAIN_B = {"branching": 2, "probs": (0.9, 0.1)}  # the SFT task: answers continue under chain B, one per seed


def _sha256(batches: list[dict]) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        for key in sorted(batch):
            digest.update(key.encode())
            digest.update(batch[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


def _pretrain(plan: Plan) -> tuple[dict, dict]:
    """Pretrained weights, and how the pretraining went (held out: 2 more chain-A batches, every position)."""
    chain_a = syn.make_chain(tiny_mtp.VOCAB, CHAIN_A_SEED)
    gen = torch.Generator().manual_seed(10_000)
    make = lambda: syn.pretrain_batch(chain_a, tiny_mtp.VOCAB, plan.batch, plan.pretrain_seq, gen)
    batches = [make() for _ in range(plan.pretrain_steps)]
    model = tiny_mtp.build_model(1)
    losses = training.pretrain(model, batches, plan.pretrain_lr)
    info = {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "mtp_num_layers": model.config.mtp_num_layers,
        "mtp_loss_scaling_factor": model.config.mtp_loss_scaling_factor,
        "lm_loss_first": losses[0],
        "lm_loss_last": losses[-1],
        "held_out": training.evaluate(model, [make(), make()]),
        "weights_sha256": tiny_mtp.weights_sha256(model),
        "data_sha256": _sha256(batches),
    }
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}, info


def _step_one(result: tiny_mtp.StepResult, batch: dict) -> dict:
    """The report's step-1 figures, and per-position depth-1 CE, loss weight, mask and target role."""
    seq = batch["labels"].shape[1]
    return {
        "lm_loss": result.lm_loss,
        "grad_norm": result.grad_norm,
        "logged": result.logged,
        "mtp_ce": mtp_ce_per_position(result.mtp_logits[0], batch["labels"], 1),
        "mtp_loss_weight": result.mtp_loss_weights[0][:, mtp_positions(seq, 1)],
        "mtp_mask": mtp_mask(batch["loss_mask"], 1),
        "target_role": batch["roles"][:, 1:],  # depth 1 at t predicts labels[t + 1]
    }


def _fine_tune(pretrained: dict, plan: Plan, setting: str, seed: int) -> dict:
    """SFT from the pretrained weights on one seed's task and batches."""
    chain_a = syn.make_chain(tiny_mtp.VOCAB, CHAIN_A_SEED)
    chain_b = syn.make_chain(tiny_mtp.VOCAB, 100 + seed, **CHAIN_B)
    gen = torch.Generator().manual_seed(1000 * seed + tuple(SETTINGS).index(setting))
    make = lambda: syn.sft_batch(chain_a, chain_b, SETTINGS[setting], tiny_mtp.VOCAB, plan.batch, gen)
    held_out = [make() for _ in range(plan.eval_batches)]
    train = [make() for _ in range(plan.sft_steps)]
    model = tiny_mtp.build_model(1)
    model.load_state_dict(pretrained, strict=False)  # strict=False: the state dict's _extra_state entries are None
    tiny_mtp.reset_mtp_tracker()
    evals = {0: training.evaluate(model, held_out)}
    trace = {"logged": [], "lm_loss": []}
    step_one = None
    for step, result in training.adam_steps(model, train, plan.sft_lr, record=lambda step: step == 1):
        if step == 1:
            step_one = _step_one(result, train[0])
        trace["logged"].append(result.logged)
        trace["lm_loss"].append(result.lm_loss)
        if step in plan.eval_steps():
            evals[step] = training.evaluate(model, held_out)
    return {
        "setting": setting,
        "seed": seed,
        "data_sha256": _sha256(held_out + train),
        "step_one": step_one,
        "trace": trace,
        "evals": evals,
    }


def measure(size: str) -> dict:
    """The arm: plan, pretraining, one fine-tuning run per (seed, setting), and where the time went."""
    plan = PLANS[size]
    cpu_runtime.init_distributed()
    started = time.perf_counter()
    pretrained, pretrain = _pretrain(plan)
    pretrained_at = time.perf_counter()
    runs = [_fine_tune(pretrained, plan, setting, seed) for seed in plan.seeds for setting in plan.settings]
    return {
        "plan": {**asdict(plan), "eval_steps": plan.eval_steps()},
        "pretrain": pretrain,
        "runs": runs,
        "pretrain_seconds": pretrained_at - started,
        "fine_tune_seconds": time.perf_counter() - pretrained_at,
    }
