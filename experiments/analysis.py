"""The figures of `./run effect` from its arms' raw payloads, analysed as experiments/PLAN.md says: each setting's
endpoints per run, its paired contrasts, Holm over each family, a one-line conclusion per setting.

figures.json (--out; every number measured in the run):

    size (experiments.design.SIZES), control, seeds, plan, model, wall_seconds, metrics (id: label; PRIMARY first)
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
                          final.<metric>, per seed; curves.<CURVES>: per evaluation step, per seed; where the design
                          has steps, decoded: steps, and per metric, per step, per seed); step_one_mix (share of the
                          MTP targets per role) and step_one_ce (MTP CE per role, per seed: the same in every run);
                          contrasts: [{name, family, control, treatment, what, endpoint, (step,) <metric>:
                          experiments.stats.summary of the paired differences, the endpoint's with its holm}];
                          logged_minus_true.<label>: summary over seeds (the Bridge arms only); without steps a
                          conclusion, with them conclusions (one per step), readings (per READ_AT step: whether the
                          release's-weight run reproduces the fix's effect) and first_change (the first step after
                          READ_AT's last whose reading of the fix differs from it; null: none; absent where that step is not decoded)
"""

import statistics
from dataclasses import asdict

from experiments import stats
from experiments.design import ARMS, DESCRIPTIVE, METRICS, PRIMARY, READ_AT, SIZES, SMALLEST, Design, shared_settings
from experiments.effect_arm import SETTINGS
from experiments.synthetic import ROLES
from tinymodel.reference import loss_mass_on_masked


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
    return metrics_at(run["speculative"], run["evals"][max(run["evals"])])


def metrics_at(spec: dict, last: dict) -> dict[str, float | None]:
    """METRICS and DESCRIPTIVE from a decoding's sums and the teacher-forced sums after the same SFT step."""
    return {
        PRIMARY: _ratio(spec["tokens"], spec["steps"]),
        "acceptance-without-eos": _ratio(
            spec["accepted"] - spec["eos_accepted"], spec["proposed"] - spec["eos_proposed"]
        ),
        "acceptance": _ratio(spec["accepted"], spec["proposed"]),
        "teacher-forced": _ratio(last["mtp_answer_hits"], last["mtp_answer_counted"]),
        "eos-share": _ratio(spec["eos_proposed"], spec["proposed"]),
        "eos-acceptance": _ratio(spec["eos_accepted"], spec["eos_proposed"]),
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


def _run_figures(seeded: list[tuple[str, dict]], steps: tuple[int, ...]) -> dict:
    """One run's figures over the seeds (``seeded``: per seed, the arm that made it and its payload), and where
    ``steps`` are given, its METRICS and DESCRIPTIVE after each of them."""
    finals = [final_metrics(run) for _, run in seeded]
    firsts = [step_one_figures(run["step_one"]) for _, run in seeded]
    evaluated = sorted(seeded[0][1]["evals"])
    figures = {
        "where": [arm for arm, _ in seeded],
        "step_one": {key: [f[key] for f in firsts] for key in firsts[0]},
        "final": {key: [f[key] for f in finals] for key in finals[0]},
        "curves": {"steps": evaluated}
        | {name: [[curve(r["evals"][s]) for _, r in seeded] for s in evaluated] for name, curve in CURVES.items()},
    }
    if steps:
        at = [[metrics_at(r["decoded"][s], r["evals"][s]) for _, r in seeded] for s in steps]
        figures["decoded"] = {"steps": list(steps)} | {key: [[f[key] for f in fs] for fs in at] for key in finals[0]}
    return figures


def _at(run: dict, k: int | None) -> dict[str, list]:
    """A run's figures per metric and seed after its last step (k None) or after its design's k-th step."""
    return run["final"] if k is None else {key: v[k] for key, v in run["decoded"].items() if key != "steps"}


def _contrasts(design: Design, runs: dict) -> list[dict]:
    """Each contrast of the design, after its last step or after each of its steps, on every metric."""
    contrasts = []
    for k, step in enumerate(design.steps) if design.steps else [(None, None)]:
        earlier = []
        for contrast in design.contrasts:
            a, b = _at(runs[contrast.control], k), _at(runs[contrast.treatment], k)
            endpoint = design.endpoint if contrast.family == "primary" else PRIMARY
            figures = asdict(contrast) | {"endpoint": endpoint} | ({} if step is None else {"step": step})
            figures |= {metric: stats.paired(a[metric], b[metric]) for metric in METRICS}
            figures["negative_of"] = negative_of(figures, earlier)
            earlier.append(figures)
        contrasts += earlier
    return contrasts


def _setting_figures(name: str, pick, design: Design) -> dict:
    """One setting's runs and contrasts, as its design says.

    Args:
        name: the Bridge setting.
        pick: ``pick(arm, setting)`` gives per seed that arm's run of the setting (arm None: either arm's).
        design: its design, without the shared runs where they were not made (a control).
    """
    picked = {label: pick(run.arm, run.setting) for label, run in design.runs.items()}
    runs = {label: _run_figures(seeded, design.steps) for label, seeded in picked.items()}
    roles = [run["step_one"]["target_role"] for _, run in next(iter(picked.values()))]
    return {
        "description": SETTINGS[name].description,
        "runs": runs,
        "step_one_mix": {
            role: statistics.fmean(float((r == i).float().mean()) for r in roles) for i, role in enumerate(ROLES)
        },
        "step_one_ce": {label: [role_means(run["step_one"]) for _, run in seeded] for label, seeded in picked.items()},
        "contrasts": _contrasts(design, runs),
        "logged_minus_true": {
            label: stats.summary(runs[label]["final"]["logged-minus-true"])
            for label, run in design.runs.items()
            if run.arm is not None
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


def _direction(s: dict) -> int:
    """+1 or -1 where the Holm-adjusted interval lies above or below 0, else 0."""
    low, high = s["holm"]["interval"] or (0.0, 0.0)
    return 1 if low > 0 else -1 if high < 0 else 0


def reading(contrasts: list[dict]) -> str | None:
    """Whether the release's-weight run reproduces the fix's effect after one step (experiments/PLAN.md), from the
    fix's and its two parts' Holm-adjusted intervals; None where the fix shows no difference or the parts were not
    run (a control)."""
    if len(contrasts) != 3:
        return None
    fix, weight, positions = (_direction(c[c["endpoint"]]) for c in contrasts)
    if fix == 0:
        return None
    if (weight, positions) == (fix, 0):
        return "reproduces it"
    if (weight, positions) == (0, fix):
        return "does not reproduce it"
    if (weight, positions) == (fix, fix):
        return "partly"
    return "; ".join(f"{c['name']}: {stats.verdict(c[c['endpoint']], c['what'])}" for c in contrasts[1:])


def _readings(name: str, data: dict, steps: tuple[int, ...]) -> None:
    """Add to a course setting's figures its conclusion per step, its readings at READ_AT and its first change."""
    at = {step: [c for c in data["contrasts"] if c["step"] == step] for step in steps}
    data["conclusions"] = [conclusion(f"{name} after SFT step {step}", at[step]) for step in steps]
    data["readings"] = [{"step": step, "reading": reading(at[step])} for step in READ_AT if step in at]
    fix, last = {step: _direction(cs[0][cs[0]["endpoint"]]) for step, cs in at.items()}, READ_AT[-1]
    if last in fix:
        data["first_change"] = next((s for s in steps if s > last and fix[s] != fix[last]), None)


def settings_run(size: str, by_arm: dict[str, dict], seeds: list[int]) -> set[str]:
    """The settings of a size run for every seed, by either arm: each shared one is run by one arm per seed, in turn.

    Args:
        size: a key of SIZES.
        by_arm: per arm, its runs by (setting, seed).
        seeds: the plan's seeds.

    Returns:
        Their names.
    """
    names = (*SIZES[size].designs, *shared_settings(size))
    return {name for name in names if all(any((name, s) in runs for runs in by_arm.values()) for s in seeds)}


def _arm_record(payload: dict, runs: dict, seeds: list[int], settings: tuple[str, ...], tree: str) -> dict:
    """What figures.json says of one arm: its tree, what it ran, the hashes of its weights and data, its time."""
    per_setting = lambda field: {
        setting: [runs.get((setting, s), {}).get(field) for s in seeds] for setting in settings
    }
    return {
        "tree": tree,
        "gpt_step_file": payload["gpt_step_file"],
        "runs": payload["plan"]["runs"],
        "pretrained_weights_sha256": [p["weights_sha256"] for p in payload["pretrain"]],
        "sft_data_sha256": per_setting("data_sha256"),
        "fine_tuned_weights_sha256": per_setting("weights_sha256"),
    } | {k: payload[k] for k in ("pretrain_seconds", "fine_tune_seconds", "cpu_seconds", "peak_rss_mib", "reused")}


def figures_of(size: str, trees: dict, payloads: dict[str, dict], control: bool) -> dict:
    """The figures (format: this module's docstring) from each arm's raw payload."""
    plan = payloads["unpatched"]["plan"]
    seeds = plan["seeds"]
    by_arm = {arm: {(r["setting"], r["seed"]): r for r in payloads[arm]["runs"]} for arm in ARMS}

    def pick(arm: str | None, setting: str) -> list[tuple[str, dict]]:
        arms = ARMS if arm is None else (arm,)
        return [next((a, by_arm[a][(setting, s)]) for a in arms if (setting, s) in by_arm[a]) for s in seeds]

    ran = settings_run(size, by_arm, seeds)
    designs = SIZES[size].designs
    settings = {
        name: _setting_figures(name, pick, design if set(design.shared()) <= ran else design.arms_only())
        for name, design in designs.items()
        if name in ran
    }
    contrasts = [c for data in settings.values() for c in data["contrasts"]]
    for family in dict.fromkeys(c["family"] for c in contrasts):
        stats.holm([c[c["endpoint"]] for c in contrasts if c["family"] == family])
    for name, data in settings.items():
        if designs[name].steps:
            _readings(name, data, designs[name].steps)
        else:
            data["conclusion"] = conclusion(name, data["contrasts"])
    pretrain = payloads["unpatched"]["pretrain"]
    both = [(key, run, by_arm["unpatched"].get(key)) for key, run in by_arm["patched"].items()]
    return {
        "size": size,
        "control": control,
        "seeds": seeds,
        "plan": {k: v for k, v in plan.items() if k != "runs"},
        "metrics": METRICS | DESCRIPTIVE,
        "model": {key: pretrain[0][key] for key in ("num_parameters", "mtp_num_layers", "mtp_loss_scaling_factor")},
        "arms": {
            arm: _arm_record(payloads[arm], by_arm[arm], seeds, (*designs, *shared_settings(size)), str(trees[arm]))
            for arm in ARMS
        },
        "same_pretrained_weights": len({tuple(p["weights_sha256"] for p in payloads[a]["pretrain"]) for a in ARMS})
        == 1,
        "same_data": all(other["data_sha256"] == run["data_sha256"] for _, run, other in both if other),
        "shared_runs_equal": [
            other["weights_sha256"] == run["weights_sha256"]
            for key, run, other in both
            if other and key[0] in shared_settings(size)
        ],
        "pretrain": [
            {"seed": seed, "lm_loss_first": p["lm_loss_first"], "lm_loss_last": p["lm_loss_last"]}
            | {f"{h}_top1": _ratio(p["held_out"][f"{h}_hits"], p["held_out"][f"{h}_counted"]) for h in ("lm", "mtp")}
            for seed, p in zip(seeds, pretrain)
        ],
        "settings": settings,
    }
