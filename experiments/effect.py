"""What the bug costs the MTP head as a drafter: per seed the same pretraining, then SFT in four settings, the
release as shipped against the release + patch, measured by speculative decoding on held-out prompts.

    ./run effect [--seeds A-B] [--out DIR]   seeds 0-9 x 4 settings, a short SFT (<= 4 min on 2 cores)
    ./run effect --plateau                   the same, SFT to a plateau (prints its time)

Primary endpoint, fixed before any run: accepted tokens per verify step of greedy speculative decoding with the MTP
head as a k=1 drafter (experiments.training.speculative), patched - unpatched, paired by seed. Alongside: the
acceptance of the drafts without the closing EOS's draft (which saves no step), the acceptance of all drafts, the
teacher-forced MTP top-1 on the answers (a prediction from the reference's prefix, not a speed-up), and per arm the
logged minus the true acceptance (core's mtp_1_acceptance_rate against MTP top-1 on the loss positions).

Each arm is a process with its own tree first on the import path (experiments.effect_arm says what it does). The
setting `no-padding-mtp` gives the model an MTP mask of its own (prompt and answer, never padding), so it does not
depend on the tree; its runs are split between the two processes by seed, and the suite checks that both trees give
it bit-identical weights. Every figure is measured in the run; nothing here asserts what the effect is.

figures.json (--out; every number measured in the run):

    size ("short" | "plateau" | "small"), seeds, plan, model, wall_seconds, metrics (id: label; PRIMARY first)
    arms.<arm>            "unpatched" (the release as shipped) | "patched" (the tree under test): tree, gpt_step_file,
                          runs (per seed, the settings it ran), pretrained_weights_sha256 (per seed),
                          sft_data_sha256 / fine_tuned_weights_sha256 (per setting, per seed: null where not run),
                          pretrain_seconds, fine_tune_seconds (wall), cpu_seconds (theirs in CPU time), peak_rss_mib
    same_pretrained_weights, same_data   both arms started from equal weights and saw equal batches (hashes)
    shared_runs_equal     for a run both arms made (a setting whose MTP mask is the experiment's): equal weights
    pretrain              per seed: lm_loss_first, lm_loss_last, held-out lm_top1 and mtp_top1 (every position)
    settings.<setting>    description; conclusion (one line, from the intervals); runs.<label> (the arm that ran it,
                          per seed: where; step_one: SFT step 1's figures, each per seed; final.<metric> and
                          curves.teacher-forced: per seed, per evaluation step); step_one_mix (share of the MTP
                          targets per role) and step_one_ce (MTP CE per role, per seed: the same in every run);
                          contrasts: [{name, control, treatment, <metric>: experiments.stats.summary of the paired
                          differences}]; logged_minus_true.<label>: summary over seeds (the Bridge arms only)
"""

import json
import math
import statistics
import sys

from experiments import command, stats
from experiments.effect_arm import SETTINGS, Plan
from experiments.synthetic import ROLES
from tinymodel.reference import loss_mass_on_masked


PRIMARY = "tokens-per-step"
METRICS = {  # id: what it is (each over the same held-out prompts, after the last SFT step)
    PRIMARY: "accepted tokens per verify step (k=1 MTP draft; the primary endpoint)",
    "acceptance-without-eos": "acceptance of the drafts, the closing EOS's draft left out",
    "acceptance": "acceptance of every draft",
    "teacher-forced": "teacher-forced MTP top-1 on the answers (not a speed-up)",
}
SHORT = {  # row labels
    PRIMARY: "tokens per verify step",
    "acceptance-without-eos": "acceptance without the EOS draft",
    "acceptance": "acceptance",
    "teacher-forced": "teacher-forced top-1",
    "eos-share": "EOS drafts / drafts",
    "answer-tokens": "tokens per answer",
}
DESCRIPTIVE = {  # per run, no contrast
    "eos-share": "share of the drafts that draft the closing EOS",
    "answer-tokens": "tokens per greedy answer (its EOS included)",
}
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
    "small": {
        "pretrain_steps": 8,
        "sft_steps": 3,
        "eval_every": 3,
        "eval_batches": 1,
        "batch": 8,
        "pretrain_batch": 8,
    },
}
TIMEOUT_S = {"small": 300, "short": 900, "plateau": 7200}  # an arm still running then is killed (the worker's rule)
BRIDGE = ("same-language", "distinct-answers", "padding-only")  # what the tree decides: run by both arms
SHARED = "no-padding-mtp"  # what the experiment decides: run by one arm per seed (by both in the suite's small run)
# Per setting: its runs (label: the arm that made it and the setting it ran; None: either arm) and its contrasts
# (name, control, treatment, what the treatment is).
VIEWS = {
    **{
        name: {
            "runs": {arm: (arm, name) for arm in command.ARMS},
            "contrasts": [("the fix", "unpatched", "patched", "the fix")],
        }
        for name in BRIDGE
    },
    SHARED: {
        "runs": {
            "unpatched": ("unpatched", "same-language"),
            "no padding in MTP": (None, SHARED),
            "patched": ("patched", "same-language"),
        },
        "contrasts": [
            ("padding out of the MTP loss", "unpatched", "no padding in MTP", "masking the padding"),
            ("prompt out of the MTP loss", "no padding in MTP", "patched", "masking the prompt"),
        ],
    },
}


def plans(size: str, seeds: tuple[int, ...]) -> dict[str, Plan]:
    """Each arm's plan: every Bridge setting per seed, and the shared setting for every other seed (both, in the
    small run: the suite compares them)."""
    runs = {arm: [] for arm in command.ARMS}
    for i, _ in enumerate(seeds):
        for j, arm in enumerate(command.ARMS):
            shared = (SHARED,) if size == "small" or i % 2 == j else ()
            runs[arm].append(BRIDGE + shared)
    return {arm: Plan(seeds=seeds, runs=tuple(runs[arm]), **SIZES[size]) for arm in command.ARMS}


def start_effect(size: str, seeds: tuple[int, ...], trees: dict | None = None) -> command.Arms:
    """Both arms started, not awaited (finish_effect takes them). ``trees``: default the release and the view."""
    trees = trees or command.trees()
    arm_plans = {a: p.to_json() for a, p in plans(size, seeds).items()}
    return command.Arms("experiments.effect_arm:measure", trees, arm_plans, TIMEOUT_S[size])


def finish_effect(arms: command.Arms, size: str) -> dict:
    """Wait for both arms; the figures, as figures.json holds them."""
    figures = figures_of(size, arms.trees, arms.wait())
    figures["wall_seconds"] = arms.seconds()
    return json.loads(json.dumps(figures))  # exactly what the file holds (tuples become lists)


# ---------------------------------------------------------------- figures from the arms' payloads


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None  # None: nothing counted (e.g. no draft: every greedy answer ended at once)


def _teacher_forced(sums: dict) -> float | None:
    """MTP depth-1 top-1 on the answer targets of one evaluation."""
    return _ratio(sums["mtp_answer_hits"], sums["mtp_answer_counted"])


def _logged_minus_true(sums: dict) -> float:
    """Core's logged acceptance minus MTP depth-1 top-1 on the loss positions (what it logs with the mask)."""
    return sums["logged_acceptance"] - _ratio(sums["mtp_hits"], sums["mtp_counted"])


def final_metrics(run: dict) -> dict[str, float | None]:
    """METRICS and DESCRIPTIVE of one run, after its last SFT step."""
    spec, last = run["speculative"], run["evals"][max(run["evals"])]
    return {
        PRIMARY: _ratio(spec["tokens"], spec["steps"]),
        "acceptance-without-eos": _ratio(
            spec["accepted"] - spec["eos_accepted"], spec["proposed"] - spec["eos_proposed"]
        ),
        "acceptance": _ratio(spec["accepted"], spec["proposed"]),
        "teacher-forced": _teacher_forced(last),
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
    out = {}
    for i, role in enumerate(ROLES):
        where = step["target_role"] == i
        out[role] = float(step["mtp_ce"][where].mean()) if where.any() else None
    return out


def _setting_figures(name: str, pick) -> dict:
    """One setting's runs and contrasts; ``pick(arm, setting)``: per seed, that arm's run (None: either arm's)."""
    view = VIEWS[name]
    picked = {label: pick(*where) for label, where in view["runs"].items()}
    runs = {}
    for label, seeded in picked.items():
        finals = [final_metrics(run) for _, run in seeded]
        firsts = [step_one_figures(run["step_one"]) for _, run in seeded]
        runs[label] = {
            "where": [arm for arm, _ in seeded],
            "step_one": {key: [f[key] for f in firsts] for key in firsts[0]},
            "final": {key: [f[key] for f in finals] for key in finals[0]},
            "curves": {
                "steps": sorted(seeded[0][1]["evals"]),
                **{
                    key: [[of(r["evals"][s]) for _, r in seeded] for s in sorted(seeded[0][1]["evals"])]
                    for key, of in (("teacher-forced", _teacher_forced), ("logged-minus-true", _logged_minus_true))
                },
            },
        }
    first = next(iter(picked.values()))
    roles = [run["step_one"]["target_role"] for _, run in first]
    contrasts = []
    for contrast, control, treatment, what in view["contrasts"]:
        a, b = runs[control]["final"], runs[treatment]["final"]
        contrasts.append(
            {"name": contrast, "control": control, "treatment": treatment, "what": what}
            | {metric: stats.paired(a[metric], b[metric]) for metric in METRICS}
        )
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
            if name in BRIDGE
        },
        "conclusion": conclusion(name, contrasts),
    }


def conclusion(name: str, contrasts: list[dict]) -> str:
    """One line: per contrast, the verdict of the primary endpoint and of two others, with intervals and seed counts."""
    parts = []
    for c in contrasts:
        items = []
        for metric in (PRIMARY, "acceptance-without-eos", "teacher-forced"):
            s = c[metric]
            verdict = f"{stats.verdict(s, c['what'])}, " if s["ci95"] is not None else ""
            items.append(f"{SHORT[metric]}: {verdict}{stats.interval(s)} ({stats.signs(s)})")
        parts.append(f"{c['name']}: " + "; ".join(items))
    return f"{name}: " + " | ".join(parts)


def figures_of(size: str, trees: dict, payloads: dict[str, dict]) -> dict:
    """The figures (format: this module's docstring) from each arm's raw payload."""
    plan = payloads["unpatched"]["plan"]
    seeds = plan["seeds"]
    by_arm = {arm: {(r["setting"], r["seed"]): r for r in payloads[arm]["runs"]} for arm in command.ARMS}

    def pick(arm: str | None, setting: str) -> list[tuple[str, dict]]:
        arms = command.ARMS if arm is None else (arm,)
        return [next((a, by_arm[a][(setting, s)]) for a in arms if (setting, s) in by_arm[a]) for s in seeds]

    settings = (*BRIDGE, SHARED)
    pretrain = payloads["unpatched"]["pretrain"]
    return {
        "size": size,
        "seeds": seeds,
        "plan": {k: v for k, v in plan.items() if k != "runs"},
        "metrics": METRICS | DESCRIPTIVE,
        "model": {
            "spec": "megatron-core GPTModel, local spec + MTP block, fp32, CPU; SFT steps via Bridge's forward_step",
            "parameters": pretrain[0]["num_parameters"],
            "mtp_num_layers": pretrain[0]["mtp_num_layers"],
            "mtp_loss_scaling_factor": pretrain[0]["mtp_loss_scaling_factor"],
        },
        "arms": {
            arm: {
                "tree": str(trees[arm]),
                "gpt_step_file": payloads[arm]["gpt_step_file"],
                "runs": payloads[arm]["plan"]["runs"],
                "pretrained_weights_sha256": [p["weights_sha256"] for p in payloads[arm]["pretrain"]],
                **{
                    key: {
                        setting: [by_arm[arm].get((setting, s), {}).get(field) for s in seeds] for setting in settings
                    }
                    for key, field in (
                        ("sft_data_sha256", "data_sha256"),
                        ("fine_tuned_weights_sha256", "weights_sha256"),
                    )
                },
                **{key: payloads[arm][key] for key in ("pretrain_seconds", "fine_tune_seconds", "cpu_seconds")},
                "peak_rss_mib": payloads[arm]["peak_rss_mib"],
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
            if key in by_arm["unpatched"] and key[0] == SHARED
        ],
        "pretrain": [
            {
                "seed": seed,
                "lm_loss_first": p["lm_loss_first"],
                "lm_loss_last": p["lm_loss_last"],
                "lm_top1": _ratio(p["held_out"]["lm_hits"], p["held_out"]["lm_counted"]),
                "mtp_top1": _ratio(p["held_out"]["mtp_hits"], p["held_out"]["mtp_counted"]),
            }
            for seed, p in zip(seeds, pretrain)
        ],
        "settings": {name: _setting_figures(name, pick) for name in settings},
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
        f"tiny model ({figures['model']['parameters']} parameters)"
    )


def format_tables(figures: dict) -> str:
    """Per setting: SFT step 1 (CE by role, the logged figures), then the endpoints after the last step, the paired
    differences and one conclusion line."""
    plan, pre = figures["plan"], figures["pretrain"]
    lines = [
        f"== {run_label(figures)}",
        f"pretraining ({plan['pretrain_steps']} steps per seed, BOS + text + EOS documents): LM loss "
        f"{_mean([p['lm_loss_first'] for p in pre])} -> {_mean([p['lm_loss_last'] for p in pre])}, held-out top-1 LM "
        f"{_mean([p['lm_top1'] for p in pre])}, MTP {_mean([p['mtp_top1'] for p in pre])} (mean over seeds); same "
        f"pretrained weights in both arms: {figures['same_pretrained_weights']}, same data: {figures['same_data']}",
        f"after {plan['sft_steps']} SFT steps, on {plan['eval_batches'] * plan['batch']} held-out prompts per run:",
        *(f"  {SHORT.get(m, m)}: {label}" for m, label in figures["metrics"].items()),
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
        lines += [f"after {plan['sft_steps']} SFT steps (mean over seeds)", head]
        for metric in figures["metrics"]:
            lines.append(row(SHORT.get(metric, metric), [_mean(data["runs"][r]["final"][metric]) for r in labels]))
        for c in data["contrasts"]:
            lines.append(f"{c['treatment']} - {c['control']} ({c['name']}), paired by seed: mean [95 % t-interval]")
            for metric in METRICS:
                lines.append(f"  {SHORT[metric]:{width - 2}}{stats.interval(c[metric])}; {stats.signs(c[metric])}")
        if data["logged_minus_true"]:
            lines.append(
                "logged minus true acceptance (core's mtp_1_acceptance_rate - MTP top-1 on the loss positions):"
            )
        for label, s in data["logged_minus_true"].items():
            lines.append(f"  {label:{width - 2}}{stats.interval(s)}; {stats.signs(s, 'above 0', 'below 0')}")
        lines.append(f"-> {data['conclusion']}")
    arms = figures["arms"]
    lines += [
        "",
        f"(wall {figures['wall_seconds']:.0f} s for both arms at once, their start included; per arm, wall: "
        + ", ".join(
            f"{arm} pretraining {arms[arm]['pretrain_seconds']:.0f} s + SFT and evaluation "
            f"{arms[arm]['fine_tune_seconds']:.0f} s (CPU {arms[arm]['cpu_seconds']:.0f} s), peak RSS "
            f"{arms[arm]['peak_rss_mib']:.0f} MiB"
            for arm in command.ARMS
        )
        + ")",
    ]
    return "\n".join(lines)


def _plot(figures: dict) -> bytes:
    """Teacher-forced top-1 through SFT and the primary endpoint per seed, per setting, as PNG bytes."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = figures["settings"]
    fig, axes = plt.subplots(2, len(settings), figsize=(4.4 * len(settings), 7), squeeze=False)
    colors = {"unpatched": "tab:red", "patched": "tab:blue", "no padding in MTP": "tab:green"}
    for column, (name, data) in enumerate(settings.items()):
        top, bottom = axes[0, column], axes[1, column]
        labels = list(data["runs"])
        for x, label in enumerate(labels):
            run = data["runs"][label]
            curves = run["curves"]
            means = [statistics.fmean(v for v in row if v is not None) for row in curves["teacher-forced"]]
            top.plot(curves["steps"], means, marker="o", ms=3, color=colors[label], label=label)
            values = [math.nan if v is None else v for v in run["final"][PRIMARY]]
            bottom.scatter([x] * len(values), values, color=colors[label], s=12)
        for seed in range(len(figures["seeds"])):
            bottom.plot(
                range(len(labels)),
                [data["runs"][label]["final"][PRIMARY][seed] or math.nan for label in labels],
                color="0.6",
                lw=0.7,
            )
        top.set_title(f"setting: {name}", fontsize=10)
        top.set_xlabel("SFT step")
        top.grid(alpha=0.3)
        bottom.set_xticks(range(len(labels)), labels, fontsize=8)
        bottom.grid(alpha=0.3)
        if column == 0:
            top.set_ylabel("teacher-forced MTP top-1 (answers)")
            bottom.set_ylabel("accepted tokens per verify step\n(one line per seed)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(
        "MTP depth 1 on held-out prompts, same weights and batches in every run\n" + run_label(figures), fontsize=10
    )
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def run(args) -> str:
    """`./run effect`: both arms, the tables; the figures and the plot into --out if given."""
    size = "plateau" if args.plateau else "short"
    print(f"[effect] both arms, {len(args.seeds)} seeds, size {size}: running", file=sys.stderr, flush=True)
    figures = finish_effect(start_effect(size, args.seeds), size)
    files = {"figures.json": json.dumps(figures, indent=1).encode(), "effect.png": _plot(figures)} if args.out else {}
    return "\n".join(filter(None, [format_tables(figures), command.write(args.out, files)]))


def main(argv: list[str] | None = None) -> None:
    """The command line (experiments.command: what it shares with repro)."""
    parser = command.parser("./run effect", __doc__.split("\n\n")[0], "0-9")
    steps = SIZES["plateau"]["sft_steps"], Plan.sft_steps
    parser.add_argument("--plateau", action="store_true", help="%d SFT steps instead of %d (prints its time)" % steps)
    command.main(parser, run, argv)


if __name__ == "__main__":
    main()
