"""What `./run effect` runs and compares (experiments/PLAN.md), as named records: its sizes, its settings with the
endpoint each is judged on, the runs each setting takes and the contrasts between them. No torch."""

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
DESCRIPTIVE = {"eos-share": "EOS drafts / drafts", "answer-tokens": "tokens per answer"}  # per run, no contrast
SMALLEST = 0.075  # the smallest difference on an endpoint this experiment cares about (experiments/PLAN.md)


@dataclass(frozen=True)
class Size:
    """How long a run fine-tunes and how it is reckoned: Plan fields over Plan's defaults, the seconds a seed takes
    an arm as the plan's pilot measured them on a 2-core machine shared with other jobs (what "slower than expected"
    and the stall limit are reckoned from), and the default seeds."""

    plan: dict = field(default_factory=dict)
    seed_seconds: float = 60
    seeds: str | None = None  # None: the size has no default seeds of its own (the suite's)


SIZES = {
    "short": Size(seed_seconds=60, seeds="100-161"),  # `./run effect`
    "plateau": Size({"sft_steps": 600, "eval_every": 100}, seed_seconds=170, seeds="100-115"),
    "small": Size(
        dict(pretrain_steps=8, sft_steps=3, eval_every=3, eval_batches=1, batch=8, pretrain_batch=8), seed_seconds=15
    ),
}


@dataclass(frozen=True)
class Run:
    """One fine-tuning run a setting's analysis takes: the setting run, and the arm whose tree makes it (None: either
    arm, one per seed in turn, for a setting whose MTP mask is the experiment's own)."""

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
    """One Bridge setting as the analysis takes it: its endpoint, its runs by label, its contrasts."""

    endpoint: str
    runs: dict[str, Run]
    contrasts: tuple[Contrast, ...]

    def arms_only(self) -> "Design":
        """The runs the arms' trees make, and the fix: where no shared run was made (a control, the plateau)."""
        return replace(self, runs={k: r for k, r in self.runs.items() if r.arm}, contrasts=(FIX,))


FIX = Contrast("the fix", "primary", "unpatched", "patched", "the fix")
SPLIT = "no padding in MTP"  # the label of a setting's run with the experiment's MTP mask
# Run by both arms, each with its endpoint: tokens per verify step where drafting speed can move, else the endpoint
# that moves there.
ENDPOINTS = {
    "same-language short/first": PRIMARY,
    "same-language long/second": PRIMARY,
    "distinct-answers": PRIMARY,
    "padding-only": PRIMARY,
    "report-like": PRIMARY,
    # Where drafting speed cannot move, the MTP head's teacher-forced top-1 on the answers: short/second's greedy
    # answers are about 2 tokens, the EOS included, so its drafts are nearly all the closing EOS's (which save no
    # step: 1 token per verify step); long/first's tokens per verify step is 2.000, its ceiling, in both arms.
    "same-language short/second": "teacher-forced",
    "same-language long/first": "teacher-forced",
}
BRIDGE = tuple(ENDPOINTS)
# What --plateau runs: where the fix went against drafting speed, where it went for it, and the report's regime.
PLATEAU = ("same-language short/first", "same-language long/second", "report-like")
# What --course runs (experiments/PLAN.md, its amendment): every setting whose drafting speed the fix moved at 50 SFT
# steps, decoded after each of COURSE_STEPS.
COURSE = (
    "same-language short/first",
    "same-language long/second",
    "distinct-answers",
    "padding-only",
    "report-like",
)
COURSE_STEPS = (25, 50, 100, 200, 400, 600)
# Its MTP mask is the experiment's (never padding): run by either arm, one per setting the fix is split in.
SPLIT_BY = {name: f"no-padding-mtp {name.removeprefix('same-language ')}" for name in SPLIT_SETTINGS}
SHARED = tuple(SPLIT_BY.values())
DESIGNS = {name: Design(ENDPOINTS[name], {arm: Run(arm, name) for arm in ARMS}, (FIX,)) for name in BRIDGE} | {
    name: Design(
        ENDPOINTS[name],
        {"unpatched": Run("unpatched", name), SPLIT: Run(None, shared), "patched": Run("patched", name)},
        (
            FIX,
            Contrast("padding's part", "split", "unpatched", SPLIT, "masking the padding"),
            Contrast("prompt's part", "split", SPLIT, "patched", "masking the prompt"),
        ),
    )
    for name, shared in SPLIT_BY.items()
}


def runs_per_seed(size: str, seeds: tuple[int, ...], control: bool = False) -> dict[str, list[tuple[str, ...]]]:
    """Per arm and seed, the settings it fine-tunes: every Bridge setting and about half the shared ones (all in the
    small run, none in a control); at the plateau only PLATEAU's settings, without the split."""
    bridge, shared = (PLATEAU, ()) if size == "plateau" else (BRIDGE, () if control else SHARED)
    return {
        arm: [
            bridge + tuple(s for k, s in enumerate(shared) if size == "small" or (i + k) % 2 == j)
            for i, _ in enumerate(seeds)
        ]
        for j, arm in enumerate(ARMS)
    }
