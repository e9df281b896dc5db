"""pr: the review of #6105 and the fallback PR body, from the patch and from red/green gated on this very patch.

The measured input is a results file keyed by the patch's diff. These tests render a copy of the patch whose diff
differs only in an `index` line (so its key is its own and a real result is never touched), with values no real
run gives, to see where they land. No torch here: the tool runs as a user runs it.
"""

import json
import py_compile
import re
import subprocess
import sys

import pytest

from maintain import pr
from maintain.repo import REPO, WORK
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PATCHES

from tests.support.targets import FIXED, UPSTREAM_TEST


FENCE = "`" * 3
RULE = "-" * 100
AUTHOR = "Jane Doe <jane@example.com>"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
MEASURED = {"commit": COMMIT, "megatron_core": "9.8.7", "red": "3/3", "green": "77/78", "falcon_h1_forward": [11, 22]}
FORK_WORDS = ("./run", "mtp-mask-fix", "mtp_mask_fix", "the line we carry", "fork", "repro", "toy", "tiny model")


@pytest.fixture
def own_patch(patch, tmp_path):
    """The committed patch with one `index` line changed: the same texts, its own results key."""
    text = re.sub(r"^index [0-9a-f]+\.\.", "index 0000000000..", patch.text, count=1, flags=re.M)
    path = tmp_path / "0001-own.patch"
    path.write_text(text)
    own = Patch.load(path)
    assert pr.patch_key(own) != pr.patch_key(patch)
    yield own
    pr.results_file(own).unlink(missing_ok=True)


@pytest.fixture
def measured(own_patch):
    """Write what gate records for the patch; returns a writer for other contents."""

    def write(checkouts=(MEASURED,), key=None):
        path = pr.results_file(own_patch)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"patch": key or pr.patch_key(own_patch), "checkouts": list(checkouts)}))

    write()
    return write


@pytest.fixture
def run_pr(cli, own_patch):
    return lambda *args: cli("--patch", own_patch.path, "pr", *args)


@pytest.fixture
def texts(run_pr, measured):
    """(the general comment, [the anchored comments], the PR body) as printed with --co-author."""
    result = run_pr("--co-author", AUTHOR)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    review, body = re.split(r"\n\(b\) PR body, if #6105 stalls.*\n", result.stdout)
    general, *anchored = review.split(f"{RULE}\n")[1:-1]
    return general, anchored, body.split(f"{RULE}\n")[1]


def _suggestion(comment: str) -> str:
    (block,) = re.findall(rf"^{FENCE}suggestion\n(.*?){FENCE}$", comment, re.M | re.S)
    return block


class TestRefusals:
    def test_nothing_gated_for_this_patch_exits_5_and_names_gate(self, run_pr, refused):
        refused(run_pr("--co-author", AUTHOR), 5, "gate --checkout", "--checkouts-only")

    def test_another_patchs_results_never_reach_a_text(self, run_pr, measured, refused):
        measured(key="f" * 40)
        refused(run_pr("--co-author", AUTHOR), 5, "gate --checkout")

    @pytest.mark.parametrize("field", ["red", "green", "commit", "megatron_core"])
    def test_a_placeholder_is_refused(self, run_pr, measured, refused, field):
        measured([MEASURED | {field: "-"}])
        refused(run_pr("--co-author", AUTHOR), 5, "gate --checkout")

    @pytest.mark.parametrize("given", [None, "", "linmuchuiyang", "Jane Doe jane@example.com", "<jane@example.com>"])
    def test_the_credit_is_required_as_name_and_email(self, run_pr, measured, refused, given):
        refused(run_pr(*(["--co-author", given] if given is not None else [])), 2, '--co-author "Name <email>"')

    def test_no_falcon_h1_permalink_names_the_gate_to_run(self, run_pr, measured, own_patch, refused):
        measured([MEASURED | {"falcon_h1_forward": None}])
        line = refused(run_pr("--co-author", AUTHOR), 5, "FalconH1Model.forward", own_patch.base_commit[:12])
        assert "{" not in line

    def test_a_results_file_that_is_not_an_object(self, run_pr, own_patch, refused):
        pr.results_file(own_patch).parent.mkdir(parents=True, exist_ok=True)
        pr.results_file(own_patch).write_text("[]")
        refused(run_pr("--co-author", AUTHOR), 5, "holds no complete red/green of this patch")

    def test_a_patch_without_upstream_tests_is_refused(self, cli, refused):
        """The backport changes no upstream test file: nothing to suggest, refused before any result is read."""
        backport = next(PATCHES.glob("*/*.patch"))
        refused(cli("--patch", backport, "pr", "--co-author", AUTHOR), 2, "one upstream test file")


class TestReview:
    def test_general_comment_in_at_most_12_lines_with_a_pinned_falcon_h1_permalink(self, texts):
        general = texts[0]
        assert len(general.rstrip("\n").splitlines()) <= 12
        link = f"https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/{COMMIT}/{pr.FALCON_H1}#L11-L22"
        assert f"[`FalconH1Model.forward`]({link})" in general

    def test_answers_the_multimodal_steps_objection(self, texts):
        general = texts[0]
        for step in ("vlm_step", "llava_step", "nemotron_omni_step", "audio_lm_step"):
            assert f"`{step}`" in general
        assert "use_mtp" in general and "MTP loss" in general

    def test_says_what_it_cannot_check_without_the_head(self, texts):
        assert "can't check without your branch's head" in texts[0] and "mtp_num_layers > 0" in texts[0]

    def test_no_tool_or_fork_words_and_no_figures(self, texts):
        review = "".join([texts[0], *texts[1]])
        for word in FORK_WORDS:
            assert word not in review.lower()
        assert not re.search(r"\d\.\d{2,}|\d+(\.\d+)? ?%", review)  # no loss values, no percentages

    def test_one_anchored_comment_per_change_naming_file_and_lines_by_text(self, texts, own_patch):
        anchored = texts[1]
        assert len(anchored) >= 2
        for comment in anchored:
            assert re.match(rf"On `({re.escape(FIXED)}|{re.escape(UPSTREAM_TEST)})`", comment)
            assert ", select " in comment and comment.count(f"{FENCE}suggestion\n") == 1
            assert not re.search(r"\bline \d+|\bL\d+", comment)  # #6105's head is not visible: no line numbers
        fix = _suggestion(anchored[0])
        added = "".join(x.value for f in own_patch.files if f.path == FIXED for h in f for x in h if x.is_added)
        assert fix == "    }\n" + added

    def test_the_fix_comment_says_why_the_guard(self, texts):
        comment = "".join(line for line in _suggestion(texts[1][0]).splitlines(True) if "#" in line)
        assert "MTP loss" in comment and "FalconH1Model" in comment


class TestPrBody:
    def test_title_sections_counts_and_the_credit_exactly_as_given(self, texts, own_patch):
        body = texts[2].rstrip("\n")
        assert len(body.splitlines()) <= 25
        assert body.startswith(f"Title: {own_patch.subject}\n") and len(own_patch.subject) <= 60
        for section in ("# What does this PR do ?", "# Changelog", "# GitHub Actions CI", "# Additional Information"):
            assert f"\n{section}\n" in body
        assert "Supersedes #6105" in body and "Fixes #6103" in body
        assert "at 012345678 with megatron-core 9.8.7, 3 of the new cases fail" in body and "77/78 tests" in body
        assert body.endswith(f"\n\nCo-authored-by: {AUTHOR}")
        assert not any(word in body.lower() for word in FORK_WORDS)

    def test_cites_this_patchs_effect_summary_only_as_measured(self, run_pr, measured, own_patch, patch):
        """`./run effect`'s summary line (it names its settings, size and seeds) is cited verbatim, and only the one
        measured with this patch."""
        summary = (
            "MTP acceptance after SFT (size short, seeds 0-4): distinct-answers: teacher-forced +0.1 [+0.0, +0.2]"
        )
        figures = WORK / "effect" / pr.patch_key(own_patch) / "figures.json"
        figures.parent.mkdir(parents=True, exist_ok=True)
        try:
            assert summary not in run_pr("--co-author", AUTHOR).stdout  # none for this patch yet
            figures.write_text(json.dumps({"citations": {"summary": summary}}))
            assert f"{summary}.\n" in run_pr("--co-author", AUTHOR).stdout.split("(b) PR body")[1]
        finally:
            figures.unlink()

    def test_tells_the_submitter_to_put_the_credit_in_the_commit(self, run_pr, measured):
        out = run_pr("--co-author", AUTHOR).stdout
        assert f'git commit --amend --no-edit --trailer "Co-authored-by: {AUTHOR}"' in out


def test_rendering_imports_neither_torch_nor_megatron_nor_the_experiments(tool_env, own_patch, measured):
    """The modules loaded by the time a full render exits (printed by an atexit hook)."""
    loaded = (
        "sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'megatron', 'experiments'} or 'harness' in m)"
    )
    code = f"import atexit, sys; atexit.register(lambda: print({loaded}, file=sys.stderr)); import mtp_mask_fix.cli as c; c.main()"
    args = ["--patch", str(own_patch.path), "pr", "--co-author", AUTHOR]
    done = subprocess.run([sys.executable, "-c", code, *args], env=tool_env, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "[]\n")


# --- each suggestion alone, on a reconstruction of #6105's files ------------------------------------------------
# #6105 (upstream.md): the release's gpt_step.py with `"loss_mask": loss_mask,` added to the forward_args literal;
# in test_gpt_step.py, `loss_mask=loss_mask,` added to the exact-kwargs assertion of the middle-PP packed test, and
# a new test_forward_common_passes_loss_mask_to_model whose body is not visible here. We carry none of upstream's
# test file but the patch's context lines, so its reconstruction is a skeleton: upstream's imports and module-level
# helper names (upstream.md, "Upstream test style"), bodies not carried, and #6105's two test changes.
SKELETON = '''from unittest.mock import MagicMock, Mock, patch

import pytest
import torch

from megatron.bridge.training.gpt_step import _forward_step_common, get_batch


_Iterator = _MockPGCollection = _NoCudaTensor = _as_nocuda = _make_cfg = _NoopTimer = _RecordingModel = MagicMock
_set_middle_pp_stage = _set_last_pp_stage = patch


class TestGetBatch:
    def test_forward_common_passes_unmasked_packed_seq_params_on_middle_pp_stage(self, monkeypatch):
        """Packed batches without physical gaps do not need the router graph guard."""
        tokens, labels, loss_mask, position_ids, sentinel = [Mock()] * 5
        model = Mock(return_value=torch.tensor(1.0))

        _forward_step_common(Mock(), _Iterator({}), model)

        model.assert_called_once_with(
            input_ids=tokens,
            position_ids=position_ids,
            attention_mask=None,
            labels=labels,
            loss_mask=loss_mask,
            packed_seq_params=sentinel,
        )

    @pytest.mark.parametrize("mtp", [1])
    def test_forward_common_passes_loss_mask_to_model(self, monkeypatch, mtp):
        """Stands in for #6105's new test, whose body is not visible here."""
        assert get_batch is not None and mtp

    def test_forward_common_uses_model_chunk_vp_stage_instead_of_global_vpp_rank(self, monkeypatch):
        """The model chunk VP stage must override stale global VPP rank state."""
        _set_last_pp_stage(monkeypatch)
'''
SELECTIONS = {  # how each anchored comment's named lines are found in the reconstruction
    FIXED: r'        "loss_mask": loss_mask,\n    }\n',
    "exact-kwargs": r"            loss_mask=loss_mask,\n",
    "whole test": r"    @pytest\.mark\.parametrize\(\"mtp\".*?\n(?=\n    def )",
}

NAMED = {
    FIXED: '`"loss_mask": loss_mask,`',
    "exact-kwargs": "`loss_mask=loss_mask,`",
    "whole test": "whole `test_forward_common_passes_loss_mask_to_model`",
}


@pytest.fixture
def pr_6105(tmp_path, release_gpt_step):
    """#6105's two files, reconstructed, in a tree with upstream's ruff settings (this repo's pyproject mirrors
    upstream's ruff.toml); each must pass them as reconstructed."""
    literal = '        "labels": labels,\n    }\n'
    assert release_gpt_step.count(literal) == 1
    files = {
        FIXED: release_gpt_step.replace(
            literal, '        "labels": labels,\n        "loss_mask": loss_mask,\n    }\n'
        ),
        UPSTREAM_TEST: SKELETON,
    }
    assert _lint(tmp_path / "as-is", files) == []
    return files


def _lint(root, files: dict) -> list[str]:
    """ruff check and ruff format --check with upstream's settings, and a compile, on the files; the findings."""
    found = []
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
        try:
            py_compile.compile(str(root / path), doraise=True)
        except py_compile.PyCompileError as exc:
            found.append(str(exc))
    config = ["--config", str(REPO / "pyproject.toml"), "--no-cache"]
    for command in (["check", "--output-format", "concise"], ["format", "--check"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *command, *config, *files], cwd=root, capture_output=True, text=True
        )
        found += [line for line in done.stdout.splitlines() if done.returncode and line.strip()]
    return found


@pytest.mark.parametrize(
    "index, file, selection", [(0, FIXED, FIXED), (1, UPSTREAM_TEST, "exact-kwargs"), (2, UPSTREAM_TEST, "whole test")]
)
def test_each_suggestion_alone_leaves_files_that_compile_and_pass_upstreams_ruff(
    texts, pr_6105, tmp_path, patched_gpt_step, index, file, selection
):
    comment = texts[1][index]
    assert comment.startswith(f"On `{file}`") and NAMED[selection] in comment.split(FENCE)[0]
    text, count = re.subn(SELECTIONS[selection], lambda _: _suggestion(comment), pr_6105[file], flags=re.S)
    assert count == 1, f"the lines comment {index} names are not in #6105's {file} exactly once"
    assert _lint(tmp_path / f"suggestion-{index}", pr_6105 | {file: text}) == []
    if file == FIXED:  # accepting the fix's suggestion gives exactly the patched release
        assert text == patched_gpt_step
