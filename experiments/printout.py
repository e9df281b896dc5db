"""What `./run effect` prints from its figures (experiments.analysis): per setting SFT step 1 and the endpoints after
the last step with unadjusted paired intervals, then one line per setting with its Holm-adjusted verdicts, then the
time taken. Every number printed is one of the figures; the words are the plan's."""

import statistics

from experiments import stats
from experiments.design import ARMS, DESCRIPTIVE, FAMILIES, METRICS, PRIMARY, READ_AT, SMALLEST
from experiments.synthetic import ROLES


STEP_ONE = {
    "mtp_1_loss": "mtp_1 loss (logged)",
    "grad_norm": "grad norm",
    "lm_loss": "LM loss",
    "mtp_loss_mass_on_prompt": "MTP loss mass on the prompt",
    "mtp_loss_mass_on_padding": "MTP loss mass on padding",
}
INDENT = "  "  # a row under a heading
# The label column: as wide as the longest label a table of a setting has, so that a setting's tables line up.
LABEL_WIDTH = 2 + max(len(label) for label in [*STEP_ONE.values(), *METRICS.values(), *DESCRIPTIVE.values()])


def _mean(values: list[float | None]) -> str:
    defined = [v for v in values if v is not None]
    return f"{statistics.fmean(defined):.3f}" if defined else "-"


def table(head: list[str], rows: list[tuple[str, list[str]]]) -> list[str]:
    """Rows of a label and one cell per column, under ``head``: the labels left-aligned, the cells right-aligned in
    columns as wide as the widest entry."""
    cell = 2 + max(len(text) for text in head + [c for _, cells in rows for c in cells])
    line = lambda name, cells: f"{name:{LABEL_WIDTH}}" + "".join(f"{c:>{cell}}" for c in cells)
    return [line("", head)] + [line(name, cells) for name, cells in rows]


def run_label(figures: dict) -> str:
    """Size and seeds of a run, and the model: what every printed figure carries."""
    seeds, plan = figures["seeds"], figures["plan"]
    listed = f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else ",".join(map(str, seeds))
    return (
        f"size {figures['size']} ({plan['sft_steps']} SFT steps), seeds {listed} (n={len(seeds)}), "
        f"tiny model ({figures['model']['num_parameters']} parameters)"
        + (", control: the release in both arms" if figures["control"] else "")
    )


def _head(figures: dict) -> list[str]:
    plan, pre = figures["plan"], figures["pretrain"]
    return [
        f"== {run_label(figures)}",
        f"pretraining ({plan['pretrain_steps']} steps per seed, BOS + text + EOS documents): LM loss "
        f"{_mean([p['lm_loss_first'] for p in pre])} -> {_mean([p['lm_loss_last'] for p in pre])}, held-out top-1 LM "
        f"{_mean([p['lm_top1'] for p in pre])}, MTP {_mean([p['mtp_top1'] for p in pre])} (mean over seeds); same "
        f"pretrained weights in both arms: {figures['same_pretrained_weights']}, same data: {figures['same_data']}",
        f"after {plan['sft_steps']} SFT steps, on {plan['eval_batches'] * plan['batch']} held-out prompts per run; the "
        "primary endpoint: accepted tokens per verify step, the MTP head a k=1 drafter (experiments/PLAN.md)",
    ]


def _step_one(data: dict) -> list[str]:
    """SFT step 1 in every run of a setting: each role's MTP CE, the logged figures and where the MTP loss went."""
    labels = list(data["runs"])
    mix = ", ".join(f"{role} {share:.1%}" for role, share in data["step_one_mix"].items())
    rows = [
        (f"MTP CE on {role} targets", [_mean([ce[role] for ce in data["step_one_ce"][r]]) for r in labels])
        for role in ROLES
    ]
    rows += [(label, [_mean(data["runs"][r]["step_one"][key]) for r in labels]) for key, label in STEP_ONE.items()]
    mass = data["runs"]["unpatched"]["step_one"]["mtp_loss_mass_on_padding"]
    return [
        f"SFT step 1, same weights and batch in every run (mean over seeds); MTP targets: {mix}",
        *table(labels, rows),
        f"unpatched MTP loss mass on padding, as measured: mean {_mean(mass)}, per seed min {min(mass):.3f}, max "
        f"{max(mass):.3f}",
    ]


def _after_training(data: dict, metrics: dict[str, str], sft_steps: int) -> list[str]:
    """The endpoints after the last step per run, and the teacher-forced curves."""
    labels = list(data["runs"])
    finals = [(label, [_mean(data["runs"][r]["final"][metric]) for r in labels]) for metric, label in metrics.items()]
    curves = [data["runs"][r]["curves"] for r in labels]
    points = [
        (f"{INDENT}step {step}", [f"{_mean(c['teacher-forced'][k])} / {_mean(c['lm-loss'][k])}" for c in curves])
        for k, step in enumerate(curves[0]["steps"])
    ]
    return [
        f"after {sft_steps} SFT steps (mean over seeds)",
        *table(labels, finals),
        "teacher-forced top-1 and held-out LM loss after each evaluated SFT step (mean over seeds)",
        *table(labels, points)[1:],
    ]


def _decoded(data: dict) -> list[str]:
    """Where the design decodes along the way: the primary endpoint and the EOS drafts accepted, per run and step."""
    labels = list(data["runs"])
    decoded = [data["runs"][r]["decoded"] for r in labels]
    lines = []
    for metric in (PRIMARY, "eos-acceptance"):
        label = (METRICS | DESCRIPTIVE)[metric]
        rows = [
            (f"{INDENT}step {step}", [_mean(d[metric][k]) for d in decoded])
            for k, step in enumerate(decoded[0]["steps"])
        ]
        lines += [f"{label} after each decoded SFT step (mean over seeds)", *table(labels, rows)]
    return lines


def _contrasts(data: dict) -> list[str]:
    """Each contrast on every endpoint with its unadjusted 95 % interval, and core's logged acceptance's error."""
    lines = []
    for c in data["contrasts"]:
        after = f" after SFT step {c['step']}" if "step" in c else ""
        lines.append(
            f"{c['treatment']} - {c['control']} ({c['name']}){after}, paired by seed: mean [95 % t, unadjusted]"
        )
        rows = [(label, f"{stats.interval(c[m])}; {stats.signs(c[m])}") for m, label in METRICS.items()]
        lines += _columns(rows)
    lines.append("logged minus true acceptance (core's mtp_1_acceptance_rate - MTP top-1 on the loss positions):")
    rows = [
        (label, f"{stats.interval(s)}; {stats.signs(s, 'above 0', 'below 0')}")
        for label, s in data["logged_minus_true"].items()
    ]
    return lines + _columns(rows)


def _columns(rows: list[tuple[str, str]]) -> list[str]:
    """Indented rows of a label and a text, the texts in one column."""
    return [f"{INDENT}{label:{LABEL_WIDTH}}{text}" for label, text in rows]


def format_tables(figures: dict) -> str:
    """The run's head, each setting's tables and contrasts, the Holm-adjusted verdicts, and the time taken."""
    lines = _head(figures)
    for name, data in figures["settings"].items():
        lines += ["", f"== setting {name}: {data['description']}", *_step_one(data)]
        lines += _after_training(data, figures["metrics"], figures["plan"]["sft_steps"])
        lines += (_decoded(data) if "decoded" in next(iter(data["runs"].values())) else []) + _contrasts(data)
    contrasts = [c for data in figures["settings"].values() for c in data["contrasts"]]
    families = {
        family: sum(c["family"] == family for c in contrasts)
        for family in dict.fromkeys(c["family"] for c in contrasts)
    }
    lines += [
        "",
        f"== Holm at family-wise {stats.ALPHA}, each family apart (experiments/PLAN.md): "
        + "; ".join(f"{FAMILIES[family]} ({m})" for family, m in families.items())
        + f". Per contrast: verdict, mean [Holm-adjusted interval], and where the interval settles it, its size "
        f"against +-{SMALLEST}",
    ]
    for name, data in figures["settings"].items():
        lines += [f"-> {line}" for line in data.get("conclusions", [data.get("conclusion")])]
        lines += [
            f"-> {name}: the release's-weight run after SFT step {r['step']}: "
            + (r["reading"] or "nothing to reproduce (the fix: no difference)")
            for r in data.get("readings", [])
        ]
        if "first_change" in data:
            lines.append(
                f"-> {name}: the first decoded SFT step after {READ_AT[-1]} where the fix reads otherwise than there: "
                f"{data['first_change'] or 'none'}"
            )
    return "\n".join([*lines, "", time_taken(figures)])


def time_taken(figures: dict) -> str:
    """Wall time of the run, and per arm what its seeds took in wall and CPU time (those kept from an earlier run
    apart)."""
    per_arm = []
    for arm in ARMS:
        a, reused = figures["arms"][arm], figures["arms"][arm]["reused"]
        text = (
            f"{arm}: {len(figures['seeds']) - len(reused)} seeds run, wall: pretraining {a['pretrain_seconds']:.0f} s "
            f"+ SFT and evaluation {a['fine_tune_seconds']:.0f} s; CPU: {a['cpu_seconds']:.0f} s, pretraining "
            f"included; peak RSS {a['peak_rss_mib']:.0f} MiB"
        )
        if reused:
            text += f"; {len(reused)} seeds kept from an earlier run ({sum(reused.values()):.0f} CPU-s then)"
        per_arm.append(text)
    return f"(wall {figures['wall_seconds']:.0f} s for both arms at once, their start included; per arm: " + (
        " | ".join(per_arm) + ")"
    )
