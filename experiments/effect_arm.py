"""One arm of the effect experiment (experiments.effect), run by the worker with one tree first on the import path.

Per seed: a fresh initialisation, a pretraining language (chain A) and its packed text, pretrained with an all-ones
mask and no padding (both trees take the same steps, which the weights hash shows); then, for each data setting, a
copy of those weights fine-tuned through Bridge's forward_step + Adam on that seed's SFT task (chain B) and batches,
and evaluated on held-out batches of the same setting at the same steps in both arms. Returns raw figures only
(counts, sums, per-position CE at step 1, logged values per step); effect.py derives the rest.
"""

import hashlib
import time
from dataclasses import asdict, dataclass

import torch

from experiments import synthetic as syn
from experiments import training
from tinymodel import cpu_runtime, gpt
from tinymodel.reference import mtp_ce_per_position, mtp_mask, mtp_positions


@dataclass(frozen=True)
class Plan:
    """How much of everything one arm does."""

    pretrain_steps: int
    sft_steps: int
    seeds: tuple[int, ...]  # each: its own initialisation, pretraining language and text, SFT task and batches
    settings: tuple[str, ...]
    eval_every: int  # held-out evaluation every this many SFT steps (and at step 0)
    eval_batches: int
    batch: int
    pretrain_batch: int = 16
    pretrain_seq: int = 32
    pretrain_lr: float = 3e-3
    sft_lr: float = 2e-3
    new_tokens: int = 5  # greedy tokens decoded after each held-out prompt (the longest answer + its EOS)

    def eval_steps(self) -> list[int]:
        """The SFT steps after which the held-out batches are evaluated (0: before fine-tuning)."""
        return sorted({*range(0, self.sft_steps + 1, self.eval_every), self.sft_steps})


# Report-like padding: pad id = EOS, prompts with a long tail of lengths, 1-4 answer tokens + EOS, each batch padded to
# its longest sample, so most rows end in a long run of padding and answers are a few percent of the targets.
_SHAPE = {"prompt_len": (8, 52), "prompt_tail": 12.0, "answer_len": (1, 4)}
SETTINGS = {
    "same-language": syn.SftSetting("same-language", random_prompts=False, **_SHAPE),
    "distinct-answers": syn.SftSetting("distinct-answers", random_prompts=False, **_SHAPE),
    "padding-only": syn.SftSetting("padding-only", random_prompts=False, loss="sample", **_SHAPE),
}
DESCRIPTIONS = {
    "same-language": "prompt and answer in one language (the SFT task's chain); answer-only loss",
    "distinct-answers": "prompts in the pretraining language, answers in the SFT task's; answer-only loss",
    "padding-only": "as distinct-answers, but the loss covers the whole sample: only the padding is masked",
}
ALL = tuple(SETTINGS)
FIVE = (0, 1, 2, 3, 4)
PLANS = {
    "short": Plan(150, 60, FIVE, ALL, eval_every=20, eval_batches=4, batch=16),  # `./run effect`: <= 3 min
    "plateau": Plan(150, 600, FIVE, ALL, eval_every=50, eval_batches=4, batch=16),  # `./run effect --plateau`
    "small": Plan(8, 3, (0,), ALL, eval_every=3, eval_batches=1, batch=8, pretrain_batch=8),  # the suite's
}
CHAIN_B = {"branching": 2, "probs": (0.9, 0.1)}  # the SFT task's language: one per seed


def _sha256(batches: list[dict]) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        for key in sorted(batch):
            digest.update(key.encode())
            digest.update(batch[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


def _chains(seed: int) -> tuple[syn.Chain, syn.Chain]:
    """The seed's pretraining language (chain A) and SFT task's language (chain B)."""
    return syn.make_chain(gpt.VOCAB, 1 + seed), syn.make_chain(gpt.VOCAB, 100 + seed, **CHAIN_B)


def _pretrain(plan: Plan, seed: int) -> tuple[dict, dict]:
    """The seed's pretrained weights, and how the pretraining went (held out: 2 more batches, every position)."""
    chain_a, _ = _chains(seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    make = lambda: syn.pretrain_batch(chain_a, gpt.VOCAB, plan.pretrain_batch, plan.pretrain_seq, gen)
    batches = [make() for _ in range(plan.pretrain_steps)]
    model = gpt.build_model(1, seed=cpu_runtime.SEED + seed)
    losses = training.pretrain(model, batches, plan.pretrain_lr)
    held_out = [make(), make()]
    for batch in held_out:
        batch["roles"] = torch.full_like(batch["labels"], syn.ROLES.index("answer"))  # every position counts
    info = {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "mtp_num_layers": model.config.mtp_num_layers,
        "mtp_loss_scaling_factor": model.config.mtp_loss_scaling_factor,
        "lm_loss_first": losses[0],
        "lm_loss_last": losses[-1],
        "held_out": training.evaluate(model, held_out),
        "weights_sha256": gpt.weights_sha256(model),
        "data_sha256": _sha256(batches),
    }
    gpt.reset_mtp_tracker()
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}, info


def _step_one(result: gpt.StepResult, batch: dict) -> dict:
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


def _evaluate(model, held_out: list[dict], plan: Plan) -> dict:
    return {**training.evaluate(model, held_out), **training.speculative(model, held_out, plan.new_tokens)}


def _fine_tune(pretrained: dict, plan: Plan, setting: str, seed: int) -> dict:
    """SFT from the seed's pretrained weights on the seed's task and batches of this setting."""
    chain_a, chain_b = _chains(seed)
    prompts = chain_b if setting == "same-language" else chain_a
    gen = torch.Generator().manual_seed(1000 * seed + ALL.index(setting))
    make = lambda: syn.sft_batch(prompts, chain_b, SETTINGS[setting], gpt.VOCAB, plan.batch, gen)
    held_out = [make() for _ in range(plan.eval_batches)]
    train = [make() for _ in range(plan.sft_steps)]
    model = gpt.build_model(1)
    model.load_state_dict(pretrained, strict=False)  # strict=False: the state dict's _extra_state entries are None
    gpt.reset_mtp_tracker()
    evals = {0: _evaluate(model, held_out, plan)}
    trace = {"logged": [], "lm_loss": []}
    step_one = None
    for step, result in training.adam_steps(model, train, plan.sft_lr, record=lambda step: step == 1):
        if step == 1:
            step_one = _step_one(result, train[0])
        trace["logged"].append(result.logged)
        trace["lm_loss"].append(result.lm_loss)
        if step in plan.eval_steps():
            evals[step] = _evaluate(model, held_out, plan)
    return {
        "setting": setting,
        "seed": seed,
        "data_sha256": _sha256(held_out + train),
        "weights_sha256": gpt.weights_sha256(model),
        "step_one": step_one,
        "trace": trace,
        "evals": evals,
    }


def measure(size: str) -> dict:
    """The arm: plan, per seed a pretraining and one fine-tuning run per setting, and where the time went."""
    plan = PLANS[size]
    cpu_runtime.init_distributed()
    pretrain, runs, seconds = [], [], {"pretrain": 0.0, "fine_tune": 0.0}
    for seed in plan.seeds:
        started = time.perf_counter()
        weights, info = _pretrain(plan, seed)
        pretrain.append(info)
        pretrained_at = time.perf_counter()
        runs += [_fine_tune(weights, plan, setting, seed) for setting in plan.settings]
        seconds["pretrain"] += pretrained_at - started
        seconds["fine_tune"] += time.perf_counter() - pretrained_at
    return {
        "plan": {**asdict(plan), "eval_steps": plan.eval_steps()},
        "pretrain": pretrain,
        "runs": runs,
        "pretrain_seconds": seconds["pretrain"],
        "fine_tune_seconds": seconds["fine_tune"],
    }
