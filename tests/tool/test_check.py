"""`check` and `status` on each kind of target: a site-packages dir, a plain source tree, a git checkout; and what
counts as the fix, whoever wrote it."""

import os
import re
import sys

import pytest

from mtp_mask_fix.check import fix_present
from tests.support.targets import (
    CONTEXT,
    EQUIVALENT_FIX,
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
        assert f"already applied (source hunks only, {PATCH_FILE})" in verdict(cli("check", checkout.root), 3)
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
OVERRIDES = [
    'forward_args["loss_mask"] = torch.ones_like(loss_mask)',
    'forward_args["loss_mask"] = None',
    "forward_args.update(loss_mask=torch.ones_like(labels))",
]


@pytest.mark.parametrize("where", ["after the fix's line", "at the model call"])
def test_a_patched_target_whose_mask_is_overridden_is_not_fixed(cli, edit, site_packages, release_gpt_step, where):
    """apply, then a line that hands the model another mask: check and status refuse it as a local edit (exit 2),
    never fixed (exit 3); revert takes the patch out and leaves that line where it stands."""
    assert cli("apply", "--no-verify", site_packages.root).returncode == 0
    fix, override = '        forward_args["loss_mask"] = loss_mask\n', f"    {OVERRIDES[0]}\n"
    old = fix if where == "after the fix's line" else MODEL_CALL
    new = fix + override if old == fix else f"        {override}{old}"
    edit(site_packages, site_packages.gpt_step, old, new, commit=False)
    text = site_packages.gpt_step.read_text()
    line = text[: text.index(new) + len(new)].count("\n") - (old == MODEL_CALL)  # the override's
    said = {
        "after the fix's line": f"local edits in the patch's region (megatron/bridge/training/gpt_step.py:{line})",
        "at the model call": "but a later line hands the model another loss_mask",
    }[where]
    for command in ("check", "status"):
        result = cli(command, site_packages.root)
        assert result.returncode == 2 and said in result.stdout.splitlines()[-1], result.stdout
    if where == "at the model call":  # outside the hunk: revert gives the bytes before the patch, that line kept
        assert cli("revert", site_packages.root).returncode == 0
        assert site_packages.gpt_step.read_text() == release_gpt_step.replace(old, new)


class TestFixPresent:
    """fix_present recognises the fix by what the code does, not by our exact lines."""

    def test_release_has_no_fix(self, release_gpt_step):
        # The release passes loss_mask only to build_schedule_plan, which does not count.
        assert "loss_mask=loss_mask" in release_gpt_step
        assert not fix_present(release_gpt_step)

    def test_our_patch(self, patched_gpt_step):
        assert fix_present(patched_gpt_step)

    def test_dict_entry_without_our_comment(self, release_gpt_step):
        assert fix_present(release_gpt_step.replace(LABELS, EQUIVALENT_FIX))

    def test_keyword_at_the_model_call(self, release_gpt_step):
        fixed = release_gpt_step.replace("model(**forward_args)", "model(**forward_args, loss_mask=loss_mask)")
        assert fixed != release_gpt_step
        assert fix_present(fixed)

    def test_a_copy_of_the_mask(self, release_gpt_step):
        copy = '        "loss_mask": None if loss_mask is None else loss_mask.clone(),\n    }'
        assert fix_present(release_gpt_step.replace(LABELS, LABELS.replace("    }", copy)))

    def test_item_assignment_into_forward_args(self, release_gpt_step):
        """`forward_args["loss_mask"] = loss_mask` hands the mask to the model just the same ."""
        marker = "    # Add packed sequence support\n"
        fixed = release_gpt_step.replace(marker, '    forward_args["loss_mask"] = loss_mask\n\n' + marker)
        assert fix_present(fixed)

    @pytest.mark.parametrize(
        "value", ["None", "torch.ones_like(loss_mask)", "loss_mask.roll(-1, -1)", "labels", "loss_mask[:, 1:]"]
    )
    def test_a_tensor_that_is_not_the_batchs_mask_is_not_the_fix(self, release_gpt_step, value):
        assert not fix_present(
            release_gpt_step.replace(LABELS, LABELS.replace("    }", f'        "loss_mask": {value},\n    }}'))
        )

    @pytest.mark.parametrize("override", OVERRIDES)
    def test_a_later_word_on_the_mask_overrides_the_fix(self, patched_gpt_step, override):
        """What the model receives is the last word on loss_mask before the call, not the first."""
        assert fix_present(patched_gpt_step)
        assert not fix_present(patched_gpt_step.replace(MODEL_CALL, f"            {override}\n{MODEL_CALL}"))

    def test_the_mask_as_the_last_word_after_a_none_is_the_fix(self, release_gpt_step):
        fixed = release_gpt_step.replace(LABELS, EQUIVALENT_FIX.replace(": loss_mask", ": None"))
        assert not fix_present(fixed)
        assert fix_present(
            fixed.replace(MODEL_CALL, f'            forward_args["loss_mask"] = loss_mask\n{MODEL_CALL}')
        )

    def test_a_file_that_does_not_parse_is_not_the_fix(self):
        assert not fix_present("def _forward_step_common(:\n")


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
