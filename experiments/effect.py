"""What the bug costs the MTP head as a drafter: per seed the same pretraining, then SFT in the settings of
experiments/PLAN.md, the release as shipped against the release + patch, measured by speculative decoding.

    ./run effect [--seeds A-B] [--out DIR] [--keep DIR]   the plan's seeds, a short SFT (prints its time)
    ./run effect --control                                 the release in both arms: every contrast "no difference"
    ./run effect --plateau                                 three settings, SFT to a plateau (PLATEAU)
    ./run effect --course                                  the effect over training, and the dilution arm (COURSE)

The analysis (settings, endpoints, seeds, the Holm families, the verdict words) is experiments/PLAN.md's. Each arm is
a process with its own tree first on the import path (experiments.effect_arm says what it does); each finished seed
is said as it comes and kept under --keep, and the same command reuses it, so a run that stops (a signal, a failed
or stalled arm: both are named) resumes where it stopped. The settings `no-padding-mtp <setting>` (prompt and
answer, never padding) and `release-weight <setting>` (the loss mask, each position at the release's weight) give the
MTP loss a mask and a scale of their own, so they do not depend on the tree; their runs are split between the two
processes, and the suite checks that both trees give them bit-identical weights. Every figure is measured in the
run; nothing here asserts what the effect is.

The settings and what is compared are experiments.design's, the analysis experiments.analysis's (figures.json's
format), the printout experiments.printout's.
"""

import json
import sys
from pathlib import Path

from experiments import command, stats
from experiments.analysis import figures_of
from experiments.design import ARMS, SIZES, runs_per_seed
from experiments.effect_arm import Plan
from experiments.printout import format_tables
from maintain.repo import WORK
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.signals import Interrupted


KEEP = WORK / "effect"  # where `./run effect` keeps each finished seed (--keep)


def plans(size: str, seeds: tuple[int, ...], control: bool = False, keep: Path | None = None) -> dict[str, Plan]:
    """Each arm's plan (experiments.design.runs_per_seed says what it fine-tunes). ``keep``: the directory under which
    each arm keeps its finished seeds."""
    runs = runs_per_seed(size, seeds, control)
    return {
        arm: Plan(seeds=seeds, runs=tuple(runs[arm]), keep=keep and str(keep / arm), **SIZES[size].plan)
        for arm in ARMS
    }


def start_effect(
    size: str, seeds: tuple[int, ...], trees: dict | None = None, control: bool = False, keep: Path | None = None
) -> command.Arms:
    """Both arms started, not awaited (finish_effect takes them). ``trees``: default the release and the view;
    ``keep``: where each arm keeps its finished seeds and reuses them from (None: nowhere)."""
    trees = trees or command.trees()
    if control:
        trees = dict.fromkeys(ARMS, trees["unpatched"])
    arm_plans = {a: p.to_json() for a, p in plans(size, seeds, control, keep).items()}
    return command.Arms("experiments.effect_arm:measure", trees, arm_plans, SIZES[size].seed_seconds, keep)


def finish_effect(arms: command.Arms, size: str, control: bool = False) -> dict:
    """Wait for both arms; the figures, as figures.json holds them."""
    figures = figures_of(size, arms.trees, arms.wait(), control)
    figures["wall_seconds"] = arms.seconds()
    return json.loads(json.dumps(figures))  # exactly what the file holds (tuples become lists)


def run(args) -> tuple[str, Exit]:
    """`./run effect`: both arms and the tables, the figures into --out if given; exit 5 where a control differs, an arm
    failed or stalled."""
    size = "plateau" if args.plateau else "course" if args.course else "short"
    args.seeds = args.seeds or command.seeds(SIZES[size].seeds)
    seed_seconds = SIZES[size].seed_seconds
    print(
        f"[effect] both arms, {len(args.seeds)} seeds, size {size}: about {seed_seconds * len(args.seeds) / 60:.0f} "
        f"CPU-min per arm as experiments/PLAN.md reckons it ({seed_seconds:g} CPU-s a seed); each finished seed is "
        f"kept in {args.keep} and reused by the same command",
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
    said = ", ".join(
        f"{s.seeds}{'' if size == 'short' else f' with --{size}'}" for size, s in SIZES.items() if s.seeds
    )
    parser = command.parser("./run effect", __doc__.split("\n\n")[0], None, said)
    steps = SIZES["plateau"].plan["sft_steps"], Plan.sft_steps
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--plateau", action="store_true", help="%d SFT steps instead of %d" % steps)
    kind.add_argument(
        "--course",
        action="store_true",
        help="%s SFT steps, decoded after each of %s, with a run at the release's weight (experiments/PLAN.md)"
        % (SIZES["course"].plan["sft_steps"], ", ".join(map(str, SIZES["course"].plan["decode_at"]))),
    )
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
