"""The effect experiment on its small size: the release as shipped ("unpatched") against the tree this session
tests ("patched"), from the same pretrained weights on the same batches, in every setting; and the parts of the
experiments that need no model (speculative decoding's counts, the statistics, the command lines).

The arms must differ where the fix acts: the tree under test puts no MTP loss on masked positions, core's logged
acceptance there is top-1 over the loss positions, and the two arms end with different weights. With the fix taken
out of the tree under test, those fail by assertion. Nothing here asserts the direction or size of the effect: that
is what `./run effect` measures.
"""

import json
import math
import shutil
import signal
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from experiments import analysis, command, design, effect, effect_arm, power, printout, repro, stats, training
from experiments.synthetic import BOS, EOS, PAD, ROLES, SEP
from maintain.repo import REPO, VIEW, pins, release
from mtp_mask_fix.paths import GPT_STEP, is_gpt_step_of
from mtp_mask_fix.signals import Interrupted
from tinymodel import worker


pytestmark = pytest.mark.slow
BASE = release(pins()["megatron-bridge"]).root
SEEDS = (0,)
TOL = 1e-6  # core logs its acceptance as a float32 percent


EARLY = {}


def _start(tree, keep: Path):
    return effect.start_effect("small", SEEDS, trees={"unpatched": BASE, "patched": tree}, keep=keep)


def start_early(session) -> None:
    """Both arms, started by tests/conftest.py once the suite is collected: the unpatched arm (a process that imports
    the release cold) then runs beside the tests before this module's, not in their way."""
    EARLY["keep"] = Path(tempfile.mkdtemp(prefix="mtp-effect-kept-"))
    EARLY["effect"] = _start(worker.this_tree(), EARLY["keep"])


@pytest.fixture(scope="module")
def keep():
    """Where the small run keeps its seeds (removed after the module)."""
    path = EARLY.get("keep") or Path(tempfile.mkdtemp(prefix="mtp-effect-kept-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def figures(tree, keep):
    return effect.finish_effect(EARLY.pop("effect", None) or _start(tree, keep), "small")


@pytest.fixture(scope="module")
def course(tree, keep):
    """The course run's design at the small size: decoded after SFT steps 1 and 3, with the release's-weight runs."""
    trees = {"unpatched": BASE, "patched": tree}
    return effect.finish_effect(effect.start_effect("small-course", SEEDS, trees=trees, keep=keep), "small-course")


def _numbers(value):
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


def _bridge_runs(figures):
    """(setting, data) of the settings whose MTP mask the tree decides."""
    return [(name, figures["settings"][name]) for name in design.BRIDGE]


class TestEffectArms:
    def test_each_arm_ran_its_own_tree(self, figures, tree):
        for arm, arm_tree in {"unpatched": BASE, "patched": tree}.items():
            assert is_gpt_step_of(figures["arms"][arm]["gpt_step_file"], arm_tree), arm

    def test_both_arms_start_from_the_same_pretrained_weights_on_the_same_data(self, figures):
        arms = figures["arms"]
        assert arms["unpatched"]["pretrained_weights_sha256"] == arms["patched"]["pretrained_weights_sha256"]
        assert arms["unpatched"]["sft_data_sha256"] == arms["patched"]["sft_data_sha256"]
        hashes = [h for arm in arms.values() for per_seed in arm["sft_data_sha256"].values() for h in per_seed]
        assert None not in hashes  # the small run makes every run in both arms
        by_setting = arms["patched"]["sft_data_sha256"]
        for name, setting in design.SIZES["small"].designs.items():  # a shared run's batches are its setting's
            for shared in setting.shared():
                assert by_setting[shared] == by_setting[name]
        assert len({h for name in design.BRIDGE for h in by_setting[name]}) == len(design.BRIDGE) * len(SEEDS)
        assert figures["same_pretrained_weights"] is True and figures["same_data"] is True

    def test_the_experiments_mtp_mask_gives_the_same_run_in_either_tree(self, figures):
        """The shared setting sets the MTP mask itself, so its runs may be split between the arms by seed."""
        assert figures["shared_runs_equal"] == [True] * len(SEEDS) * len(design.shared_settings("small"))

    def test_step_one_is_the_same_forward_in_every_run(self, figures):
        """Same weights, same batch: the LM loss and each role's MTP CE agree before the first update."""
        for name, setting in figures["settings"].items():
            runs = list(setting["runs"].values())
            for run in runs[1:]:
                assert run["step_one"]["lm_loss"] == pytest.approx(runs[0]["step_one"]["lm_loss"], rel=1e-6), name
            ce = list(setting["step_one_ce"].values())
            for other in ce[1:]:
                for a, b in zip(other, ce[0]):
                    assert a == pytest.approx(b, rel=1e-6), name

    def test_the_release_puts_mtp_loss_on_padding(self, figures):
        for name, setting in _bridge_runs(figures):
            assert min(setting["runs"]["unpatched"]["step_one"]["mtp_loss_mass_on_padding"]) > 0, name

    @pytest.mark.fail_to_pass
    def test_the_tree_under_test_puts_no_mtp_loss_on_masked_positions(self, figures):
        for name, setting in _bridge_runs(figures):
            one = setting["runs"]["patched"]["step_one"]
            masked = ("padding",) if name == "padding-only" else ("prompt", "padding")
            for role in masked:
                assert one[f"mtp_loss_mass_on_{role}"] == [0.0] * len(SEEDS), (name, role)

    @pytest.mark.fail_to_pass
    def test_logged_acceptance_is_teacher_forced_top1_on_the_loss_positions(self, figures):
        """Core's mtp_1_acceptance_rate on the held-out batches, at every evaluated step and seed."""
        for name, setting in _bridge_runs(figures):
            curves = setting["runs"]["patched"]["curves"]
            for step, per_seed in zip(curves["steps"], curves["logged-minus-true"]):
                assert per_seed == pytest.approx([0.0] * len(SEEDS), abs=TOL), f"{name}, step {step}"

    @pytest.mark.fail_to_pass
    def test_the_arms_end_with_different_weights(self, figures):
        """A patch that changes nothing would train both arms alike, bit for bit."""
        arms = figures["arms"]
        same = [
            f"seed {seed}, {name}"
            for name in design.BRIDGE
            for seed, u, p in zip(
                SEEDS,
                arms["unpatched"]["fine_tuned_weights_sha256"][name],
                arms["patched"]["fine_tuned_weights_sha256"][name],
            )
            if u == p
        ]
        assert same == []


class TestEffectFigures:
    def test_figures_are_finite_and_complete(self, figures):
        assert all(math.isfinite(x) for x in _numbers(figures))
        assert list(figures["settings"]) == list(design.BRIDGE)
        for name, setting in figures["settings"].items():
            assert sum(setting["step_one_mix"].values()) == pytest.approx(1.0)
            assert list(setting["runs"]) == list(design.SIZES["small"].designs[name].runs)
            for run in setting["runs"].values():
                assert set(run["final"]) >= set(design.METRICS) | set(design.DESCRIPTIVE)
                assert all(len(v) == len(SEEDS) for v in run["final"].values())
                assert run["curves"]["steps"] == figures["plan"]["eval_steps"]
            for contrast in setting["contrasts"]:
                assert all(len(contrast[m]["values"]) == len(SEEDS) for m in design.METRICS)  # None: none counted
            assert setting["conclusion"].startswith(f"{name}: ")

    def test_tables(self, figures):
        tables = printout.format_tables(figures)
        assert "size small (3 SFT steps), seeds 0-0 (n=1)" in tables
        for name, setting in figures["settings"].items():
            assert f"== setting {name}: {setting['description']}" in tables
            assert f"-> {setting['conclusion']}" in tables


class TestCourse:
    """The course run: the fix and its two parts after each decoded step; decoding along the way changes nothing of
    the training; the release's-weight run is the same in either tree and weighs each position as the release."""

    def test_every_setting_has_its_three_runs_and_contrasts_after_each_decoded_step(self, course):
        assert all(math.isfinite(x) for x in _numbers(course))
        assert list(course["settings"]) == list(design.COURSE)
        for name, setting in course["settings"].items():
            assert list(setting["runs"]) == ["unpatched", design.DILUTED, "patched"], name
            for run in setting["runs"].values():
                assert run["decoded"]["steps"] == [1, 3] and set(run["decoded"]) - {"steps"} == set(run["final"])
                assert {k: v[-1] for k, v in run["decoded"].items() if k != "steps"} == run["final"], name
            steps = [(c["step"], c["name"]) for c in setting["contrasts"]]
            names = [c.name for c in design.SIZES["course"].designs[name].contrasts]
            assert steps == [(step, n) for step in (1, 3) for n in names]
            assert [line.split(":")[0] for line in setting["conclusions"]] == [
                f"{name} after SFT step {s}" for s in (1, 3)
            ]
        tables = printout.format_tables(course)
        assert (
            "tokens per verify step after each decoded SFT step" in tables
            and "(weight's part) after SFT step 3" in tables
        )

    def test_the_release_weight_run_is_the_same_in_either_tree(self, course):
        assert course["shared_runs_equal"] == [True] * len(SEEDS) * len(design.COURSE)

    def test_the_release_weight_run_counts_no_padding_and_trains_otherwise_than_the_patched_arm(self, course):
        hashes = course["arms"]["patched"]["fine_tuned_weights_sha256"]
        for name, setting in course["settings"].items():
            padding = setting["runs"][design.DILUTED]["step_one"]["mtp_loss_mass_on_padding"]
            assert padding == [0.0] * len(SEEDS), name
            diluted = hashes[f"release-weight {name.removeprefix('same-language ')}"]
            assert None not in diluted and set(diluted).isdisjoint(hashes[name]), name

    def test_decoding_along_the_way_changes_nothing_of_the_training(self, course, figures):
        """The same setting, seed and batches with and without decoding after step 1: the same final weights."""
        for arm in command.ARMS:
            for name in design.COURSE:
                before = figures["arms"][arm]["fine_tuned_weights_sha256"][name]
                assert course["arms"][arm]["fine_tuned_weights_sha256"][name] == before, (arm, name)
                assert (
                    course["settings"][name]["runs"][arm]["final"] == figures["settings"][name]["runs"][arm]["final"]
                )


@pytest.mark.usefixtures("one_rank")
def test_the_release_weight_gives_each_counted_position_the_weight_the_all_ones_mask_gives_it():
    """At the release's weight, a position the loss mask counts weighs in the step loss exactly what it weighs with
    core's all-ones fallback, and every other position nothing."""
    from tinymodel import gpt
    from tinymodel.reference import mtp_mask, mtp_positions

    batch = gpt.make_sft_batch()
    mask_of, scale_of = effect_arm.MTP_MASKS["release-weight"]
    runs = {
        "release's weight": dict(mtp_mask_of=mask_of, mtp_scale_of=scale_of),
        "all ones": dict(mtp_mask_of=lambda b: torch.ones_like(b["loss_mask"])),
    }
    weights = {}
    for label, how in runs.items():
        ((_, result),) = training.adam_steps(gpt.build_model(1), [batch], 0.0, record=lambda step: True, **how)
        weights[label] = result.mtp_loss_weights[0][:, mtp_positions(batch["labels"].shape[1], 1)]
    counted = mtp_mask(batch["loss_mask"], 1).bool()
    assert 0 < counted.sum() < counted.numel()
    assert weights["release's weight"][counted] == pytest.approx(weights["all ones"][counted], rel=1e-6)
    assert (weights["release's weight"][~counted] == 0).all()


def test_the_reading_of_whether_the_release_weight_run_reproduces_the_fix():
    """The fix against at step 50: the parts' Holm-adjusted signs decide the reading (experiments/PLAN.md)."""
    sign = {-1: [-0.3, -0.2, -0.25, -0.3, -0.2], 0: [0.1, -0.1, 0.05, -0.05, 0.0], 1: [0.3, 0.2, 0.25, 0.3, 0.2]}

    def read(fix, weight, positions):
        contrasts = [{"name": n, "what": n, "endpoint": design.PRIMARY} for n in ("fix", "weight", "positions")]
        for c, direction in zip(contrasts, (fix, weight, positions)):
            c[design.PRIMARY] = stats.summary(sign[direction])
        stats.holm([c[design.PRIMARY] for c in contrasts])
        return analysis.reading(contrasts)

    assert read(-1, -1, 0) == "reproduces it"
    assert read(-1, 0, -1) == "does not reproduce it"
    assert read(-1, -1, -1) == "partly"
    assert read(0, -1, 0) is None
    assert read(-1, 1, -1) == "weight: for weight; positions: against positions"


class TestSeedsKept:
    """Each finished seed is said and kept as it comes, and reused by the same command; a slow, stalled or failed arm
    is said and both arms end, their finished seeds kept."""

    def test_a_rerun_reuses_every_kept_seed_and_gives_the_same_figures(self, figures, tree, keep, capsys):
        again = effect.finish_effect(_start(tree, keep), "small")
        for arm in command.ARMS:
            assert list(again["arms"][arm]["reused"]) == [str(seed) for seed in SEEDS], arm
            assert again["arms"][arm]["cpu_seconds"] == 0, arm
        assert again["settings"] == figures["settings"]
        assert capsys.readouterr().err.count("kept from an earlier run") == len(command.ARMS) * len(SEEDS)

    def test_an_arm_that_finishes_no_seed_in_time_is_stopped_and_named(self, tree, mocker, capsys, tmp_path):
        """The limit is STALL times the seconds a seed is expected to take: here a hundredth of a second."""
        mocker.patch.object(command, "START_S", 0)
        mocker.patch.dict(design.SIZES, {"small": replace(design.SIZES["small"], seed_seconds=0.01)})
        arms = effect.start_effect("small", SEEDS, trees={"unpatched": BASE, "patched": tree}, keep=tmp_path)
        with pytest.raises(command.Stopped, match=rf"arm finished no seed in \d+ s, {command.STALL} x the 0 s a seed"):
            arms.wait()
        err = capsys.readouterr().err
        assert "seed number 1 of 1 still running" in err and "is slower than expected" in err
        assert arms.kept() == (
            "0 of 1 seeds in the unpatched arm and 0 of 1 seeds in the patched arm finished, kept in "
            f"{tmp_path}: the same command resumes from them"
        )

    def test_an_arm_that_fails_ends_both_and_says_why(self, tree):
        plans = {"unpatched": json.dumps({"seeds": [0], "no such field": 1})}
        plans["patched"] = effect.plans("small", SEEDS)["patched"].to_json()
        arms = command.Arms("experiments.effect_arm:measure", {"unpatched": BASE, "patched": tree}, plans, 15)
        with pytest.raises(command.Stopped, match=r"the unpatched arm failed: .* exit codes \[1\]"):
            arms.wait()
        assert arms.done["unpatched"] == 0  # the patched arm may have finished its small seed first

    @pytest.mark.parametrize(
        "raised, code, said",
        [
            (command.Stopped("the patched arm failed: exit codes [1]"), 5, "./run effect: the patched arm failed"),
            (Interrupted(signal.SIGINT), 130, "./run effect: interrupted by SIGINT: "),
        ],
    )
    def test_an_unfinished_run_says_what_it_kept_and_writes_nothing(
        self, raised, code, said, mocker, capsys, tmp_path
    ):
        mocker.patch.object(command, "trees", return_value={"unpatched": BASE, "patched": VIEW})
        kept = "1 of 10 seeds in the unpatched arm and 2 of 10 seeds in the patched arm finished, kept in K: ..."
        mocker.patch.object(command, "Arms").return_value.kept.return_value = kept
        mocker.patch.object(effect, "finish_effect", side_effect=raised)
        with pytest.raises(SystemExit) as exit_:
            effect.main(["--seeds", "0-9", "--out", str(tmp_path / "out"), "--keep", str(tmp_path / "keep")])
        out = capsys.readouterr().out
        assert exit_.value.code == code and out.startswith(said) and f"{kept}; nothing written" in out
        assert not (tmp_path / "out").exists()
        assert command.Arms.call_args.args[4] == tmp_path / "keep"


def test_a_contrast_that_negates_an_earlier_one_is_printed_once():
    """With the fix exactly 0 the prompt's part is the padding's part negated: one verdict says both."""
    values = {"fix": [0.0] * 5, "zero": [0.0] * 5, "padding": [0.1, -0.2, 0.3, 0.1, 0.2]}
    contrasts = [
        {"name": n, "what": n, "endpoint": design.PRIMARY, design.PRIMARY: stats.summary(v)} for n, v in values.items()
    ]
    negated = stats.summary([-v for v in values["padding"]])
    contrasts.append({"name": "prompt", "what": "x", "endpoint": design.PRIMARY, design.PRIMARY: negated})
    stats.holm([c[design.PRIMARY] for c in contrasts])
    for i, c in enumerate(contrasts):
        c["negative_of"] = analysis.negative_of(c, contrasts[:i])
    assert [c["negative_of"] for c in contrasts] == [None, None, None, "padding"]  # zeros negate zeros: no duplicate
    line = analysis.conclusion("cell", contrasts)
    assert line.count("no difference") == 3 and "prompt: the exact negative of padding in every seed" in line


def test_a_commit_in_the_clone_keeps_every_kept_seed(mocker):
    """megatron-core's __version__ ends in the HEAD of the git tree its package lies in (this clone, for .venv): a
    commit changes it, and must not change the key a seed is kept under."""
    import megatron.core

    before = effect_arm._code_digest()
    mocker.patch.object(megatron.core, "__version__", f"{megatron.core.__version__}+another-head")
    assert effect_arm._code_digest() == before


@pytest.mark.parametrize("size", ["short", "plateau", "course"])
def test_every_setting_the_plan_runs_is_analysed(size):
    """Each shared setting is run by one arm per seed, in turn: the analysis takes it from whichever arm ran it."""
    seeds = tuple(range(100, 105))
    by_arm = {
        arm: {(name, seed): {} for seed, names in zip(seeds, plan.runs) for name in names}
        for arm, plan in effect.plans(size, seeds).items()
    }
    planned = {"short": {*design.BRIDGE, *design.shared_settings("short")}, "plateau": set(design.PLATEAU)}
    planned["course"] = {
        *design.COURSE,
        *(f"release-weight {n.removeprefix('same-language ')}" for n in design.COURSE),
    }
    assert analysis.settings_run(size, by_arm, list(seeds)) == planned[size]


def _logits(tokens: torch.Tensor, table: dict) -> torch.Tensor:
    """[rows, len, vocab] logits whose argmax at each position is table[token there] (PAD where not listed)."""
    out = torch.zeros(*tokens.shape, 16)
    for index, token in enumerate(tokens.flatten().tolist()):
        out.view(-1, 16)[index, table.get(token, PAD)] = 1.0
    return out


class TestSpeculative:
    """Speculative decoding's counts, worked by hand on a model whose heads are lookup tables."""

    # The LM head: after SEP 7, then 8, 9, EOS. The MTP head at t drafts the token after seq[t + 1]: after 7 it drafts
    # 8 (right), after 8 it drafts 3 (wrong: the LM says 9), after 9 it drafts EOS (right).
    LM = {SEP: 7, 7: 8, 8: 9, 9: EOS}
    MTP = {7: 8, 8: 3, 9: EOS}

    def _forward(self, tokens):
        drafts = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)  # MTP at t is fed tokens[t + 1]
        return SimpleNamespace(lm_logits=_logits(tokens, self.LM), mtp_logits=[_logits(drafts, self.MTP)])

    def test_an_accepted_eos_draft_saves_no_verify_step(self):
        """Answer 7 8 9 EOS (n = 4): 7 comes with the prompt's forward. Step 1 checks the draft of 8: accepted, it
        yields 8 and 9, so the wrong draft of 9 is never checked. Step 2 checks the draft of EOS: accepted, it yields
        EOS, which ends the answer as a rejection would have: 2 steps for 3 tokens, 2 of 2 drafts accepted, 1 of 1
        without the EOS draft."""
        prompt = [BOS, 5, 6, SEP]
        tokens = torch.tensor([prompt + [PAD] * 4])
        roles = torch.tensor([[ROLES.index("prompt")] * 3 + [ROLES.index("answer")] * 5])
        model = SimpleNamespace(eval=lambda: None, train=lambda: None)
        sums = training.speculative(model, [{"tokens": tokens, "roles": roles}], 6, forward=self._forward)
        assert sums == dict(answers=1, steps=2, tokens=3, proposed=2, accepted=2, eos_proposed=1, eos_accepted=1)

    def test_verify_steps(self):
        """hits[i]: the draft of token i + 2 is right. A rejected draft yields one token; an accepted one two."""
        assert training.verify_steps([False, False, False], True) == dict(
            answers=1, steps=3, tokens=3, proposed=3, accepted=0, eos_proposed=1, eos_accepted=0
        )
        # tokens 2 right (yields 2, 3), 4 wrong (yields 4), 5 right (yields 5, 6); 6 is not an EOS
        assert training.verify_steps([True, True, False, True, False], False) == dict(
            answers=1, steps=3, tokens=5, proposed=3, accepted=2, eos_proposed=0, eos_accepted=0
        )
        assert training.verify_steps([], True)["steps"] == 0  # the answer is the EOS alone: no verify step


def _family(*values: list[float]) -> list[dict]:
    family = [stats.summary(v) for v in values]
    stats.holm(family)
    return family


class TestStatistics:
    def test_paired_interval_and_p_are_the_t_tests_of_the_differences(self):
        diff = stats.paired([1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 6.0, 8.0, 10.0])  # differences 1..5: mean 3
        half = 2.7764451051977987 * math.sqrt(2.5) / math.sqrt(5)  # t(0.975, 4 degrees of freedom), sd sqrt(2.5)
        assert diff["mean"] == 3.0 and diff["n"] == 5 and diff["above"] == 5 and diff["below"] == 0
        assert diff["ci95"] == pytest.approx([3.0 - half, 3.0 + half], rel=1e-9)
        assert diff["p"] == pytest.approx(0.01324, abs=1e-5)  # t = 3 / (sqrt(2.5) / sqrt(5)) = 4.243, 4 df

    def test_holm_steps_down_with_monotone_adjusted_p_values(self):
        """p ascending p1 < p2 < p3: adjusted max(3 p1), max(3 p1, 2 p2), max(.., p3); Bonferroni would give 3 p3."""
        spread = (-2, -1, 0, 1, 2)  # p about 0.012, 0.16 and 0.010: 2 p2 < 3 p1, so the max decides p2's
        family = _family([3.11 + e for e in spread], [0.1, -0.05, 0.2, 0.15, 0.0], [3.256 + e for e in spread])
        ps = [s["p"] for s in family]
        low, mid, high = sorted(ps)
        assert 2 * mid < 3 * low
        expected = {low: 3 * low, mid: max(3 * low, 2 * mid), high: max(3 * low, 2 * mid, high)}
        assert [s["holm"]["p"] for s in family] == pytest.approx([min(1.0, expected[p]) for p in ps], rel=1e-9)
        assert [stats.verdict(s, "x") for s in family] == ["for x", "no difference", "for x"]

    def test_an_adjusted_interval_excludes_zero_exactly_when_holm_rejects(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(50):
            family = _family(*(torch.randn(8, generator=gen).add(0.6 * k).tolist() for k in range(-2, 4)))
            for s in family:
                low, high = s["holm"]["interval"]
                assert (low > 0 or high < 0) == (s["holm"]["p"] < stats.ALPHA), s

    def test_an_exact_zero_is_no_difference_and_a_constant_shift_is_one(self):
        zero, shift = _family([0.0] * 10, [-0.25] * 10)
        assert zero["p"] == 1.0 and stats.verdict(zero, "the fix") == "no difference"
        assert stats.interval(zero, adjusted=True) == "+0.000 [+0.000, +0.000]"
        assert shift["p"] == 0.0 and stats.verdict(shift, "the fix") == "against the fix"

    def test_no_interval_from_fewer_than_five_seeds(self):
        (few,) = _family([1.0, 2.0, 3.0, 4.0])
        assert few["ci95"] is None and stats.verdict(few, "x") == "no interval"
        assert stats.interval(few) == "+2.500 (n = 4 < 5: no interval)"

    def test_size_against_the_smallest_difference_cared_about(self):
        within, beyond, unsettled = _family(
            [0.01, -0.01, 0.0, 0.02, -0.02], [1.0, 1.1, 0.9, 1.0, 1.05], [0.0, 0.3, -0.3, 0.1, -0.05]
        )
        assert [stats.size(s, 0.05) for s in (within, beyond, unsettled)] == ["within +-0.05", "at least 0.05", ""]

    def test_signs(self):
        s = stats.summary([1e-9, -1e-9, 0.002, -0.003, 0.0])
        assert stats.signs(s) == "higher in 2, lower in 2, equal in 1 of 5"


class TestPower:
    def test_at_no_difference_the_power_is_the_level(self):
        assert power.power(10, 0.0, 0.1, 0.01) == pytest.approx(0.01, rel=1e-9)

    def test_seeds_for_is_the_fewest_seeds_with_the_power_sought(self):
        n = power.seeds_for(0.075, 0.0389, 0.05 / 7)
        assert power.power(n, 0.075, 0.0389, 0.05 / 7) >= power.TARGET > power.power(n - 1, 0.075, 0.0389, 0.05 / 7)

    def test_the_pooled_sd_takes_each_runs_own_mean_out(self):
        assert power.pooled_sd([[1.0, 3.0], [11.0, 13.0, None]]) == pytest.approx(math.sqrt(2))

    def test_the_course_runs_seeds_are_what_its_power_table_sizes(self):
        _, n = power.course_table(design.COURSE, design.COURSE_STEPS)
        assert n == len(command.seeds(design.SIZES["course"].seeds))
        assert design.SIZES["course"].plan["decode_at"] == design.COURSE_STEPS

    def test_the_short_runs_seeds_are_what_the_plans_table_sizes(self):
        """The default seeds of `./run effect` are as many as the largest 'seeds for 80 %' of the plan's primary
        family on tokens per verify step (the family that sized it)."""
        rows = [row.split(" | ") for row in power.plan_table()[2:]]
        primary = [int(cells[3]) for cells, spec in zip(rows, power.PLAN_ROWS) if spec[3:] == (design.PRIMARY, 7)]
        assert max(primary) == len(command.seeds(design.SIZES["short"].seeds))


def _view_stamp():
    path = VIEW / GPT_STEP
    return path.stat().st_ino, path.stat().st_mtime_ns


class TestCommands:
    @pytest.mark.parametrize("module", [effect, repro])
    def test_help_runs_nothing_and_writes_nothing(self, module, capsys, tmp_path):
        before = _view_stamp()
        with pytest.raises(SystemExit) as exit_:
            module.main(["--help", "--out", str(tmp_path / "out")])
        assert exit_.value.code == 0 and "--seeds" in capsys.readouterr().out
        assert _view_stamp() == before and not (tmp_path / "out").exists()

    @pytest.mark.parametrize("name", ["effect", "repro"])
    def test_help_is_the_usage_alone(self, name):
        """As a user runs it: no third-party warning (megatron-core's about Transformer Engine or Apex) before it."""
        done = subprocess.run([str(REPO / "run"), name, "--help"], capture_output=True, text=True)
        assert (done.returncode, done.stderr) == (0, "") and done.stdout.startswith(f"usage: ./run {name} ")

    @pytest.mark.parametrize("module", [effect, repro])
    @pytest.mark.parametrize(
        "args",
        [
            ["--seeds", "5-2"],
            ["--seeds", "x"],
            ["--seeds", "1,1"],
            ["--seeds", ""],
            ["--seeds", f"0-{command.MAX_SEEDS}"],
            ["--out"],
            ["--size", "9"],
            ["--plateau", "--course"],
        ],
    )
    def test_a_bad_value_is_one_line_and_exit_2(self, module, args, capsys):
        before = _view_stamp()
        with pytest.raises(SystemExit) as exit_:
            module.main(args)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err
        assert _view_stamp() == before

    def test_out_must_be_a_writable_directory(self, tmp_path, capsys):
        (tmp_path / "file").write_text("")
        with pytest.raises(SystemExit) as exit_:
            effect.main(["--out", str(tmp_path / "file")])
        assert exit_.value.code == 2 and "not a directory" in capsys.readouterr().err
        assert command.out_dir(str(tmp_path / "new" / "dir")) == tmp_path / "new" / "dir"  # made at the end

    @pytest.mark.parametrize("zeroed, code", [(True, 0), (False, 5)])
    def test_the_control_exits_0_only_when_every_contrast_says_no_difference(
        self, figures, zeroed, code, mocker, capsys
    ):
        """Both arms the release: an exact zero everywhere passes; a contrast without a verdict (n = 1) does not."""
        control = json.loads(json.dumps(figures))
        contrasts = [c for data in control["settings"].values() for c in data["contrasts"]]
        if zeroed:
            for c in contrasts:
                c[c["endpoint"]] = stats.summary([0.0] * 5)
            stats.holm([c[c["endpoint"]] for c in contrasts])
        mocker.patch.object(command, "trees", return_value={"unpatched": BASE, "patched": VIEW})
        mocker.patch.object(command, "Arms")
        mocker.patch.object(effect, "finish_effect", return_value=control | {"control": True})
        with pytest.raises(SystemExit) as exit_:
            effect.main(["--control"])
        out = capsys.readouterr().out
        assert exit_.value.code == code and "control: the release in both arms" in out
        assert f"control: {0 if zeroed else len(contrasts)} of {len(contrasts)} contrasts" in out
        assert command.Arms.call_args.args[1] == {arm: BASE for arm in command.ARMS}
        plans = [json.loads(plan)["runs"] for plan in command.Arms.call_args.args[2].values()]
        assert all(list(runs) == list(design.BRIDGE) for arm in plans for runs in arm)  # the arms' contrasts only

    def test_seeds(self):
        assert command.seeds("10-19") == tuple(range(10, 20))
        assert command.seeds("3,1,4") == (3, 1, 4)

    def test_write_puts_every_file_in_one_rename(self, tmp_path):
        assert command.write(None, {"a": b"x"}) == ""
        line = command.write(tmp_path / "out", {"figures.json": b"{}", "plot.png": b"png"})
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["figures.json", "plot.png"]
        assert line == f"wrote {tmp_path / 'out' / 'figures.json'}, {tmp_path / 'out' / 'plot.png'}"


class TestReproSignature:
    def _sides(self, mtp_before, grad_before):
        return {
            "unpatched": {"mtp_1_loss": [mtp_before], "grad_norm": [grad_before], "lm_loss": [3.0]},
            "patched": {"mtp_1_loss": [4.0], "grad_norm": [1.0], "lm_loss": [3.0]},
        }

    def test_each_part_is_checked_against_its_criterion(self):
        positions = [{"padding_predicted_bos": 1.0, "ce_by_role": {"padding": 20.0, "answer": 4.0}}]
        checks = {c["what"]: c["holds"] for c in repro.signature(self._sides(16.0, 1.2), positions)}
        assert all(checks.values()), checks
        positions = [{"padding_predicted_bos": 0.2, "ce_by_role": {"padding": 8.0, "answer": 4.0}}]
        checks = [c["holds"] for c in repro.signature(self._sides(5.0, 0.9), positions)]
        assert checks == [False, False, False, False, True]
