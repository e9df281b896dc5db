"""The effect experiment's machinery, on its small size: both arms run, from the same pretrained weights on the same
data, and the figures, plot and tables come out whole.

Whatever the experiment measures is its result: nothing here asserts the direction or the size of the effect. Both
arms always run (the release as shipped and the view), whichever tree this session imports.
"""

import json
import math
from pathlib import Path

import pytest

from experiments import effect
from mtp_mask_fix.paths import VIEW, is_gpt_step_of
from mtp_mask_fix.targets import pins, release


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("effect")


@pytest.fixture(scope="module")
def figures(out_dir):
    return effect.run_effect(out_dir, "small")


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


class TestEffectSmall:
    def test_each_arm_ran_its_own_tree(self, figures):
        trees = {"unpatched": release(pins()["megatron-bridge"]).root, "patched": VIEW}
        for arm, tree in trees.items():
            assert is_gpt_step_of(figures["arms"][arm]["gpt_step_file"], tree), arm

    def test_both_arms_start_from_the_same_pretrained_weights(self, figures):
        arms = figures["arms"]
        assert arms["unpatched"]["pretrained_weights_sha256"] == arms["patched"]["pretrained_weights_sha256"]
        assert figures["same_pretrained_weights"] is True

    def test_both_arms_see_the_same_data(self, figures):
        arms = figures["arms"]
        assert arms["unpatched"]["pretrain_data_sha256"] == arms["patched"]["pretrain_data_sha256"]
        assert arms["unpatched"]["sft_data_sha256"] == arms["patched"]["sft_data_sha256"]
        runs = len(figures["plan"]["seeds"]) * len(figures["plan"]["settings"])
        assert len(set(arms["patched"]["sft_data_sha256"])) == runs  # every run its own batches
        assert figures["same_data"] is True

    def test_step_one_lm_loss_is_the_same_in_both_arms(self, figures):
        """Same weights, same batch: the fix reaches only the MTP loss, so the first LM loss agrees."""
        for setting in figures["settings"].values():
            lm = setting["step_one"]["lm_loss"]
            assert lm["patched"]["values"] == pytest.approx(lm["unpatched"]["values"], rel=1e-6)

    def test_figures_are_finite_and_complete(self, figures):
        assert all(math.isfinite(x) for x in _numbers(figures))
        plan = figures["plan"]
        assert list(figures["settings"]) == plan["settings"] and len(plan["settings"]) >= 2
        for setting in figures["settings"].values():
            assert set(setting["step_one"]["mix"]) == {"prompt", "answer", "padding"}
            assert sum(setting["step_one"]["mix"].values()) == pytest.approx(1.0)
            for metric, row in setting["final"].items():
                if metric != "step":
                    assert len(row["paired_diff"]["values"]) == len(plan["seeds"]), metric
            for metric in ("true_acceptance_answer", "mtp_ce_answer"):
                for arm in effect.ARMS:
                    assert len(setting["curves"][metric][arm]["mean"]) == len(plan["eval_steps"])

    def test_figures_json_and_plot_are_written(self, figures, out_dir):
        assert json.loads((out_dir / "figures.json").read_text()) == figures
        assert (out_dir / "effect.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_tables_have_every_row(self, figures):
        text = effect.format_tables(figures)
        for setting in figures["settings"]:
            assert f"== {setting}" in text
        for label in ("mtp_1 loss", "grad norm", "LM loss", "MTP loss mass on masked positions", "batch mix"):
            assert label in text
        rows = [line for line in text.splitlines() if "±" in line]
        acceptance = [line for line in rows if "acceptance" in line and "true" not in line]
        assert acceptance and all("logged" in line for line in acceptance)
        answers = [line for line in rows if "answer" in line]
        assert len(answers) == 4 * len(figures["settings"])  # true acceptance, MTP CE, LM top-1, LM CE

    def test_summary_line_names_every_setting(self, figures):
        line = effect.summary_line(figures)
        assert "\n" not in line and all(setting in line for setting in figures["settings"])
