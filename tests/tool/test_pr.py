"""pr: the review comment for #6105 and the fallback PR body, built from the patch and from measured figures."""

import json
import re
import subprocess

import pytest

from .conftest import FIXED


FENCE = "`" * 3


@pytest.fixture
def figures(tmp_path):
    """A figures.json shaped like `repro`'s, with values no real run would give, to see where they land."""
    sides = {
        side: {"lm_loss": 1.25, "mtp_1_loss": 2.5 + i, "grad_norm": 3.125, "mtp_mass_on_masked": 0.75 - 0.75 * i}
        for i, side in enumerate(("before", "after"))
    }
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(sides))
    return path


@pytest.fixture
def texts(cli, figures):
    result = cli("pr", "--figures", figures)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    review, body = re.split(r"\n\(b\) PR body, if #6105 stalls\n", result.stdout)
    return review, body


def _blocks(text: str, kind: str) -> list[str]:
    return re.findall(rf"^{FENCE}{kind}\n(.*?){FENCE}$", text, re.M | re.S)


class TestReviewComment:
    def test_suggestions_carry_the_fix_and_the_new_tests(self, texts, patch):
        fix, empty, new_tests = _blocks(texts[0], "suggestion")
        (source,) = [f for f in patch.files if f.path == FIXED]
        assert fix == "    }\n" + "".join(line.value for hunk in source for line in hunk if line.is_added)
        assert empty == ""  # the exact-kwargs assertion goes back to upstream's
        assert "def test_forward_common_passes_loss_mask_to_mtp_model" in new_tests

    def test_the_rest_of_the_test_part_applies_to_upstreams_file(self, texts, checkout, tmp_path):
        (rest,) = _blocks(texts[0], "diff")
        assert "    def " not in "".join(line for line in rest.splitlines() if line.startswith("+"))
        diff = tmp_path / "rest.diff"
        diff.write_text(rest)
        done = subprocess.run(
            ["git", "apply", "--check", str(diff)], cwd=checkout.root, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr

    def test_names_falcon_h1_and_shows_the_repro_in_three_lines(self, texts):
        assert "FalconH1Model.forward(input_ids, position_ids, attention_mask" in texts[0]
        repro = _blocks(texts[0], "")[-1].splitlines()
        assert repro == [
            "$ ./run repro   # mtp-mask-fix",
            "mtp_1 loss 2.5000 -> 3.5000, lm loss 1.2500 -> 1.2500, grad norm 3.125 -> 3.125",
            "MTP loss mass on masked positions 75.0% -> 0.0%",
        ]


class TestPrBody:
    def test_at_most_25_lines_in_upstreams_sections(self, texts, patch):
        body = texts[1].split("-" * 100 + "\n", 1)[1].rstrip("\n")
        assert len(body.splitlines()) <= 25
        assert body.startswith(f"Title: {patch.subject}\n")
        for section in ("# What does this PR do ?", "# Changelog", "# GitHub Actions CI", "# Additional Information"):
            assert f"\n{section}\n" in body
        assert "Supersedes #6105" in body and "Fixes #6103" in body
        assert body.endswith("Co-authored-by: linmuchuiyang <linmuchuiyang@users.noreply.github.com>")

    def test_figures_come_from_the_file(self, texts):
        assert "MTP loss mass on masked positions 75.0% -> 0.0%, LM loss 1.2500 -> 1.2500." in texts[1]


def test_without_figures_it_says_what_to_run(cli, refused, tmp_path):
    refused(cli("pr", "--figures", tmp_path / "none.json"), 2, "run `mtp-mask-fix repro` first")
