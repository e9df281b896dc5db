"""The report's mechanism on the tiny model: after pretraining on BOS + text + EOS documents, one SFT step on a batch
padded as the report's (EOS repeated after the answer), unpatched (the release as shipped) and patched (release +
patch), each side a process with its own tree first on the import path; the report's figures beside this run's.

    ./run repro [--seeds A-B] [--out DIR]   seeds 0-4: per seed its own pretraining and batch

Every figure of this run is measured in it; the report's are quoted from #6103 as it logs them. Then each part of
the report's signature is checked against a stated criterion, and what does not appear is said.

figures.json (--out): seeds, batch (the first seed's: shape, loss tokens per sample), sides.<side> per seed (lm_loss, mtp_1_loss,
grad_norm, mtp_loss_mass_on_padding), positions per seed (MTP depth-1 CE per position and role, prediction, target,
top and target logit; the same weights in both sides), signature (each check: ours, the report's, holds).
"""

import json
import statistics
import sys

import torch

from experiments import command
from experiments.analysis import role_means, step_one_figures
from experiments.effect_arm import Plan
from experiments.synthetic import BOS, ROLES
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.signals import Interrupted


REPORT_URL = "https://github.com/NVIDIA-NeMo/Megatron-Bridge/issues/6103"
# As #6103 logs them (DeepSeek-V4-Pro SFT on SQuAD, iteration 1, without and with the mask): quoted, not measured.
REPORT = {
    "lm_loss": ("3.050079E+00", "3.042851E+00"),
    "mtp_1_loss": ("1.580068E+01", "4.416957E+00"),
    "grad_norm": ("85.956", "67.528"),
    "mtp_loss_mass_on_padding": ("96.5 %", ""),
}
REPORT_PROBE = (
    "mtp per-token CE: mean=21.606 median=1.950 p90=54.812 p99=72.253 max=85.188 frac(CE>20)=0.380",
    "mtp worst pos=189 ce=85.19 label=1 pred=0 logit_true=9.31 logit_max=94.50",
)
SIDES = {"unpatched": "before (unpatched)", "patched": "after (patched)"}
ROWS = (  # (figure, label, format)
    ("lm_loss", "lm loss", "{:.4f}"),
    ("mtp_1_loss", "mtp_1 loss", "{:.4f}"),
    ("grad_norm", "grad norm", "{:.3f}"),
    ("mtp_loss_mass_on_padding", "MTP loss mass on padding", "{:.1%}"),
)
PADDING_OVER_ANSWER = 4.0  # the reproduction's target: padding CE at least this many times the answer CE
SEVERAL = 2.0  # "several times": the unpatched mtp_1 loss over the patched (the report's is 3.6)


def _positions(step: dict) -> dict:
    """What the report's probe prints, over every MTP depth-1 position of the batch (the unpatched loss's)."""
    ce, role = step["mtp_ce"], step["target_role"]
    pad = role == ROLES.index("padding")
    worst = int(ce.argmax())
    row, col = divmod(worst, ce.shape[1])
    quantile = lambda q: float(torch.quantile(ce.flatten(), q))
    return {
        "ce": {
            "mean": float(ce.mean()),
            "median": quantile(0.5),
            "p90": quantile(0.9),
            "p99": quantile(0.99),
            "max": float(ce.max()),
            "frac_over_20": float((ce > 20).float().mean()),
        },
        "worst": {
            "position": col,
            "ce": float(ce[row, col]),
            "label": int(step["target"][row, col]),
            "pred": int(step["predicted"][row, col]),
            "logit_true": float(step["target_logit"][row, col]),
            "logit_max": float(step["top_logit"][row, col]),
            "role": ROLES[int(role[row, col])],
        },
        "ce_by_role": role_means(step),
        "padding_predicted_bos": float((step["predicted"][pad] == BOS).float().mean()),
        "padding_top_logit": float(step["top_logit"][pad].mean()),
        "padding_margin": float((step["top_logit"] - step["target_logit"])[pad].mean()),
        "per_position": {key: step[key].tolist() for key in ("mtp_ce", "target_role")},
    }


def figures_of(payloads: dict[str, dict]) -> dict:
    """The figures (format: this module's docstring) from both sides' payloads."""
    seeds = payloads["unpatched"]["plan"]["seeds"]
    steps = {side: payloads[side]["runs"] for side in SIDES}
    first = steps["unpatched"][0]
    per_step = {side: [step_one_figures(s) for s in steps[side]] for side in SIDES}
    sides = {side: {key: [f[key] for f in per_step[side]] for key, _, _ in ROWS} for side in SIDES}
    positions = [_positions(s) for s in steps["unpatched"]]
    return {
        "seeds": seeds,
        "plan": payloads["unpatched"]["plan"],
        "parameters": payloads["unpatched"]["pretrain"][0]["num_parameters"],
        "same_pretrained_weights": [p["weights_sha256"] for p in payloads["unpatched"]["pretrain"]]
        == [p["weights_sha256"] for p in payloads["patched"]["pretrain"]],
        "same_batches": [s["data_sha256"] for s in steps["unpatched"]] == [s["data_sha256"] for s in steps["patched"]],
        "batch": {
            "shape": list(first["mtp_ce"].shape[:1]) + [first["mtp_ce"].shape[1] + 1],
            "loss_tokens_per_sample": [int(n) for n in first["mtp_mask"].sum(1).tolist()],
        },
        "sides": sides,
        "positions": positions,
        "signature": signature(sides, positions),
    }


def _spread(values: list[float], fmt: str) -> str:
    text = fmt.format(statistics.fmean(values))
    return text if len(values) == 1 else f"{text} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def signature(sides: dict, positions: list[dict]) -> list[dict]:
    """Each part of the report's signature: what it is, ours (per seed), the report's, the criterion and whether it
    holds in every seed."""
    un, pa = sides["unpatched"], sides["patched"]
    ratio = lambda a, b: [x / y for x, y in zip(a, b)]
    quoted = lambda key: "{} / {} = {:.2f} x".format(*REPORT[key], float(REPORT[key][0]) / float(REPORT[key][1]))
    pad_ce = [p["ce_by_role"]["padding"] for p in positions]
    answer_ce = [p["ce_by_role"]["answer"] for p in positions]
    checks = [
        (
            "the model predicts BOS (token 0) at the padding",
            [p["padding_predicted_bos"] for p in positions],
            "{:.0%}",
            "every position with CE > 20 is padding and predicts 0",
            "at most padding positions",
            lambda v: v > 0.5,
        ),
        (
            f"padding CE at least {PADDING_OVER_ANSWER:g} x the answer CE (the patched mtp_1 loss)",
            ratio(pad_ce, answer_ce),
            "{:.2f} x",
            f"every padding position over 20, up to 85, against {REPORT['mtp_1_loss'][1]} (mtp_1 loss after)",
            f">= {PADDING_OVER_ANSWER:g}",
            lambda v: v >= PADDING_OVER_ANSWER,
        ),
        (
            f"unpatched mtp_1 loss several times the patched (>= {SEVERAL:g} x)",
            ratio(un["mtp_1_loss"], pa["mtp_1_loss"]),
            "{:.2f} x",
            quoted("mtp_1_loss"),
            f">= {SEVERAL:g}",
            lambda v: v >= SEVERAL,
        ),
        (
            "a higher grad norm unpatched",
            ratio(un["grad_norm"], pa["grad_norm"]),
            "{:.3f} x",
            quoted("grad_norm"),
            "> 1",
            lambda v: v > 1,
        ),
        (
            "the LM loss unchanged",
            [abs(a - b) for a, b in zip(un["lm_loss"], pa["lm_loss"])],
            "{:.1e}",
            "{} vs {} (two runs)".format(*REPORT["lm_loss"]),
            "equal to 1e-6",
            lambda v: v <= 1e-6,
        ),
    ]
    return [
        {
            "what": what,
            "ours": values,
            "format": fmt,
            "report": report,
            "criterion": rule,
            "holds": all(map(holds, values)),
        }
        for what, values, fmt, report, rule, holds in checks
    ]


def format_table(figures: dict) -> str:
    """The report's table beside this run's, the report's probe beside ours, then the signature, checked."""
    seeds, batch = figures["seeds"], figures["batch"]
    n = len(seeds)
    where = f"mean over seeds {seeds[0]}-{seeds[-1]} [min, max]" if n > 1 else f"seed {seeds[0]}"
    lines = [
        f"#6103 ({REPORT_URL}; DeepSeek-V4-Pro SFT on SQuAD, iteration 1) beside this run (tiny GPTModel with one MTP "
        f"layer, {figures['parameters']} parameters, pretrained {figures['plan']['pretrain_steps']} steps on BOS + "
        f"text + EOS documents; one step on a batch of {batch['shape'][0]} samples padded with EOS to {batch['shape'][1]} positions "
        f"({batch['shape'][0]}x{batch['shape'][1]} with {min(batch['loss_tokens_per_sample'])}-"
        f"{max(batch['loss_tokens_per_sample'])} loss tokens per sample for seed {seeds[0]}); {where})",
        f"{'':28}  {'report: before':>14}  {'after':>13}  {'here: ' + SIDES['unpatched']:>30}  {SIDES['patched']:>30}",
    ]
    for key, label, fmt in ROWS:
        ours = [_spread(figures["sides"][side][key], fmt) for side in SIDES]
        lines.append(f"{label:28}  {REPORT[key][0]:>14}  {REPORT[key][1]:>13}  {ours[0]:>30}  {ours[1]:>30}")
    lines += ["", "the report's probe (unpatched, per position):", *(f"  {line}" for line in REPORT_PROBE)]
    lines.append("this run's, the same figures (the unpatched loss counts every position):")
    for seed, p in zip(seeds, figures["positions"]):
        ce, w = p["ce"], p["worst"]
        lines.append(
            f"  seed {seed}: mtp per-token CE: mean={ce['mean']:.3f} median={ce['median']:.3f} p90={ce['p90']:.3f} "
            f"p99={ce['p99']:.3f} max={ce['max']:.3f} frac(CE>20)={ce['frac_over_20']:.3f}; worst pos={w['position']} "
            f"ce={w['ce']:.2f} label={w['label']} pred={w['pred']} logit_true={w['logit_true']:.2f} "
            f"logit_max={w['logit_max']:.2f} ({w['role']})"
        )
    lines.append(
        "  MTP CE by target role, "
        + where
        + ": "
        + ", ".join(
            f"{role} {_spread([p['ce_by_role'][role] for p in figures['positions']], '{:.2f}')}" for role in ROLES
        )
    )
    lines += ["", "the report's signature, here (each must hold in every seed):"]
    for check in figures["signature"]:
        verdict = "holds" if check["holds"] else "DOES NOT APPEAR"
        lines.append(
            f"  {check['what']}: {verdict}: {_spread(check['ours'], check['format'])} "
            f"(criterion {check['criterion']}; the report: {check['report']})"
        )
    if not all(check["holds"] for check in figures["signature"]):
        p = figures["positions"]
        lines.append(
            "  why: at the padding the model predicts BOS with a mean top logit of "
            f"{_spread([x['padding_top_logit'] for x in p], '{:.1f}')}, "
            f"{_spread([x['padding_margin'] for x in p], '{:.1f}')} above EOS's (the report's worst position: "
            f"{REPORT_PROBE[1].split('pred=0 ')[1]}): its CE there is about that margin"
        )
    return "\n".join(lines)


SEED_SECONDS = 10  # CPU seconds a seed takes a side on a quiet core: its pretraining and one step


def run(args) -> tuple[str, Exit]:
    """`./run repro`: both sides, the tables; the figures into --out if given; exit 5 where a side failed or stalled."""
    print(f"[repro] both sides, {len(args.seeds)} seeds: running", file=sys.stderr, flush=True)
    plan = Plan(seeds=args.seeds).to_json()
    trees, plans = command.trees(), {side: plan for side in SIDES}
    arms = command.Arms("experiments.effect_arm:reproduce", trees, plans, SEED_SECONDS, name="repro")
    try:
        figures = json.loads(json.dumps(figures_of(arms.wait())))
    except command.Stopped as stopped:
        return f"./run repro: {stopped}; nothing written", Exit.FAILED
    except Interrupted as signal:
        return f"./run repro: interrupted by {signal.name}: nothing written", signal.code
    files = {"figures.json": json.dumps(figures, indent=1).encode()} if args.out else {}
    text = "\n".join(filter(None, [format_table(figures), command.write(args.out, files)]))
    return text, Exit.OK


def main(argv: list[str] | None = None) -> None:
    """The command line (experiments.command: what it shares with effect)."""
    command.main(command.parser("./run repro", __doc__.split("\n\n")[0], "0-4"), run, argv)


if __name__ == "__main__":
    main()
