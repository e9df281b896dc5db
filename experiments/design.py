"""What `./run effect` runs and compares (experiments/PLAN.md), as named records: each setting's runs, the contrasts
between them and the endpoint they are judged on, and the sizes of a run (which settings, how long, how many seeds)."""

from dataclasses import dataclass, field, replace

from experiments.effect_arm import SPLIT as SPLIT_SETTINGS


ARMS = ("unpatched", "patched")  # the release as shipped, and the tree under test (the release + the patch)
PRIMARY = "tokens-per-step"
METRICS = {  # id: row label; each over the same held-out prompts, after the last SFT step (experiments/PLAN.md)
    PRIMARY: "tokens per verify step",
    "acceptance-without-eos": "acceptance without the EOS draft",
    "acceptance": "acceptance",
    "teacher-forced": "teacher-forced top-1",
}
DESCRIPTIVE = {  # per run, no contrast
    "eos-share": "EOS drafts / drafts",
    "eos-acceptance": "EOS drafts accepted / EOS drafts",  # an accepted draft of the closing EOS saves no step
    "answer-tokens": "tokens per answer (EOS included)",
}
FAMILIES = {  # each Holm family of experiments/PLAN.md, as the printout names it
    "primary": "the fix in every setting, each on its endpoint",
    "split": "its padding's and its prompt's parts, on tokens per verify step",
    "course": "the fix in every setting after every decoded SFT step, on tokens per verify step",
    "dilution": "its weight's and its positions' parts after every decoded SFT step, on tokens per verify step",
}
SMALLEST = 0.075  # the smallest difference on an endpoint this experiment cares about (experiments/PLAN.md)


@dataclass(frozen=True)
class Run:
    """One fine-tuning run a setting's analysis takes: the setting run, and the arm whose tree makes it (None: either
    arm, one per seed in turn, for a setting whose MTP loss the experiment sets itself)."""

    arm: str | None
    setting: str


@dataclass(frozen=True)
class Contrast:
    """Treatment - control per seed (run labels), in a Holm family; ``what`` names the treatment in the verdict."""

    name: str
    family: str
    control: str
    treatment: str
    what: str


@dataclass(frozen=True)
class Design:
    """One Bridge setting as the analysis takes it: its endpoint, its runs by label, its contrasts, and the SFT steps
    it contrasts them after (empty: after the last step only)."""

    endpoint: str
    runs: dict[str, Run]
    contrasts: tuple[Contrast, ...]
    steps: tuple[int, ...] = ()

    def arms_only(self) -> "Design":
        """The runs the arms' trees make, and the contrasts between them: where no shared run is made."""
        runs = {label: run for label, run in self.runs.items() if run.arm}
        return replace(
            self, runs=runs, contrasts=tuple(c for c in self.contrasts if {c.control, c.treatment} <= {*runs})
        )

    def shared(self) -> tuple[str, ...]:
        """The settings of its runs that either arm makes."""
        return tuple(run.setting for run in self.runs.values() if run.arm is None)


def _short(name: str) -> str:
    return name.removeprefix("same-language ")


FIX = Contrast("the fix", "primary", "unpatched", "patched", "the fix")
SPLIT = "no padding in MTP"  # the label of a setting's run with the experiment's MTP mask
# Run by both arms, each with its endpoint: tokens per verify step where drafting speed can move, else the endpoint
# that moves there (experiments/RESULTS.md has the figures).
ENDPOINTS = {
    "same-language short/first": PRIMARY,
    "same-language long/second": PRIMARY,
    "distinct-answers": PRIMARY,
    "padding-only": PRIMARY,
    "report-like": PRIMARY,
    # short/second's greedy answers are about two tokens, the EOS included, so nearly every draft is the closing
    # EOS's, which saves no step; long/first's drafts are nearly all accepted: both sit at 1 and 2 tokens per step.
    "same-language short/second": "teacher-forced",
    "same-language long/first": "teacher-forced",
}
BRIDGE = tuple(ENDPOINTS)
DESIGNS = {name: Design(ENDPOINTS[name], {arm: Run(arm, name) for arm in ARMS}, (FIX,)) for name in BRIDGE} | {
    name: Design(
        ENDPOINTS[name],
        {
            "unpatched": Run("unpatched", name),
            SPLIT: Run(None, f"no-padding-mtp {_short(name)}"),
            "patched": Run("patched", name),
        },
        (
            FIX,
            Contrast("padding's part", "split", "unpatched", SPLIT, "masking the padding"),
            Contrast("prompt's part", "split", SPLIT, "patched", "masking the prompt"),
        ),
    )
    for name in SPLIT_SETTINGS
}
# What --plateau runs, without the split: where the fix went against drafting speed, where it went for it, and the
# report's regime.
PLATEAU = ("same-language short/first", "same-language long/second", "report-like")
# What --course runs (experiments/PLAN.md, its amendment): every setting whose drafting speed the fix moved at 50 SFT
# steps, each with a third run whose MTP loss counts the fix's positions at the release's weight, decoded after each
# of COURSE_STEPS.
COURSE = (
    "same-language short/first",
    "same-language long/second",
    "distinct-answers",
    "padding-only",
    "report-like",
)
COURSE_STEPS = (25, 50, 100, 200, 400, 600)
DILUTED = "release's weight"  # the label of a setting's run at the release's weight
READ_AT = (25, 50)  # the steps at which the plan reads whether the release's-weight run reproduces the fix's effect


def course_design(name: str, steps: tuple[int, ...]) -> Design:
    """A setting of the course run: the fix, and its weight's and positions' parts, after each of ``steps``."""
    runs = {"unpatched": Run("unpatched", name), DILUTED: Run(None, f"release-weight {_short(name)}")}
    return Design(
        PRIMARY,
        runs | {"patched": Run("patched", name)},
        (
            replace(FIX, family="course"),
            Contrast("weight's part", "dilution", DILUTED, "patched", "the fix's weight per counted position"),
            Contrast("positions' part", "dilution", "unpatched", DILUTED, "the fix's counted positions"),
        ),
        steps,
    )


@dataclass(frozen=True)
class Size:
    """One kind of run: its settings' designs; Plan fields over Plan's defaults; the seconds a seed takes an arm, as
    experiments/PLAN.md reckons them for a 2-core machine shared with other jobs ("slower than expected" and the
    stall limit are reckoned from them); its default seeds; and whether both arms make every shared run (the suite's
    check that the trees agree on them)."""

    designs: dict[str, Design]
    plan: dict = field(default_factory=dict)
    seed_seconds: float = 60
    seeds: str | None = None
    both: bool = False


SMALL = dict(pretrain_steps=8, sft_steps=3, eval_every=3, eval_batches=1, batch=8, pretrain_batch=8)
SIZES = {
    "short": Size(DESIGNS, seed_seconds=60, seeds="100-161"),  # `./run effect`
    "plateau": Size(
        {name: DESIGNS[name].arms_only() for name in PLATEAU},
        {"sft_steps": 600, "eval_every": 100},
        seed_seconds=170,
        seeds="100-115",
    ),
    "course": Size(
        {name: course_design(name, COURSE_STEPS) for name in COURSE},
        {"sft_steps": COURSE_STEPS[-1], "eval_every": 100, "decode_at": COURSE_STEPS},
        seed_seconds=480,
        seeds="300-363",
    ),
    # The suite's: the short run's and the course run's designs on a near-untrained model.
    "small": Size(DESIGNS, SMALL, seed_seconds=15, both=True),
    "small-course": Size(
        {name: course_design(name, (1, 3)) for name in COURSE}, SMALL | {"decode_at": (1, 3)}, 15, both=True
    ),
}


def shared_settings(size: str) -> tuple[str, ...]:
    """The settings a size runs that either arm makes, in the order of its designs."""
    return tuple(dict.fromkeys(s for design in SIZES[size].designs.values() for s in design.shared()))


def runs_per_seed(size: str, seeds: tuple[int, ...], control: bool = False) -> dict[str, list[tuple[str, ...]]]:
    """Per arm and seed, the settings it fine-tunes: every Bridge setting of the size, and of the shared ones about
    half, in turn by seed (all of them where the size says both; none in a control)."""
    bridge, shared = tuple(SIZES[size].designs), () if control else shared_settings(size)
    return {
        arm: [
            bridge + tuple(s for k, s in enumerate(shared) if SIZES[size].both or (i + k) % 2 == j)
            for i, _ in enumerate(seeds)
        ]
        for j, arm in enumerate(ARMS)
    }
