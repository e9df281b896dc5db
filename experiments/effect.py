"""What the bug costs the MTP head as a drafter: per seed the same pretraining, then SFT in the settings of
experiments/PLAN.md, the release as shipped against the release + patch, measured by speculative decoding.

    ./run effect [--seeds A-B] [--out DIR] [--keep DIR]   the plan's seeds, a short SFT (prints its time)
    ./run effect --control                                 the release in both arms: every contrast "no difference"
    ./run effect --plateau                                 three settings, SFT to a plateau (PLATEAU)

The analysis (settings, endpoints, seeds, the Holm families, the verdict words) is experiments/PLAN.md's. Each arm is
a process with its own tree first on the import path (experiments.effect_arm says what it does); each finished seed
is said as it comes and kept under --keep, and the same command reuses it, so a run that stops (a signal, a failed
or stalled arm: both are named) resumes where it stopped. The settings `no-padding-mtp <setting>` give the model an
MTP mask of their own (prompt and answer, never padding), so they do not depend on the tree; their runs are split
between the two processes, and the suite checks that both trees give them bit-identical weights. Every figure is
measured in the run; nothing here asserts what the effect is.

figures.json (--out; every number measured in the run):

    size ("short" | "plateau" | "small"), control, seeds, plan, model, wall_seconds, metrics (id: label; PRIMARY first)
    arms.<arm>            "unpatched" (the release as shipped) | "patched" (the tree under test): tree, gpt_step_file,
                          runs (per seed, the settings it ran), pretrained_weights_sha256 (per seed),
                          sft_data_sha256 / fine_tuned_weights_sha256 (per setting, per seed: null where not run),
                          pretrain_seconds, fine_tune_seconds (wall), cpu_seconds (theirs in CPU time) of the seeds
                          run now, reused (seed: its CPU seconds, of the seeds kept from an earlier run), peak_rss_mib
    same_pretrained_weights, same_data   both arms started from equal weights and saw equal batches (hashes)
    shared_runs_equal     for a run both arms made (a setting whose MTP mask is the experiment's): equal weights
    pretrain              per seed: lm_loss_first, lm_loss_last, held-out lm_top1 and mtp_top1 (every position)
    settings.<setting>    per Bridge setting run: description; conclusion (one line, Holm-adjusted); runs.<label> (the
                          arm that ran it, per seed: where; step_one: SFT step 1's figures, each per seed;
                          final.<metric>, per seed; curves.<CURVES>: per evaluation step, per seed); step_one_mix
                          (share of the MTP targets per role) and step_one_ce (MTP CE per role, per seed: the same in
                          every run); contrasts: [{name, family, control, treatment, what, endpoint, <metric>:
                          experiments.stats.summary of the paired differences, the endpoint's with its holm}];
                          logged_minus_true.<label>: summary over seeds (the Bridge arms only)
"""

import json
import statistics
import sys
from pathlib import Path

from experiments import command, stats
from experiments.effect_arm import SETTINGS, Plan
from experiments.effect_arm import SPLIT as SPLIT_SETTINGS
from experiments.synthetic import ROLES
from maintain.repo import WORK
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.signals import Interrupted
from tinymodel.reference import loss_mass_on_masked


PRIMARY = "tokens-per-step"
METRICS = {  # id: row label; each over the same held-out prompts, after the last SFT step (experiments/PLAN.md)
    PRIMARY: "tokens per verify step",
    "acceptance-without-eos": "acceptance without the EOS draft",
    "acceptance": "acceptance",
    "teacher-forced": "teacher-forced top-1",
}
SMALLEST = 0.075  # the smallest difference on an endpoint this experiment cares about (experiments/PLAN.md)
DESCRIPTIVE = {"eos-share": "EOS drafts / drafts", "answer-tokens": "tokens per answer"}  # per run, no contrast
STEP_ONE = {
    "mtp_1_loss": "mtp_1 loss (logged)",
    "grad_norm": "grad norm",
    "lm_loss": "LM loss",
    "mtp_loss_mass_on_prompt": "MTP loss mass on the prompt",
    "mtp_loss_mass_on_padding": "MTP loss mass on padding",
}
SIZES = {  # Plan fields per size, over Plan's defaults (`./run effect`: "short")
    "short": {},
    "plateau": {"sft_steps": 600, "eval_every": 100},
    "small": dict(pretrain_steps=8, sft_steps=3, eval_every=3, eval_batches=1, batch=8, pretrain_batch=8),
}
# The time a seed takes an arm, per size, as the plan's pilot measured it on a 2-core machine shared with other jobs
# (experiments/PLAN.md): what "slower than expected" and the stall limit (command.STALL times it) are reckoned from.
SEED_SECONDS = {"small": 15, "short": 60, "plateau": 170}
# Run by both arms, each with its endpoint (experiments/PLAN.md): tokens per verify step where drafting speed can move,
# else the endpoint that moves there.
ENDPOINTS = {
    "same-language short/first": PRIMARY,
    "same-language long/second": PRIMARY,
    "distinct-answers": PRIMARY,
    "padding-only": PRIMARY,
    "report-like": PRIMARY,
    # Where drafting speed cannot move, the MTP head's teacher-forced top-1 on the answers: short/second's greedy
    # answers are one token + EOS (1 token per verify step, nearly every draft the EOS's), long/first's drafts are all
    # accepted in both arms (2 tokens per verify step, acceptance 1).
    "same-language short/second": "teacher-forced",
    "same-language long/first": "teacher-forced",
}
BRIDGE = tuple(ENDPOINTS)
# What --plateau runs: where the fix went against drafting speed, where it went for it, and the report's regime.
PLATEAU = ("same-language short/first", "same-language long/second", "report-like")
# Its MTP mask is the experiment's (never padding): run by either arm, one per setting the fix is split in.
SPLIT_BY = {name: f"no-padding-mtp {name.removeprefix('same-language ')}" for name in SPLIT_SETTINGS}
SHARED = tuple(SPLIT_BY.values())
FIX = ("the fix", "unpatched", "patched", "the fix", "primary")
SPLIT = "no padding in MTP"
# Per Bridge setting: its runs (label: the arm that made it and the setting it ran; None: either arm), and its
# contrasts (name, control, treatment, what the treatment is, Holm family).
VIEWS = {name: {"runs": {arm: (arm, name) for arm in command.ARMS}, "contrasts": [FIX]} for name in BRIDGE} | {
    name: {
        "runs": {"unpatched": ("unpatched", name), SPLIT: (None, shared), "patched": ("patched", name)},
        "contrasts": [
            FIX,
            ("padding's part", "unpatched", SPLIT, "masking the padding", "split"),
            ("prompt's part", SPLIT, "patched", "masking the prompt", "split"),
        ],
    }
    for name, shared in SPLIT_BY.items()
}
KEEP = WORK / "effect"  # where `./run effect` keeps each finished seed (--keep)
DEFAULT_SEEDS = {"short": "100-161", "plateau": "100-115"}  # the confirmatory seeds of experiments/PLAN.md


def plans(size: str, seeds: tuple[int, ...], control: bool = False, keep: Path | None = None) -> dict[str, Plan]:
    """Each arm's plan: every Bridge setting per seed and about half the shared ones (all in the small run, none in a
    control); at the plateau only PLATEAU's settings, without the split. ``keep``: the
    directory under which each arm keeps its finished seeds."""
    bridge, shared = (PLATEAU, ()) if size == "plateau" else (BRIDGE, () if control else SHARED)
    runs = {
        arm: [
            bridge + tuple(s for k, s in enumerate(shared) if size == "small" or (i + k) % 2 == j)
            for i, _ in enumerate(seeds)
        ]
        for j, arm in enumerate(command.ARMS)
    }
    return {
        arm: Plan(seeds=seeds, runs=tuple(runs[arm]), keep=keep and str(keep / arm), **SIZES[size])
        for arm in command.ARMS
    }


def start_effect(
    size: str, seeds: tuple[int, ...], trees: dict | None = None, control: bool = False, keep: Path | None = None
) -> command.Arms:
    """Both arms started, not awaited (finish_effect takes them). ``trees``: default the release and the view;
    ``keep``: where each arm keeps its finished seeds and reuses them from (None: nowhere)."""
    trees = trees or command.trees()
    if control:
        trees = dict.fromkeys(command.ARMS, trees["unpatched"])
    arm_plans = {a: p.to_json() for a, p in plans(size, seeds, control, keep).items()}
    return command.Arms("experiments.effect_arm:measure", trees, arm_plans, SEED_SECONDS[size], keep)


def finish_effect(arms: command.Arms, size: str, control: bool = False) -> dict:
    """Wait for both arms; the figures, as figures.json holds them."""
    figures = figures_of(size, arms.trees, arms.wait(), control)
    figures["wall_seconds"] = arms.seconds()
    return json.loads(json.dumps(figures))  # exactly what the file holds (tuples become lists)


# ---------------------------------------------------------------- figures from the arms' payloads


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None  # None: nothing counted (e.g. no draft: every greedy answer ended at once)


def _logged_minus_true(sums: dict) -> float:
    """Core's logged acceptance minus MTP depth-1 top-1 on the loss positions (what it logs with the mask)."""
    return sums["logged_acceptance"] - _ratio(sums["mtp_hits"], sums["mtp_counted"])


# Per evaluation step (teacher-forced, on the held-out batches): core's inflation of its acceptance, and how far the
# MTP head and the LM have got (whether the SFT has reached a plateau).
CURVES = {
    "logged-minus-true": _logged_minus_true,
    "teacher-forced": lambda sums: _ratio(sums["mtp_answer_hits"], sums["mtp_answer_counted"]),
    "lm-loss": lambda sums: _ratio(sums["lm_ce_sum"], sums["lm_counted"]),
}


def final_metrics(run: dict) -> dict[str, float | None]:
    """METRICS and DESCRIPTIVE of one run, after its last SFT step."""
    spec, last = run["speculative"], run["evals"][max(run["evals"])]
    return {
        PRIMARY: _ratio(spec["tokens"], spec["steps"]),
        "acceptance-without-eos": _ratio(
            spec["accepted"] - spec["eos_accepted"], spec["proposed"] - spec["eos_proposed"]
        ),
        "acceptance": _ratio(spec["accepted"], spec["proposed"]),
        "teacher-forced": _ratio(last["mtp_answer_hits"], last["mtp_answer_counted"]),
        "eos-share": _ratio(spec["eos_proposed"], spec["proposed"]),
        "answer-tokens": _ratio(spec["tokens"] + spec["answers"], spec["answers"]),
        "logged-minus-true": _logged_minus_true(last),
    }


def step_one_figures(step: dict) -> dict[str, float]:
    """SFT step 1 as the report logs it, and where the MTP loss mass went."""
    ce, weight, role = step["mtp_ce"], step["mtp_loss_weight"], step["target_role"]
    return {
        "mtp_1_loss": step["logged"]["mtp_1 loss"],
        "grad_norm": step["grad_norm"],
        "lm_loss": step["lm_loss"],
        **{
            f"mtp_loss_mass_on_{name}": loss_mass_on_masked(ce, weight, (role != ROLES.index(name)).float())
            for name in ("prompt", "padding")
        },
    }


def role_means(step: dict) -> dict[str, float | None]:
    """Step 1's MTP depth-1 CE, mean over the targets of each role (before the first update: weights as loaded)."""
    where = {role: step["target_role"] == i for i, role in enumerate(ROLES)}
    return {role: float(step["mtp_ce"][at].mean()) if at.any() else None for role, at in where.items()}


def _setting_figures(name: str, pick, split: bool) -> dict:
    """One setting's runs and contrasts: the arms', and where the setting's shared run was made, its split.

    Args:
        name: the Bridge setting.
        pick: ``pick(arm, setting)`` gives per seed that arm's run of the setting (arm None: either arm's).
        split: the setting's shared run was made (never in a control nor at the plateau).
    """
    view = VIEWS[name]
    if not split:
        view = {"runs": {k: v for k, v in view["runs"].items() if v[0]}, "contrasts": [FIX]}
    picked = {label: pick(*where) for label, where in view["runs"].items()}
    runs = {}
    for label, seeded in picked.items():
        finals = [final_metrics(run) for _, run in seeded]
        firsts = [step_one_figures(run["step_one"]) for _, run in seeded]
        runs[label] = {
            "where": [arm for arm, _ in seeded],
            "step_one": {key: [f[key] for f in firsts] for key in firsts[0]},
            "final": {key: [f[key] for f in finals] for key in finals[0]},
            "curves": {"steps": sorted(seeded[0][1]["evals"])}
            | {
                curve_name: [[curve(r["evals"][s]) for _, r in seeded] for s in sorted(seeded[0][1]["evals"])]
                for curve_name, curve in CURVES.items()
            },
        }
    first = next(iter(picked.values()))
    roles = [run["step_one"]["target_role"] for _, run in first]
    contrasts = []
    for contrast, before, after, what, family in view["contrasts"]:
        a, b = runs[before]["final"], runs[after]["final"]
        endpoint = ENDPOINTS[name] if family == "primary" else PRIMARY
        contrasts.append(
            {"name": contrast, "family": family, "control": before, "treatment": after, "what": what}
            | {"endpoint": endpoint}
            | {metric: stats.paired(a[metric], b[metric]) for metric in METRICS}
        )
        contrasts[-1]["negative_of"] = negative_of(contrasts[-1], contrasts[:-1])
    return {
        "description": SETTINGS[name].description,
        "runs": runs,
        "step_one_mix": {
            role: statistics.fmean(float((r == i).float().mean()) for r in roles) for i, role in enumerate(ROLES)
        },
        "step_one_ce": {label: [role_means(run["step_one"]) for _, run in seeded] for label, seeded in picked.items()},
        "contrasts": contrasts,
        "logged_minus_true": {
            label: stats.summary(runs[label]["final"]["logged-minus-true"])
            for label, (arm, _) in view["runs"].items()
            if arm is not None
        },
    }


def negative_of(contrast: dict, earlier: list[dict]) -> str | None:
    """The name of an earlier contrast on the same endpoint whose differences are this one's negated, not all zero
    (printed once)."""
    endpoint = contrast["endpoint"]
    values = contrast[endpoint]["values"]
    negated = [None if v is None else -v for v in values]
    same = [c for c in earlier if c["endpoint"] == endpoint]
    return next((c["name"] for c in same if c[endpoint]["values"] == negated and any(values)), None)


def conclusion(name: str, contrasts: list[dict]) -> str:
    """One line: per contrast, the Holm-adjusted verdict on the primary endpoint, its interval and the seeds' signs."""
    parts = []
    for c in contrasts:
        s = c[c["endpoint"]]
        if c["negative_of"]:
            parts.append(f"{c['name']}: the exact negative of {c['negative_of']} in every seed")
            continue
        level = f" at {s['holm']['confidence']:.2%}" if s["holm"]["interval"] else ""
        size = stats.size(s, SMALLEST)
        parts.append(
            f"{c['name']} ({METRICS[c['endpoint']]}): {stats.verdict(s, c['what'])}, "
            f"{stats.interval(s, adjusted=True)}{level}{size and f', {size}'} (Holm p {s['holm']['p']:.3f}; "
            f"{stats.signs(s)})"
        )
    return f"{name}: " + " | ".join(parts)


def settings_run(by_arm: dict[str, dict], seeds: list[int]) -> set[str]:
    """The settings run for every seed, by either arm: each shared one is run by one arm per seed, in turn.

    Args:
        by_arm: per arm, its runs by (setting, seed).
        seeds: the plan's seeds.

    Returns:
        Their names.
    """
    return {name for name in BRIDGE + SHARED if all(any((name, s) in runs for runs in by_arm.values()) for s in seeds)}


def figures_of(size: str, trees: dict, payloads: dict[str, dict], control: bool) -> dict:
    """The figures (format: this module's docstring) from each arm's raw payload."""
    plan = payloads["unpatched"]["plan"]
    seeds = plan["seeds"]
    by_arm = {arm: {(r["setting"], r["seed"]): r for r in payloads[arm]["runs"]} for arm in command.ARMS}

    def pick(arm: str | None, setting: str) -> list[tuple[str, dict]]:
        arms = command.ARMS if arm is None else (arm,)
        return [next((a, by_arm[a][(setting, s)]) for a in arms if (setting, s) in by_arm[a]) for s in seeds]

    ran = settings_run(by_arm, seeds)
    settings = {name: _setting_figures(name, pick, SPLIT_BY.get(name) in ran) for name in BRIDGE if name in ran}
    for family in ("primary", "split"):
        stats.holm(
            [c[c["endpoint"]] for data in settings.values() for c in data["contrasts"] if c["family"] == family]
        )
    for name, data in settings.items():
        data["conclusion"] = conclusion(name, data["contrasts"])
    pretrain = payloads["unpatched"]["pretrain"]
    return {
        "size": size,
        "control": control,
        "seeds": seeds,
        "plan": {k: v for k, v in plan.items() if k != "runs"},
        "metrics": METRICS | DESCRIPTIVE,
        "model": {key: pretrain[0][key] for key in ("num_parameters", "mtp_num_layers", "mtp_loss_scaling_factor")},
        "arms": {
            arm: {
                "tree": str(trees[arm]),
                "gpt_step_file": payloads[arm]["gpt_step_file"],
                "runs": payloads[arm]["plan"]["runs"],
                "pretrained_weights_sha256": [p["weights_sha256"] for p in payloads[arm]["pretrain"]],
                **{
                    key: {
                        setting: [by_arm[arm].get((setting, s), {}).get(field) for s in seeds]
                        for setting in BRIDGE + SHARED
                    }
                    for key, field in (
                        ("sft_data_sha256", "data_sha256"),
                        ("fine_tuned_weights_sha256", "weights_sha256"),
                    )
                },
                **{
                    k: payloads[arm][k]
                    for k in ("pretrain_seconds", "fine_tune_seconds", "cpu_seconds", "peak_rss_mib", "reused")
                },
            }
            for arm in command.ARMS
        },
        "same_pretrained_weights": len(
            {tuple(p["weights_sha256"] for p in payloads[a]["pretrain"]) for a in command.ARMS}
        )
        == 1,
        "same_data": all(
            by_arm["unpatched"][key]["data_sha256"] == run["data_sha256"]
            for key, run in by_arm["patched"].items()
            if key in by_arm["unpatched"]
        ),
        "shared_runs_equal": [
            by_arm["unpatched"][key]["weights_sha256"] == run["weights_sha256"]
            for key, run in by_arm["patched"].items()
            if key in by_arm["unpatched"] and key[0] in SHARED
        ],
        "pretrain": [
            {"seed": seed, "lm_loss_first": p["lm_loss_first"], "lm_loss_last": p["lm_loss_last"]}
            | {f"{h}_top1": _ratio(p["held_out"][f"{h}_hits"], p["held_out"][f"{h}_counted"]) for h in ("lm", "mtp")}
            for seed, p in zip(seeds, pretrain)
        ],
        "settings": settings,
    }


# ---------------------------------------------------------------- the printout


def _mean(values: list[float | None]) -> str:
    defined = [v for v in values if v is not None]
    return f"{statistics.fmean(defined):.3f}" if defined else "-"


def run_label(figures: dict) -> str:
    """Size and seeds of a run, and the model: what every printed figure carries."""
    seeds, plan = figures["seeds"], figures["plan"]
    listed = f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))
    return (
        f"size {figures['size']} ({plan['sft_steps']} SFT steps), seeds {listed} (n={len(seeds)}), "
        f"tiny model ({figures['model']['num_parameters']} parameters)"
        + (", control: the release in both arms" if figures["control"] else "")
    )


def format_tables(figures: dict) -> str:
    """Per setting SFT step 1 and the endpoints after the last step with unadjusted paired intervals, then one line per
    setting with its Holm-adjusted verdicts, then the time taken."""
    plan, pre = figures["plan"], figures["pretrain"]
    lines = [
        f"== {run_label(figures)}",
        f"pretraining ({plan['pretrain_steps']} steps per seed, BOS + text + EOS documents): LM loss "
        f"{_mean([p['lm_loss_first'] for p in pre])} -> {_mean([p['lm_loss_last'] for p in pre])}, held-out top-1 LM "
        f"{_mean([p['lm_top1'] for p in pre])}, MTP {_mean([p['mtp_top1'] for p in pre])} (mean over seeds); same "
        f"pretrained weights in both arms: {figures['same_pretrained_weights']}, same data: {figures['same_data']}",
        f"after {plan['sft_steps']} SFT steps, on {plan['eval_batches'] * plan['batch']} held-out prompts per run; the "
        "primary endpoint: accepted tokens per verify step, the MTP head a k=1 drafter (experiments/PLAN.md)",
    ]
    width, cell = 44, 19
    for name, data in figures["settings"].items():
        labels = list(data["runs"])
        head = f"{'':{width}}" + "".join(f"{label:>{cell}}" for label in labels)
        row = lambda label, cells: f"{label:{width}}" + "".join(f"{c:>{cell}}" for c in cells)
        mix = ", ".join(f"{role} {share:.1%}" for role, share in data["step_one_mix"].items())
        lines += ["", f"== setting {name}: {data['description']}"]
        lines += [f"SFT step 1, same weights and batch in every run (mean over seeds); MTP targets: {mix}", head]
        for role in ROLES:
            lines.append(
                row(f"MTP CE on {role} targets", [_mean([ce[role] for ce in data["step_one_ce"][r]]) for r in labels])
            )
        for key, label in STEP_ONE.items():
            lines.append(row(label, [_mean(data["runs"][r]["step_one"][key]) for r in labels]))
        mass = data["runs"]["unpatched"]["step_one"]["mtp_loss_mass_on_padding"]
        lines.append(f"unpatched MTP loss mass on padding, per seed: min {min(mass):.3f}, max {max(mass):.3f}")
        lines += [f"after {plan['sft_steps']} SFT steps (mean over seeds)", head]
        for metric, label in figures["metrics"].items():
            lines.append(row(label, [_mean(data["runs"][r]["final"][metric]) for r in labels]))
        curves = {r: data["runs"][r]["curves"] for r in labels}
        lines.append("teacher-forced top-1 and held-out LM loss after each evaluated SFT step (mean over seeds)")
        for k, step in enumerate(curves[labels[0]]["steps"]):
            lines.append(
                row(
                    f"  step {step}",
                    [f"{_mean(c['teacher-forced'][k])} / {_mean(c['lm-loss'][k])}" for c in curves.values()],
                )
            )
        for c in data["contrasts"]:
            lines.append(f"{c['treatment']} - {c['control']} ({c['name']}), paired by seed: mean [95 % t, unadjusted]")
            for metric, label in METRICS.items():
                lines.append(f"  {label:{width - 2}}{stats.interval(c[metric])}; {stats.signs(c[metric])}")
        lines.append("logged minus true acceptance (core's mtp_1_acceptance_rate - MTP top-1 on the loss positions):")
        for label, s in data["logged_minus_true"].items():
            lines.append(f"  {label:{width - 2}}{stats.interval(s)}; {stats.signs(s, 'above 0', 'below 0')}")
    lines += [
        "",
        f"== Holm at family-wise {stats.ALPHA} over the fix in every setting, each on its endpoint, and apart over the "
        f"padding's and the prompt's parts, on {METRICS[PRIMARY]} (experiments/PLAN.md): verdict, mean "
        f"[Holm-adjusted interval], and where the interval settles it, its size against +-{SMALLEST}",
        *(f"-> {data['conclusion']}" for data in figures["settings"].values()),
        "",
        time_taken(figures),
    ]
    return "\n".join(lines)


def time_taken(figures: dict) -> str:
    """Wall time of the run, and per arm what its seeds took (those kept from an earlier run apart)."""
    arms = figures["arms"]
    per_arm = []
    for arm in command.ARMS:
        a, reused = arms[arm], arms[arm]["reused"]
        text = (
            f"{arm} {len(figures['seeds']) - len(reused)} seeds run: pretraining {a['pretrain_seconds']:.0f} s + SFT "
            f"and evaluation {a['fine_tune_seconds']:.0f} s (CPU {a['cpu_seconds']:.0f} s), peak RSS "
            f"{a['peak_rss_mib']:.0f} MiB"
        )
        if reused:
            text += f", {len(reused)} seeds kept from an earlier run (CPU {sum(reused.values()):.0f} s then)"
        per_arm.append(text)
    return f"(wall {figures['wall_seconds']:.0f} s for both arms at once, their start included; per arm, wall: " + (
        "; ".join(per_arm) + ")"
    )


def run(args) -> tuple[str, Exit]:
    """`./run effect`: both arms and the tables, the figures into --out if given; exit 5 where a control differs, an arm
    failed or stalled."""
    size = "plateau" if args.plateau else "short"
    args.seeds = args.seeds or command.seeds(DEFAULT_SEEDS[size])
    cpu = SEED_SECONDS[size] * len(args.seeds)
    print(
        f"[effect] both arms, {len(args.seeds)} seeds, size {size}: about {cpu / 60:.0f} min per arm ({SEED_SECONDS[size]} "
        f"s a seed); each finished seed is kept in {args.keep} and reused by the same command",
        file=sys.stderr,
        flush=True,
    )
    arms = start_effect(size, args.seeds, control=args.control, keep=args.keep)
    try:
        figures = finish_effect(arms, size, args.control)
    except command.Stopped as stopped:
        return f"./run effect: {stopped}\n{arms.kept()}; nothing written", Exit.FAILED
    except Interrupted as signal:
        return f"./run effect: interrupted by {signal.name}: {arms.kept()}; nothing written", signal.code
    verdicts = [
        stats.verdict(c[c["endpoint"]], c["what"]) for d in figures["settings"].values() for c in d["contrasts"]
    ]
    differs = len(verdicts) - verdicts.count("no difference")
    control = f"control: {differs} of {len(verdicts)} contrasts say other than 'no difference'" * figures["control"]
    files = {"figures.json": json.dumps(figures, indent=1).encode()} if args.out else {}
    text = "\n".join(filter(None, [format_tables(figures), control, command.write(args.out, files)]))
    return text, Exit.FAILED if figures["control"] and differs else Exit.OK


def main(argv: list[str] | None = None) -> None:
    """The command line (experiments.command: what it shares with repro)."""
    said = ", ".join(f"{seeds}{'' if size == 'short' else f' with --{size}'}" for size, seeds in DEFAULT_SEEDS.items())
    parser = command.parser("./run effect", __doc__.split("\n\n")[0], None, said)
    steps = SIZES["plateau"]["sft_steps"], Plan.sft_steps
    parser.add_argument("--plateau", action="store_true", help="%d SFT steps instead of %d" % steps)
    parser.add_argument("--control", action="store_true", help="the release in both arms (a negative control)")
    parser.add_argument(
        "--keep",
        type=command.out_dir,
        default=KEEP,
        metavar="DIR",
        help="where each finished seed is kept and reused from by the same command (default .work/effect)",
    )
    command.main(parser, run, argv)


if __name__ == "__main__":
    main()
