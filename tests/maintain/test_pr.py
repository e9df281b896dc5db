"""pr: the review of #6105 and the PR body that carries it forward, from the patch and from red/green gated on this
very patch.

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
from maintain.repo import REPO
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PATCHES
from tests.support.targets import FIXED, UPSTREAM_TEST


FENCE = "`" * 3
RULE = "-" * 100
AUTHOR = "Jane Doe <jane@example.com>"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LM = "fedcba9876543210fedcba9876543210fedcba98"
ANCHORS = {
    "use_mtp": [11, 11],
    "falcon_h1_forward": [21, 32],
    "falcon_h1_export": [41, 41],
    "steps": {"llava_step": [61, 61], "vlm_step": [51, 51]},
    "megatron_lm": LM,
    "mtp_fallback": [71, 71],
    "mtp_roll": [81, 86],
    "mlm_pretrain": [91, 97],
}
MEASURED = {"commit": COMMIT, "megatron_core": "9.8.7", "megatron_lm": LM, "red": "3/3", "green": "77/78"}
MEASURED |= {"anchors": ANCHORS}
BLOB = f"https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/{COMMIT}"
LINKS = {  # what each anchor must turn into
    "already computes `use_mtp`": f"{BLOB}/{FIXED}#L11",
    "`FalconH1Model.forward`": f"{BLOB}/{pr.FALCON_H1}#L21-L32",
    "`FalconH1ModelProvider`": f"{BLOB}/src/megatron/bridge/models/__init__.py#L41",
    "`vlm_step`": f"{BLOB}/src/megatron/bridge/training/vlm_step.py#L51",
    "`llava_step`": f"{BLOB}/src/megatron/bridge/training/llava_step.py#L61",
    "falls back to an all-ones mask": f"https://github.com/NVIDIA/Megatron-LM/blob/{LM}/{pr.MTP}#L71",
    "rolls the labels and the mask together": f"https://github.com/NVIDIA/Megatron-LM/blob/{LM}/{pr.MTP}#L81-L86",
    "passes `loss_mask` unconditionally": f"https://github.com/NVIDIA/Megatron-LM/blob/{LM}/{pr.PRETRAIN}#L91-L97",
    "ships no FalconH1 recipe": f"https://github.com/NVIDIA-NeMo/Megatron-Bridge/tree/{COMMIT}/src/megatron/bridge/recipes",
}
FORK_WORDS = ("./run", "mtp-mask-fix", "mtp_mask_fix", "the line we carry", "fork", "repro", "toy", "tiny model")
# Upstream's .github/PULL_REQUEST_TEMPLATE.md: its checklist, every item kept as written.
CHECKLIST = (
    "Make sure you read and followed [Contributor guidelines]"
    "(https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/CONTRIBUTING.md)",
    "Did you write any new necessary tests?",
    "Did you add or update any necessary documentation?",
    "Does the PR affect components that are optional to install? (Ex: Numba, Pynini, Apex etc)",
    "  - [ ] Reviewer: Does the PR have correct import guards for all optional libraries?",
)


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
def run_pr(maintain, own_patch):
    return lambda *args: maintain("pr", "--patch", own_patch.path, *args)


@pytest.fixture
def texts(run_pr, measured):
    """(the general comment, [(where, comment) of each anchored one], the PR body, pr's whole output)."""
    result = run_pr("--co-author", AUTHOR)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    _, general, *anchored, framing, body, end = result.stdout.split(f"{RULE}\n")
    assert framing.startswith("\n(b) PR body") and end.strip() == ""
    return general, [tuple(comment.split("\n\n", 1)) for comment in anchored], body, result.stdout


def _suggestion(comment: str) -> str:
    (block,) = re.findall(rf"^{FENCE}suggestion\n(.*?){FENCE}$", comment, re.M | re.S)
    return block


class TestRefusals:
    def test_nothing_gated_for_this_patch_exits_5_and_names_gate(self, run_pr, refused):
        refused(run_pr("--co-author", AUTHOR), 5, "gate --checkout", "--checkouts-only")

    def test_another_patchs_results_never_reach_a_text(self, run_pr, measured, refused):
        measured(key="f" * 40)
        refused(run_pr("--co-author", AUTHOR), 5, "gate --checkout")

    @pytest.mark.parametrize("field", ["red", "green", "commit", "megatron_core", "megatron_lm"])
    def test_a_placeholder_is_refused(self, run_pr, measured, refused, field):
        """megatron_lm is null where the interpreter's megatron-core was not built from the commit's pin."""
        measured([MEASURED | {field: None if field == "megatron_lm" else "-"}])
        refused(run_pr("--co-author", AUTHOR), 5, "gate --checkout")

    @pytest.mark.parametrize("given", [None, "", "linmuchuiyang", "Jane Doe jane@example.com", "<jane@example.com>"])
    def test_the_credit_is_required_as_name_and_email(self, run_pr, measured, refused, given):
        refused(run_pr(*(["--co-author", given] if given is not None else [])), 2, '--co-author "Name <email>"')

    @pytest.mark.parametrize(
        "missing", ["use_mtp", "falcon_h1_forward", "falcon_h1_export", "mtp_roll", "mlm_pretrain", "steps"]
    )
    def test_a_link_whose_lines_were_not_found_names_the_gate_to_run(
        self, run_pr, measured, own_patch, refused, missing
    ):
        measured([MEASURED | {"anchors": ANCHORS | {missing: None}}])
        line = refused(run_pr("--co-author", AUTHOR), 5, missing, "gate --checkout", own_patch.base_commit[:12])
        assert "{" not in line

    def test_a_results_file_that_is_not_an_object(self, run_pr, own_patch, refused):
        pr.results_file(own_patch).parent.mkdir(parents=True, exist_ok=True)
        pr.results_file(own_patch).write_text("[]")
        refused(run_pr("--co-author", AUTHOR), 5, "holds no complete red/green of this patch")

    def test_a_patch_without_upstream_tests_is_refused(self, maintain, refused):
        """The backport changes no upstream test file: nothing to suggest, refused before any result is read."""
        backport = next(PATCHES.glob("*/*.patch"))
        refused(maintain("pr", "--patch", backport, "--co-author", AUTHOR), 2, "one upstream test file")


class TestReview:
    def test_written_to_the_author_thanks_first_in_at_most_12_lines(self, texts):
        general = texts[0]
        assert general.startswith("Thanks") and len(general.rstrip("\n").splitlines()) <= 12
        for phrase in ("blocker", "can't check", "cannot check", "select ", "your whole", "each applies on its own"):
            assert phrase not in general.lower()

    def test_every_claim_links_the_gated_commit(self, texts):
        """The links are the anchors gate found, at the commit it gated (Megatron-LM's at the commit it pins)."""
        review = "".join([texts[0], *(comment for _, comment in texts[1])])
        for text, link in LINKS.items():
            assert f"[{text}]({link})" in review
        assert len(re.findall(r"\]\((https://[^)]+)\)", review)) == len(LINKS)

    def test_answers_the_multimodal_steps_and_falcon_h1_without_overstating(self, texts):
        general = texts[0]
        assert "use_mtp" in general and "MTP loss" in general and "TypeError" in general
        assert "every FalconH1 run" not in general

    def test_asks_for_the_suggestions_as_one_batch(self, texts):
        assert "one batch" in texts[0]

    def test_no_tool_or_fork_words_and_no_figures(self, texts):
        review = "".join([texts[0], *(comment for _, comment in texts[1])])
        for word in FORK_WORDS:
            assert word not in review.lower()
        assert not re.search(r"\d\.\d{2,}|\d+(\.\d+)? ?%", review)  # no loss values, no percentages

    def test_one_comment_per_change_on_lines_named_by_text(self, texts, own_patch):
        anchored = texts[1]
        assert len(anchored) == 3
        for where, comment in anchored:
            assert re.fullmatch(rf"\[on `({re.escape(FIXED)}|{re.escape(UPSTREAM_TEST)})`: #6105's .+\]", where)
            assert comment.count(f"{FENCE}suggestion\n") == 1
            assert not re.search(r"\bline \d+|\bL\d+", where + comment)  # #6105's head is not visible: no numbers
            assert "select" not in comment.lower()
        fix = _suggestion(anchored[0][1])
        added = "".join(x.value for f in own_patch.files if f.path == FIXED for h in f for x in h if x.is_added)
        assert fix == "    }\n" + added
        assert _suggestion(anchored[2][1]) == pr.added(own_patch, UPSTREAM_TEST)

    def test_the_fix_comment_says_why_only_with_mtp(self, texts):
        comment = "".join(line for line in _suggestion(texts[1][0][1]).splitlines(True) if "#" in line)
        assert "MTP loss" in comment and "FalconH1Model" in comment


class TestPrBody:
    def test_title_sections_and_the_credit_exactly_as_given(self, texts, own_patch):
        body = texts[2].rstrip("\n")
        assert body.startswith(f"Title: {own_patch.subject}\n") and len(own_patch.subject) <= 60
        for section in ("# What does this PR do ?", "# Changelog", "# GitHub Actions CI", "# Additional Information"):
            assert f"\n{section}\n" in body
        assert "carries #6105 forward" in body and "upersede" not in body and "Fixes #6103" in body
        assert body.endswith(f"\n\nCo-authored-by: {AUTHOR}")
        assert not any(word in body.lower() for word in FORK_WORDS)

    def test_the_templates_checklist_is_intact(self, texts):
        body = texts[2]
        assert "\n**Pre checks**:\n" in body
        for item in CHECKLIST:
            assert re.search(rf"^(- \[[ x]\] )?{re.escape(item)}$", body, re.M), item

    def test_counts_the_megatron_lm_commit_and_pre_commit_as_gated(self, texts, measured, run_pr):
        body = texts[2]
        assert "at commit 0123456789ab, with megatron-core 9.8.7 built from its `3rdparty/Megatron-LM` pin" in body
        assert f"(NVIDIA/Megatron-LM@{LM[:12]}): 77/78 pass" in body and "the 3 new cases that need it" in body
        assert "pre-commit's hooks" in body
        second = MEASURED | {"commit": "1" * 40, "green": "5/6", "red": "1/2"}
        measured([MEASURED, second])
        both = run_pr("--co-author", AUTHOR).stdout
        assert "at commit 111111111111," in both and "5/6 pass" in both and "1 of the 2 new cases" in both

    def test_a_run_with_a_megatron_core_not_built_from_the_pin_is_left_out(self, measured, run_pr):
        measured([MEASURED, MEASURED | {"commit": "1" * 40, "megatron_lm": None}])
        body = run_pr("--co-author", AUTHOR).stdout
        assert "at commit 0123456789ab," in body and "111111111111" not in body

    def test_quotes_the_reports_figures_and_no_tiny_model_figure(self, texts):
        body = texts[2]
        assert "From the report in #6103" in body and "15.80068" in body and "4.416957" in body
        assert "effect" not in body.lower() and "seed" not in body.lower()

    def test_is_to_be_opened_only_after_asking_in_6105(self, texts):
        out = texts[3]
        assert "asked in #6105" in out.split(f"{RULE}\n")[-3]
        assert f'git commit --amend --no-edit --reset-author --signoff --trailer "Co-authored-by: {AUTHOR}"' in out


def test_rendering_imports_neither_torch_nor_megatron_nor_the_experiments(tool_env, own_patch, measured):
    """The modules loaded by the time a full render exits (printed by an atexit hook)."""
    loaded = (
        "sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'megatron', 'experiments'} or 'harness' in m)"
    )
    code = (
        f"import atexit, sys; atexit.register(lambda: print({loaded}, file=sys.stderr)); "
        "from maintain import pr; from mtp_mask_fix import cli; cli.main(parser=pr.parser())"
    )
    args = ["--patch", str(own_patch.path), "--co-author", AUTHOR]
    done = subprocess.run([sys.executable, "-c", code, *args], env=tool_env, capture_output=True, text=True, cwd=REPO)
    assert (done.returncode, done.stderr) == (0, "[]\n")


# --- the lines the links point at, derived from a tree ------------------------------------------------------------

FALCON = """class FalconH1Model:
    def forward(
        self,
        input_ids,
        labels=None,
    ):
        return input_ids
"""
MODELS = '__all__ = [\n    "GPTModelProvider",\n    "FalconH1ModelProvider",\n]\n'
STEP = 'def forward_step(loss_mask):\n    forward_args = {\n        "input_ids": None,\n        "loss_mask": loss_mask,\n    }\n'
MTP = """def process_mtp_loss(labels, loss_mask, config):
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    for depth in range(config.mtp_num_layers):
        mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1)
        loss_mask, num_tokens = roll_tensor(
            loss_mask, shifts=-1
        )
"""
PRETRAIN = """def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(
        tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
    )
    return output_tensor, partial(loss_func, loss_mask)
"""


def _line(text: str, needle: str) -> int:
    return text[: text.index(needle)].count("\n") + 1


def test_anchors_are_the_lines_of_the_gated_commit_and_its_pinned_megatron_lm(tmp_path, git, release_gpt_step):
    lm = tmp_path / "upstream" / pr.SUBMODULE
    (lm / pr.MTP).parent.mkdir(parents=True)
    (lm / pr.MTP).write_text(MTP)
    (lm / pr.PRETRAIN).write_text(PRETRAIN)
    git(lm, "init", "--quiet")
    git(lm, "add", "-A")
    git(lm, "commit", "--quiet", "-m", "core")
    pin = git(lm, "rev-parse", "HEAD").strip()
    root = tmp_path / "upstream"
    files = {FIXED: release_gpt_step, pr.FALCON_H1: FALCON, pr.MODELS: MODELS, f"{pr.STEPS}/vlm_step.py": STEP}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    git(root, "init", "--quiet")
    git(root, "add", *files)
    git(root, "update-index", "--add", "--cacheinfo", f"160000,{pin},{pr.SUBMODULE}")
    git(root, "commit", "--quiet", "-m", "bridge")

    found = pr.anchors(root, root, git(root, "rev-parse", "HEAD").strip())

    use_mtp = _line(release_gpt_step, "    use_mtp = ")
    assert found == {
        "use_mtp": [use_mtp, use_mtp],
        "falcon_h1_forward": [2, 6],
        "falcon_h1_export": [3, 3],
        "steps": {"vlm_step": [4, 4]},
        "megatron_lm": pin,
        "mtp_fallback": [3, 4],
        "mtp_roll": [6, 9],
        "mlm_pretrain": [3, 5],
    }


def test_no_falcon_h1_link_when_its_forward_takes_the_mask():
    assert pr.falcon_h1_forward_lines(FALCON.replace("labels=None,", "labels=None,\n        **kwargs,")) is None
    assert pr.falcon_h1_forward_lines(FALCON.replace("labels=None,", "loss_mask=None,")) is None


# --- the suggestions, committed as one batch, on a reconstruction of #6105's files ------------------------------
# #6105 (its description): the release's gpt_step.py with `"loss_mask": loss_mask,` added to the forward_args
# literal; in test_gpt_step.py, `loss_mask=loss_mask,` added to the exact-kwargs assertion of the middle-PP packed
# test, and a new test_forward_common_passes_loss_mask_to_model whose body is not visible here. We carry none of
# upstream's test file but the patch's context lines, so its reconstruction is a skeleton: upstream's imports and
# module-level helper names (upstream.md, "Upstream test style"), bodies not carried, and #6105's two test changes.
SKELETON = '''from unittest.mock import MagicMock, Mock, patch

import pytest
import torch

from megatron.bridge.training.gpt_step import _forward_step_common, get_batch


_Iterator = _MockPGCollection = _NoCudaTensor = _as_nocuda = _make_cfg = _NoopTimer = _RecordingModel = MagicMock
_set_middle_pp_stage = _set_last_pp_stage = patch


class TestGetBatch:
    def test_middle_pp_stage_keeps_non_packed_fast_path(self, monkeypatch):
        """Middle PP stages without attention metadata keep the all-None fast path."""
        get_batch(MagicMock(), _make_cfg(), use_mtp=False, pg_collection=_MockPGCollection())

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
        assert mtp

    def test_forward_common_uses_model_chunk_vp_stage_instead_of_global_vpp_rank(self, monkeypatch):
        """The model chunk VP stage must override stale global VPP rank state."""
        _set_last_pp_stage(monkeypatch)
'''
SELECTIONS = (  # each anchored comment's lines, as found in the reconstruction, in the review's order
    (FIXED, r'        "loss_mask": loss_mask,\n    }\n', '`"loss_mask": loss_mask,`'),
    (UPSTREAM_TEST, r"            loss_mask=loss_mask,\n", "`loss_mask=loss_mask,`"),
    (
        UPSTREAM_TEST,
        r"    @pytest\.mark\.parametrize\(\"mtp\".*?\n(?=\n    def )",
        "`test_forward_common_passes_loss_mask_to_model`",
    ),
)


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


def test_the_suggestions_committed_as_one_batch_leave_the_patched_files(texts, pr_6105, tmp_path, patched_gpt_step):
    """All three on #6105's reconstruction: files that compile and pass upstream's ruff, gpt_step.py exactly the
    patched release."""
    files = dict(pr_6105)
    for (file, selection, named), (where, comment) in zip(SELECTIONS, texts[1], strict=True):
        assert where.startswith(f"[on `{file}`: #6105's {named}")
        files[file], count = re.subn(selection, lambda _: _suggestion(comment), files[file], flags=re.S)
        assert count == 1, f"the lines {where} names are not in #6105's {file} exactly once"
    assert _lint(tmp_path / "batch", files) == []
    assert files[FIXED] == patched_gpt_step
