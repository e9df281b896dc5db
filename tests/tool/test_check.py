"""`check` and `status` on each kind of target: a site-packages dir, a plain source tree, a git checkout; and what
counts as the fix, whoever wrote it."""

import os
import re
import sys

import pytest

from maintain.repo import REPO
from maintain.repo import release as release_target
from mtp_mask_fix.check import why_not_fixed
from mtp_mask_fix.patch import Patch
from tests.support.targets import (
    BACKPORT_FILE,
    CONTEXT,
    EQUIVALENT_FIX,
    FIXED,
    LABELS,
    PATCH_FILE,
    REGION_EDIT,
    UPSTREAM_TEST,
    Tree,
    verdict,
)


class TestCheckStates:
    """The three states, each with its own exit code and a one-line verdict, on every kind of target."""

    def test_applies(self, cli, snapshot, target):
        before = snapshot(target.root)
        line = verdict(cli("check", target.root), 0)
        assert snapshot(target.root) == before  # check never writes
        assert "the patch applies" in line and "the bug is present" in line
        scope = "source hunks only" if target.kind == "installed" else "source and tests"
        assert scope in line

    def test_already_applied_after_apply(self, cli, target):
        assert cli("apply", "--no-verify", target.root).returncode == 0
        line = verdict(cli("check", target.root), 3)
        assert "already applied" in line

    def test_equivalent_upstream_fix_is_already_fixed(self, cli, edit, target):
        edit(target, target.gpt_step, LABELS, EQUIVALENT_FIX)
        line = verdict(cli("check", target.root), 3)
        assert "fixed another way" in line and "nothing to apply" in line

    def test_drifted_context_names_the_file(self, cli, edit, snapshot, target):
        edit(target, target.gpt_step, CONTEXT, '        "attention_mask": attention_mask if use_mask else None,\n')
        before = snapshot(target.root)
        line = verdict(cli("check", target.root), 4)
        assert snapshot(target.root) == before
        assert "drifted" in line
        assert re.search(r"patch failed: (src/)?megatron/bridge/training/gpt_step\.py:\d+", line)
        at = target.gpt_step.read_text().split("attention_mask if use_mask")[0].count("\n") + 1  # the user's line
        assert line.endswith(f", at {target.gpt_step.relative_to(target.root)}:{at} of this tree")

    def test_upstream_test_file_moved_on(self, cli, edit, checkout, patched_gpt_step):
        """The source hunk still fits, but upstream's test file moved on: the source alone, said so (naming the test
        file), and apply writes that; revert takes it out again."""
        edit(checkout, checkout.upstream_test, "_flops_seqlen_sum == 0\n", "_flops_seqlen_sum == 0  # moved on\n")
        tests = checkout.upstream_test.read_bytes()
        line = verdict(cli("check", checkout.root), 0)
        assert (
            "source hunks only; upstream's tests left out, their file has moved on" in line and UPSTREAM_TEST in line
        )
        assert cli("apply", "--no-verify", checkout.root).returncode == 0
        assert checkout.gpt_step.read_text() == patched_gpt_step and checkout.upstream_test.read_bytes() == tests
        assert "already applied (source hunks only; upstream's tests left out" in verdict(
            cli("check", checkout.root), 3
        )
        assert cli("revert", checkout.root).returncode == 0
        assert "the patch applies" in verdict(cli("check", checkout.root), 0)

    def test_default_target_is_what_the_interpreter_imports(self, cli, tool_env, site_packages):
        path = os.pathsep.join(filter(None, [str(site_packages.root), tool_env.get("PYTHONPATH")]))
        line = verdict(cli("check", env=dict(tool_env, PYTHONPATH=path)), 0)
        assert line.startswith(f"{site_packages.root}: the patch applies")

    def test_default_target_of_an_editable_checkout_is_the_checkout(self, cli, tool_env, edit, checkout):
        """An editable install imports the checkout's src/: judged as the checkout, with the same verdicts as when
        it is named."""
        env = dict(tool_env, PYTHONPATH=str(checkout.root / "src"))
        assert verdict(cli("check", env=env), 0).startswith(f"{checkout.root}: the patch applies (source and tests")
        edit(checkout, checkout.gpt_step, CONTEXT, REGION_EDIT, commit=False)
        line = verdict(cli("check", env=env), 2)
        assert line == verdict(cli("check", checkout.root), 2) and "uncommitted local changes in the patch's" in line

    def test_no_target_and_no_megatron_bridge_is_refused(self, cli, refused):
        refused(cli("check"), 2, "imports no megatron.bridge", sys.executable, "--python")


# A line changed and a line added, in the source hunk's region; each the user's line that the verdict names.
REGION_EDITS = {"changed": (CONTEXT, REGION_EDIT), "added": (CONTEXT, CONTEXT + "        # a local note\n")}


@pytest.mark.parametrize("change", REGION_EDITS)
@pytest.mark.parametrize("kind", ["site_packages", "checkout"])
def test_local_edits_in_the_region_name_the_users_line(request, cli, refused, edit, snapshot, kind, change):
    """Installed (the wheel's RECORD says the file is not as shipped) or checked out (the diff fits the commit):
    local edits, not drift; check and apply refuse with exit 2, at the line of the user's file, and change nothing."""
    tree, (old, new) = request.getfixturevalue(kind), REGION_EDITS[change]
    edit(tree, tree.gpt_step, old, new, commit=False)
    text = tree.gpt_step.read_text()
    line = text[: text.index(new) + len(new)].count("\n")  # the last line of the edit
    where = f"{tree.gpt_step.relative_to(tree.root)}:{line}"
    before = snapshot(tree.root)
    said = verdict(cli("check", tree.root), 2)
    assert f" in the patch's region ({where})" in said
    assert refused(cli("apply", "--no-verify", tree.root), 2) == f"mtp-mask-fix: error: {said}"
    assert snapshot(tree.root) == before


class TestNestedTree:
    """A source tree vendored inside another git repository, with a space in its path."""

    @pytest.fixture
    def vendored(self, tmp_path, git, source_tree):
        outer = tmp_path / "outer project"
        tree = outer / "vendor" / "Megatron Bridge"
        tree.parent.mkdir(parents=True)
        source_tree.root.rename(tree)
        git(outer, "init", "--quiet")
        git(outer, "add", "-A")
        git(outer, "commit", "--quiet", "-m", "vendor Megatron-Bridge")
        return Tree(tree, "tree")

    def test_check_apply_check(self, cli, vendored, patched_gpt_step):
        assert f"the patch applies (source and tests, {PATCH_FILE})" in verdict(cli("check", vendored.root), 0)
        assert cli("apply", "--no-verify", vendored.root).returncode == 0
        assert vendored.gpt_step.read_text() == patched_gpt_step
        assert "def test_forward_common_passes_loss_mask_to_mtp_model(" in vendored.upstream_test.read_text()
        assert "already applied" in verdict(cli("check", vendored.root), 3)


MODEL_CALL = "            output_tensor = model(**forward_args)\n"
FORWARD_ARGS = (
    "    forward_args = {\n",
    '        forward_args["packed_seq_params"] = get_packed_seq_params(packed_seq_metadata)\n',
)


def _moved_into_a_helper(text: str) -> str:
    """forward_args built by a new helper, the patch's context lines with it, away from the model call."""
    start, end = text.index(FORWARD_ARGS[0]), text.index(FORWARD_ARGS[1]) + len(FORWARD_ARGS[1])
    call = (
        "    forward_args = _forward_args(tokens, position_ids, attention_mask, labels, packed_seq_metadata, config)\n"
    )
    helper = "def _forward_args(tokens, position_ids, attention_mask, labels, packed_seq_metadata, config):\n"
    helper += text[start:end] + "    return forward_args\n\n\n"
    text = text[:start] + call + text[end:]
    return text.replace("def _forward_step_common(", helper + "def _forward_step_common(", 1)


def _a_second_model_call(text: str) -> str:
    """A new helper above, with the same forward_args block and its own model call."""
    start, end = text.index(FORWARD_ARGS[0]), text.index(FORWARD_ARGS[1]) + len(FORWARD_ARGS[1])
    helper = "def _forward_eval(model, tokens, position_ids, attention_mask, labels, packed_seq_metadata, config):\n"
    helper += text[start:end] + "    return model(**forward_args)\n\n\n"
    return text.replace("def _forward_step_common(", helper + "def _forward_step_common(", 1)


def test_a_drift_on_an_older_line_is_named_by_its_backport(cli, tmp_path):
    """On a 0.5 tree the drift is git's word on the backport's hunk (its line), not on the carried patch's."""
    root = tmp_path / "Megatron-Bridge-0.5.1"
    (root / FIXED).parent.mkdir(parents=True)
    text = release_target("0.5.1").fixed_file.read_text().replace(CONTEXT, REGION_EDIT, 1)
    (root / FIXED).write_text(text)
    (hunk,) = [hunk for f in Patch.load(REPO / BACKPORT_FILE).files if f.path == FIXED for hunk in f]
    line = verdict(cli("check", root), 4)
    assert f"drifted: {BACKPORT_FILE}: error: patch failed: {FIXED}:{hunk.source_start};" in line
    assert line.endswith(f", at {FIXED}:{text[: text.index(REGION_EDIT)].count(chr(10)) + 1} of this tree")


class TestUpstreamMovedOn:
    """Upstream renames the function, moves the hunk's lines, adds a helper: the tool agrees with itself."""

    def test_a_renamed_function_is_applied_then_already_applied(self, cli, edit, site_packages):
        edit(site_packages, site_packages.gpt_step, "def _forward_step_common(", "def _forward_step_shared(")
        assert "the patch applies" in verdict(cli("check", site_packages.root), 0)
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        assert "already applied" in verdict(cli("check", site_packages.root), 3)
        again = cli("apply", "--no-verify", site_packages.root)
        assert (again.returncode, again.stderr) == (0, "") and "already fixed" in again.stdout

    @pytest.mark.parametrize(
        ("change", "moved"),
        [
            (_moved_into_a_helper, "`forward_args = _forward_args(tokens, "),
            (_a_second_model_call, "`return model(**forward_args)` gets no loss_mask"),
        ],
        ids=["hunk moved into a helper", "a second model call"],
    )
    def test_a_hunk_away_from_the_model_call_is_refused_up_front(
        self, cli, refused, snapshot, site_packages, change, moved
    ):
        """The patch would apply, but not where the model call gets its arguments: exit 4 before any write, naming
        the line that moved."""
        site_packages.gpt_step.write_text(change(site_packages.gpt_step.read_text()))
        before = snapshot(site_packages.root)
        said = verdict(cli("check", site_packages.root), 4)
        assert moved in said
        assert refused(cli("apply", "--no-verify", site_packages.root), 4) == f"mtp-mask-fix: error: {said}"
        assert snapshot(site_packages.root) == before


OVERRIDES = [
    'forward_args["loss_mask"] = torch.ones_like(loss_mask)',
    'forward_args["loss_mask"] = None',
    "forward_args.update(loss_mask=torch.ones_like(labels))",
]


# Lines after the fix, at the model call, that change or may change the mask it receives; what check says of them.
AFTER_THE_FIX = {
    "another mask": ('forward_args["loss_mask"] = torch.ones_like(loss_mask)', "hands the model something else"),
    "del": ('del forward_args["loss_mask"]', "does what check cannot follow"),
    "pop": ('forward_args.pop("loss_mask", None)', "does what check cannot follow"),
    "a key in a variable": ("forward_args[key] = torch.ones_like(loss_mask)", "does what check cannot follow"),
}


@pytest.mark.parametrize("case", AFTER_THE_FIX)
def test_a_line_after_the_fix_that_changes_the_mask_is_not_fixed(
    cli, refused, edit, site_packages, release_gpt_step, case
):
    """check and status name that line and point to verify (exit 2), never "fixed" (exit 3); apply refuses it the same
    way; revert takes the patch out and leaves the line where it stands."""
    assert cli("apply", "--no-verify", site_packages.root).returncode == 0
    code, said = AFTER_THE_FIX[case]
    before = '            key = "loss_mask"\n' if "key" in code else ""
    edit(site_packages, site_packages.gpt_step, MODEL_CALL, f"{before}            {code}\n{MODEL_CALL}", commit=False)
    line = site_packages.gpt_step.read_text().split(MODEL_CALL)[0].count("\n")  # the line before the call
    where = f"megatron/bridge/training/gpt_step.py:{line} `{code}` {said}"
    for command in ("check", "status"):
        result = cli(command, site_packages.root)
        assert result.returncode == 2, (result.stdout, result.stderr)
        assert where in result.stdout.splitlines()[-1] and "`mtp-mask-fix verify`" in result.stdout, result.stdout
    assert where in refused(cli("apply", "--no-verify", site_packages.root), 2)
    assert cli("revert", site_packages.root).returncode == 0  # outside the hunk: that line is kept
    assert site_packages.gpt_step.read_text() == release_gpt_step.replace(
        MODEL_CALL, f"{before}            {code}\n{MODEL_CALL}"
    )


def test_a_line_after_the_fix_in_its_region_is_a_local_edit(cli, edit, site_packages):
    """Next to the fix's own line the patch no longer reverses: a local edit of the installed files, at its line."""
    assert cli("apply", "--no-verify", site_packages.root).returncode == 0
    fix = '        forward_args["loss_mask"] = loss_mask\n'
    edit(site_packages, site_packages.gpt_step, fix, fix + f"    {OVERRIDES[0]}\n", commit=False)
    line = site_packages.gpt_step.read_text().split(fix)[0].count("\n") + 2
    for command in ("check", "status"):
        result = cli(command, site_packages.root)
        assert result.returncode == 2
        assert f"local edits in the patch's region (megatron/bridge/training/gpt_step.py:{line})" in result.stdout


class TestWhyNotFixed:
    """why_not_fixed recognises the fix by what the code does, not by our exact lines; else it names the line."""

    def test_release_has_no_fix(self, release_gpt_step):
        # The release passes loss_mask only to build_schedule_plan, which does not count.
        assert "loss_mask=loss_mask" in release_gpt_step
        assert why_not_fixed(release_gpt_step)

    def test_our_patch(self, patched_gpt_step):
        assert not why_not_fixed(patched_gpt_step)

    def test_dict_entry_without_our_comment(self, release_gpt_step):
        assert not why_not_fixed(release_gpt_step.replace(LABELS, EQUIVALENT_FIX))

    def test_keyword_at_the_model_call(self, release_gpt_step):
        fixed = release_gpt_step.replace("model(**forward_args)", "model(**forward_args, loss_mask=loss_mask)")
        assert fixed != release_gpt_step
        assert not why_not_fixed(fixed)

    def test_a_copy_of_the_mask(self, release_gpt_step):
        copy = '        "loss_mask": None if loss_mask is None else loss_mask.clone(),\n    }'
        assert not why_not_fixed(release_gpt_step.replace(LABELS, LABELS.replace("    }", copy)))

    def test_item_assignment_into_forward_args(self, release_gpt_step):
        """`forward_args["loss_mask"] = loss_mask` hands the mask to the model just the same ."""
        marker = "    # Add packed sequence support\n"
        fixed = release_gpt_step.replace(marker, '    forward_args["loss_mask"] = loss_mask\n\n' + marker)
        assert not why_not_fixed(fixed)

    @pytest.mark.parametrize(
        "value", ["None", "torch.ones_like(loss_mask)", "loss_mask.roll(-1, -1)", "labels", "loss_mask[:, 1:]"]
    )
    def test_a_tensor_that_is_not_the_batchs_mask_is_not_the_fix(self, release_gpt_step, value):
        assert why_not_fixed(
            release_gpt_step.replace(LABELS, LABELS.replace("    }", f'        "loss_mask": {value},\n    }}'))
        )

    @pytest.mark.parametrize("override", OVERRIDES)
    def test_a_later_word_on_the_mask_overrides_the_fix(self, patched_gpt_step, override):
        """What the model receives is the last word on loss_mask before the call, not the first."""
        assert not why_not_fixed(patched_gpt_step)
        assert why_not_fixed(patched_gpt_step.replace(MODEL_CALL, f"            {override}\n{MODEL_CALL}"))

    def test_the_mask_as_the_last_word_after_a_none_is_the_fix(self, release_gpt_step):
        fixed = release_gpt_step.replace(LABELS, EQUIVALENT_FIX.replace(": loss_mask", ": None"))
        assert why_not_fixed(fixed)
        assert not why_not_fixed(
            fixed.replace(MODEL_CALL, f'            forward_args["loss_mask"] = loss_mask\n{MODEL_CALL}')
        )

    def test_a_file_that_does_not_parse_is_not_the_fix(self):
        assert why_not_fixed("def _forward_step_common(:\n", "gpt_step.py") == "gpt_step.py:1 does not parse"

    @pytest.mark.parametrize(
        "use",
        [
            'del forward_args["loss_mask"]',
            'forward_args.pop("loss_mask", None)',
            "forward_args[key] = torch.ones_like(loss_mask)",
            'forward_args["loss_mask"].mul_(0)',
            'forward_args["loss_mask"] += 1',
            "forward_args.update(extra)",
            'forward_args.setdefault("loss_mask", None)',
            "forward_args.clear()",
            "forward_args = dict(forward_args)",
            "_strip(forward_args)",
            "output_tensor = model(**forward_args, **extra)",
        ],
    )
    def test_a_use_after_the_fix_it_cannot_follow_is_named_not_fixed(self, patched_gpt_step, use):
        """Any other use of forward_args after the fix leaves it unshown: the line is named, never "fixed"."""
        text = patched_gpt_step.replace(MODEL_CALL, f"            {use}\n{MODEL_CALL}")
        line = text.split(MODEL_CALL)[0].count("\n")
        assert why_not_fixed(text, "gpt_step.py") == f"gpt_step.py:{line} `{use}` does what check cannot follow"

    @pytest.mark.parametrize(
        "use",
        [
            'forward_args["padding_mask"] = padding_mask',
            'if forward_args.get("padding_mask") is not None:\n                pass',
            'assert "loss_mask" in forward_args',
        ],
    )
    def test_a_use_that_leaves_the_mask_as_it_is_keeps_it_fixed(self, patched_gpt_step, use):
        """Guards the reading's reach: another key, a read and a test of the dict (upstream main's own uses)."""
        assert not why_not_fixed(patched_gpt_step.replace(MODEL_CALL, f"            {use}\n{MODEL_CALL}"))

    def test_a_model_call_given_its_arguments_by_a_caller_is_not_shown(self, patched_gpt_step):
        """A helper that calls the model with the dict it is given: what the caller put in is not read."""
        text = patched_gpt_step + "\n\ndef _call(model, forward_args):\n    return model(**forward_args)\n"
        line = text.count("\n")
        assert (
            why_not_fixed(text, "gpt_step.py")
            == f"gpt_step.py:{line} `return model(**forward_args)` does what check cannot follow"
        )


class TestStatus:
    """status: the patch's status block, then whether the target still needs the patch."""

    def test_status_before_and_after_apply(self, cli, patch, site_packages):
        before = cli("status", site_packages.root)
        assert before.returncode == 0, before.stderr
        for key, value in patch.metadata.items():
            assert f"  {key}: {value}\n" in before.stdout
        assert "the patch applies" in before.stdout.splitlines()[-1]
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        after = cli("status", site_packages.root)  # exit codes as check's: 3, retire
        assert after.returncode == 3 and "already applied" in after.stdout.splitlines()[-1]
