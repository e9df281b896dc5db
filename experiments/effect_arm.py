"""One arm of the experiments (experiments.effect, experiments.repro), run by the worker with one tree first on the
import path: `python -m tinymodel.worker call --function experiments.effect_arm:measure|reproduce --arg PLAN`.

Per seed: a fresh initialisation, a pretraining language (chain A) and its packed BOS + text + EOS documents,
pretrained with an all-ones mask and no padding (both trees take the same steps, which the weights hash shows). Then
``measure`` fine-tunes a copy of those weights through Bridge's forward_step + Adam in each setting of its plan, on
that seed's SFT task (chain B, or chain A where the setting says so) and batches, and evaluates it on held-out batches
of the setting; ``reproduce`` takes one step on a report-like batch. Each finished seed is reported on one output line
(SEED_DONE) and, given Plan.keep, kept there: a later run of the same plan, code and tree reuses it. Returns raw
figures only (counts, sums, per-position CE, logged values); the modules that start the arms derive the rest.
"""

import hashlib
import importlib.metadata
import io
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from experiments import synthetic as syn
from experiments import training
from mtp_mask_fix.journal import write_atomic
from tinymodel import cpu_runtime, gpt, reference
from tinymodel.reference import mtp_ce_per_position, mtp_mask, mtp_positions


@dataclass(frozen=True)
class Plan:
    """What one arm does: the seeds, the settings it fine-tunes, and how much of everything."""

    seeds: tuple[int, ...]  # each: its own initialisation, pretraining language and text, SFT task and batches
    runs: tuple[tuple[str, ...], ...] = ()  # measure: per seed, the settings (SETTINGS) this arm fine-tunes
    pretrain_steps: int = 100
    sft_steps: int = 50
    eval_every: int = 25  # teacher-forced evaluation every this many SFT steps (and at 0); decoding at the last
    decode_at: tuple[int, ...] = ()  # SFT steps after which the held-out prompts are decoded too (and evaluated)
    eval_batches: int = 3
    batch: int = 16
    pretrain_batch: int = 16
    pretrain_seq: int = 32
    pretrain_lr: float = 3e-3
    sft_lr: float = 2e-3
    keep: str | None = None  # a directory where each finished seed is kept, and reused from by the same plan

    def eval_steps(self) -> list[int]:
        """The SFT steps after which the held-out batches are evaluated teacher-forced (0: before fine-tuning)."""
        return sorted({*range(0, self.sft_steps + 1, self.eval_every), self.sft_steps, *self.decode_at})

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        fields = json.loads(text)
        fields["seeds"] = tuple(fields["seeds"])
        fields["runs"] = tuple(map(tuple, fields["runs"]))
        fields["decode_at"] = tuple(fields.get("decode_at", ()))
        return cls(**fields)


@dataclass(frozen=True)
class Setting:
    """One SFT setting: its samples, the languages of their prompts and answers, what the MTP loss counts, its batches."""

    description: str
    sft: syn.SftSetting
    prompts: str  # "task": the SFT task's language (chain B); "pretraining": chain A, which the model was trained on
    order: int = 2  # the chain order of the SFT task's language
    # "bridge": whatever the tree passes to the model; "no-padding": every label but padding; "release-weight": the
    # loss mask, each position at the weight the release's all-ones mask gives it (release_weight)
    mtp_mask: str = "bridge"
    data: str | None = None  # the setting whose batches (and held-out batches) it uses; None: its own
    answers: str = "task"  # as prompts: the language the answers continue in


# Padded like the report's SFT set: pad id = EOS, each batch padded to its longest sample, prompts with a long tail of
# lengths. The factorial crosses the answers' length with the SFT language's chain order (experiments/PLAN.md).
ANSWERS = {"short": (1, 4), "long": (8, 16)}
ORDERS = {"first": 1, "second": 2}
DEFAULT_CELL = "long/second"  # where distinct-answers and padding-only run


def _setting(description: str, cell: str, prompts: str = "task", loss: str = "answer", **kw) -> Setting:
    answers, order = cell.split("/")
    sft = syn.SftSetting(cell, False, prompt_len=(8, 40), answer_len=ANSWERS[answers], loss=loss, prompt_tail=12.0)
    return Setting(description, sft, prompts, ORDERS[order], **kw)


# A setting's variant whose MTP loss the experiment sets (Setting.mtp_mask): its name's prefix, and what it does.
VARIANTS = {
    "no-padding": (
        "no-padding-mtp",
        "but the MTP loss counts prompt and answer, never padding "
        "(a mask this experiment gives the model, not Bridge's)",
    ),
    "release-weight": (
        "release-weight",
        "the MTP loss on the positions the fix counts, each at the weight the release gives it "
        "(a scale this experiment gives the MTP loss, not Bridge's)",
    ),
}


def _variant(name: str, mtp_mask: str) -> Setting:
    """``name``'s batches and LM loss, its MTP loss as VARIANTS says."""
    described = f"{name}'s batches and LM loss, {VARIANTS[mtp_mask][1]}"
    return replace(SETTINGS[name], description=described, mtp_mask=mtp_mask, data=name)


CELLS = [f"{answers}/{order}" for answers in ANSWERS for order in ORDERS]
# The report's batch: answer-only loss over 1-4 answer tokens + EOS (the report's 2-5 valid tokens per sample), prompt
# and answer in the pretraining language (as SQuAD is in a pretrained model's), short prompts with a tail of lengths,
# every batch padded to 64 positions: about 3/4 of the positions are padding, which in the plan's pilot put 0.92-0.93
# of the unpatched MTP loss at SFT step 1 on it (the report: 96.5 %; this model's padding CE is about 8, the
# report's 20-85).
REPORT_LIKE = syn.SftSetting("report-like", False, prompt_len=(4, 40), prompt_tail=6.0, answer_len=(1, 4), pad_to=64)
REPORT_BATCH = 16
SETTINGS = {
    **{
        f"same-language {cell}": _setting(
            "prompt and answer in the SFT task's language; answer-only loss; answers/chain order: " + cell, cell
        )
        for cell in CELLS
    },
    "distinct-answers": _setting(
        "the stress case: prompts in the pretraining language, answers in the task's; answer-only loss",
        DEFAULT_CELL,
        prompts="pretraining",
    ),
    "padding-only": _setting(
        "as distinct-answers, but the loss covers the whole sample: the fix masks only the padding",
        DEFAULT_CELL,
        prompts="pretraining",
        loss="sample",
    ),
    "report-like": Setting(
        "the report's regime: prompt and answer in the pretraining language, 1-4 answer tokens + EOS, answer-only "
        "loss, every batch padded to 64 positions",
        REPORT_LIKE,
        prompts="pretraining",
        answers="pretraining",
    ),
}
SPLIT = ("same-language short/first", "same-language long/second", "report-like")  # where the fix is split in two
BRIDGE_SETTINGS = tuple(SETTINGS)
SETTINGS |= {
    f"{VARIANTS[mask][0]} {name.removeprefix('same-language ')}": _variant(name, mask)
    for mask, names in (("no-padding", SPLIT), ("release-weight", BRIDGE_SETTINGS))
    for name in names
}
# The SFT task's language, one per seed and chain order (Setting.order), over 32 content tokens. With a first-order
# chain the draft depends only on the token the MTP head is fed, so long answers there soon reach the ceiling.
CHAIN_B = {"branching": 2, "probs": (0.9, 0.1), "alphabet": 32}


def _sha256(batches: list[dict]) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        for key in sorted(batch):
            digest.update(key.encode())
            digest.update(batch[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


def _stream(use: str, seed: int) -> int:
    """The random seed of one use of an experiment's seed: each use of each seed draws from a stream of its own (no
    two seeds share one, as offsets such as 1000 * seed + i would for some pairs)."""
    return int.from_bytes(hashlib.sha256(f"{use} {seed}".encode()).digest()[:8], "little") >> 1


def _generator(use: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(_stream(use, seed))


def _chains(seed: int, order: int = 2) -> tuple[syn.Chain, syn.Chain]:
    """The seed's pretraining language (chain A) and SFT task's language (chain B, of that order)."""
    a = syn.make_chain(gpt.VOCAB, _stream("chain A", seed))
    return a, syn.make_chain(gpt.VOCAB, _stream("chain B", seed), order=order, **CHAIN_B)


def _pretrain(plan: Plan, seed: int) -> tuple[dict, dict]:
    """The seed's pretrained weights, and how the pretraining went (held out: 2 more batches, every position)."""
    chain_a, _ = _chains(seed)
    gen = _generator("pretraining", seed)
    make = lambda: syn.pretrain_batch(chain_a, gpt.VOCAB, plan.pretrain_batch, plan.pretrain_seq, gen)
    batches = [make() for _ in range(plan.pretrain_steps)]
    model = gpt.build_model(1, seed=_stream("initialisation", seed))
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


def _model(pretrained: dict):
    model = gpt.build_model(1)
    model.load_state_dict(pretrained, strict=False)  # strict=False: the state dict's _extra_state entries are None
    gpt.reset_mtp_tracker()
    return model


def _no_padding(batch: dict) -> torch.Tensor:
    """Every label but the padding: the prompt's, the answer's and its EOS."""
    return (batch["roles"] != syn.ROLES.index("padding")).float()


def release_weight(batch: dict) -> float:
    """The factor that gives each depth-1 position the loss mask counts the weight it has under the release: core
    divides the MTP loss by the positions it counts, the release's all-ones mask counts them all, the fix the mask's."""
    return float(mtp_mask(batch["loss_mask"], 1).sum() / mtp_mask(torch.ones_like(batch["loss_mask"]), 1).sum())


MTP_MASKS = {  # Setting.mtp_mask: (the MTP loss's mask, its scale), each of a batch; None: what Bridge passes, 1
    "bridge": (None, None),
    "no-padding": (_no_padding, None),
    "release-weight": (lambda batch: batch["loss_mask"], release_weight),
}


def _step_one(result: gpt.StepResult, batch: dict) -> dict:
    """The report's step-1 figures, and per position: depth-1 CE, loss weight, mask, target role and prediction."""
    seq = batch["labels"].shape[1]
    logits = result.mtp_logits[0][:, mtp_positions(seq, 1)]
    return {
        "lm_loss": result.lm_loss,
        "grad_norm": result.grad_norm,
        "logged": result.logged,
        "mtp_ce": mtp_ce_per_position(result.mtp_logits[0], batch["labels"], 1),
        "mtp_loss_weight": result.mtp_loss_weights[0][:, mtp_positions(seq, 1)],
        "mtp_mask": mtp_mask(batch["loss_mask"], 1),
        "target_role": batch["roles"][:, 1:],  # depth 1 at t predicts labels[t + 1]
        "target": batch["labels"][:, 1:],
        "predicted": logits.argmax(-1),
        "top_logit": logits.max(-1).values,
        "target_logit": logits.gather(-1, batch["labels"][:, 1:, None])[..., 0],
    }


def _fine_tune(pretrained: dict, plan: Plan, name: str, seed: int) -> dict:
    """SFT from the seed's pretrained weights on the seed's task and batches of this setting."""
    setting = SETTINGS[name]
    language = dict(zip(("pretraining", "task"), _chains(seed, setting.order)))
    gen = _generator(f"SFT {setting.data or name}", seed)
    make = lambda: syn.sft_batch(
        language[setting.prompts], language[setting.answers], setting.sft, gpt.VOCAB, plan.batch, gen
    )
    held_out = [make() for _ in range(plan.eval_batches)]
    train = [make() for _ in range(plan.sft_steps)]
    model = _model(pretrained)
    evals = {0: training.evaluate(model, held_out)}
    step_one = None
    mask_of, scale_of = MTP_MASKS[setting.mtp_mask]
    steps = training.adam_steps(
        model, train, plan.sft_lr, record=lambda step: step == 1, mtp_mask_of=mask_of, mtp_scale_of=scale_of
    )
    decode = lambda: training.speculative(model, held_out, setting.sft.answer_len[1] + 1)
    decoded = {}
    for step, result in steps:
        if step == 1:
            step_one = _step_one(result, train[0])
        if step in plan.eval_steps():
            evals[step] = training.evaluate(model, held_out)
        if step in plan.decode_at:
            decoded[step] = decode()
    return {
        "setting": name,
        "seed": seed,
        "mtp_mask": setting.mtp_mask,
        "data_sha256": _sha256(held_out + train),
        "weights_sha256": gpt.weights_sha256(model),
        "step_one": step_one,
        "evals": evals,
        "decoded": decoded,
        "speculative": decoded.get(plan.sft_steps) or decode(),
    }


SEED_DONE = "seed done: "  # how an arm's output line reporting a finished seed begins (JSON follows)


def _code_digest() -> str:
    """What decides a seed's figures besides its plan: this code, the tree's gpt_step.py, torch and megatron-core."""
    import megatron.bridge.training.gpt_step as gpt_step

    # The distributions' versions: megatron.core.__version__ carries the HEAD of whatever git tree holds the package
    # (this clone, for .venv), so every commit here would change it.
    digest = hashlib.sha256(" ".join(map(importlib.metadata.version, ("torch", "megatron-core"))).encode())
    for module in (gpt_step, syn, training, gpt, cpu_runtime, reference, sys.modules[__name__]):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def _kept_path(plan: Plan, i: int, code: str) -> Path | None:
    """Where the plan's i-th seed is kept (None: nothing kept): named by the seed and a hash of all that decides it."""
    if plan.keep is None:
        return None
    fields = asdict(plan) | {"seeds": plan.seeds[i], "runs": plan.runs[i] if plan.runs else (), "keep": None}
    key = hashlib.sha256(f"{json.dumps(fields, sort_keys=True)} {code}".encode()).hexdigest()
    return Path(plan.keep) / f"seed-{plan.seeds[i]}-{key[:16]}.pt"


def _each_seed(plan: Plan, after_pretraining) -> dict:
    """Per seed, pretraining then ``after_pretraining(weights, seed, i)`` (a list of runs; i: the seed's place in
    the plan), each seed kept as it finishes (Plan.keep) and one kept earlier reused; where the time went."""
    cpu_runtime.init_distributed()
    code = _code_digest()
    seeds = []
    for i, seed in enumerate(plan.seeds):
        path = _kept_path(plan, i, code)
        if path is not None and path.exists():
            record = torch.load(path, weights_only=False) | {"reused": True}
        else:
            started, cpu = time.perf_counter(), time.process_time()
            weights, info = _pretrain(plan, seed)
            pretrained_at = time.perf_counter()
            record = {
                "seed": seed,
                "pretrain": info,
                "runs": after_pretraining(weights, seed, i),
                "pretrain_seconds": pretrained_at - started,
                "fine_tune_seconds": time.perf_counter() - pretrained_at,
                "cpu_seconds": time.process_time() - cpu,  # the same work's CPU time: its wall time on an idle core
            }
            if path is not None:
                buffer = io.BytesIO()
                torch.save(record, buffer)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, buffer.getvalue())
            record["reused"] = False
        seeds.append(record)
        done = {key: record[key] for key in ("seed", "reused", "pretrain_seconds", "fine_tune_seconds", "cpu_seconds")}
        print(SEED_DONE + json.dumps(done | {"kept": str(path) if path else None}), flush=True)
    ran = [record for record in seeds if not record["reused"]]
    return {
        "plan": {**asdict(plan), "eval_steps": plan.eval_steps()},
        "pretrain": [record["pretrain"] for record in seeds],
        "runs": [run for record in seeds for run in record["runs"]],
        **{
            key: sum(record[key] for record in ran) for key in ("pretrain_seconds", "fine_tune_seconds", "cpu_seconds")
        },
        "reused": {record["seed"]: record["cpu_seconds"] for record in seeds if record["reused"]},
    }


def measure(plan_json: str) -> dict:
    """The effect arm: per seed a pretraining and one fine-tuning run per setting of the plan (Plan.to_json)."""
    plan = Plan.from_json(plan_json)
    return _each_seed(plan, lambda weights, seed, i: [_fine_tune(weights, plan, s, seed) for s in plan.runs[i]])


def _report_step(pretrained: dict, seed: int, _: int) -> list[dict]:
    """One SFT step on the seed's report-like batch (chain A prompts and answers), per-position figures recorded."""
    chain_a, _ = _chains(seed)
    gen = _generator("report batch", seed)
    batch = syn.sft_batch(chain_a, chain_a, REPORT_LIKE, gpt.VOCAB, REPORT_BATCH, gen)
    result = gpt.run_step(_model(pretrained), batch)
    return [{"seed": seed, "data_sha256": _sha256([batch]), **_step_one(result, batch)}]


def reproduce(plan_json: str) -> dict:
    """The repro arm: per seed a pretraining and one step on a report-like batch (the plan: Plan.to_json)."""
    return _each_seed(Plan.from_json(plan_json), _report_step)
