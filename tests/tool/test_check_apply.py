"""`check` and `apply` on each kind of target: a site-packages dir, a plain source tree, a git checkout."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from unidiff import PatchSet

from mtp_mask_fix.check import fix_present
from mtp_mask_fix.paths import GPT_STEP, REPO, WORK
from mtp_mask_fix.targets import release as release_target
from mtp_mask_fix.trees import materialise

from .conftest import FIXED, PINNED, SUBMITTER, UPSTREAM_TEST, Tree, digests


PATCH_FILE = "patches/0001-fix-training-pass-loss_mask-to-the-model-in-gpt_step.patch"
BACKPORT_FILE = "patches/0.2-0.5/0001-fix-training-pass-loss_mask-to-the-model-in-gpt_step.patch"


CONTEXT = '        "attention_mask": attention_mask,\n'  # a context line of the source hunk
REGION_EDIT = '        "attention_mask": attention_mask,  # local tweak\n'
LABELS = '        "labels": labels,\n    }\n'
EQUIVALENT_FIX = '        "labels": labels,\n        "loss_mask": loss_mask,\n    }\n'
FAR_FROM_HUNK = "import logging\n"  # line 15; the hunk sits at ~436


def verdict(result: subprocess.CompletedProcess, code: int) -> str:
    """`check` prints its verdict as one line on stdout, nothing on stderr, and exits with the state's code."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return lines[0]


def changed_lines(patch_set: PatchSet) -> dict[str, list[tuple[str, str]]]:
    """Per file: the added and removed lines, in order (line numbers and blob ids left aside)."""
    return {
        f.path: [(line.line_type, line.value) for hunk in f for line in hunk if line.is_added or line.is_removed]
        for f in patch_set
    }


def hunk_parts(patch, *, src_only: bool) -> dict[str, list[tuple[str, str]]]:
    return {
        path: lines for path, lines in changed_lines(patch.files).items() if path.startswith("src/") or not src_only
    }


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

    def test_equivalent_upstream_fix_says_retire(self, cli, edit, target):
        edit(target, target.gpt_step, LABELS, EQUIVALENT_FIX)
        line = verdict(cli("check", target.root), 3)
        assert "equivalent fix" in line and "retire the patch" in line

    def test_drifted_context_names_the_file(self, cli, edit, snapshot, target):
        edit(target, target.gpt_step, CONTEXT, '        "attention_mask": attention_mask if use_mask else None,\n')
        before = snapshot(target.root)
        line = verdict(cli("check", target.root), 4)
        assert snapshot(target.root) == before
        assert "drifted" in line
        assert re.search(r"patch failed: (src/)?megatron/bridge/training/gpt_step\.py:\d+", line)

    def test_drifted_upstream_test_only(self, cli, edit, checkout):
        """The source hunk still fits, but upstream's test moved on: drifted, and the message names the test file."""
        edit(checkout, checkout.upstream_test, "_flops_seqlen_sum == 0\n", "_flops_seqlen_sum == 0  # moved on\n")
        line = verdict(cli("check", checkout.root), 4)
        assert "drifted" in line and UPSTREAM_TEST in line

    @pytest.mark.parametrize("version", ["0.6.0", "0.6.1", "0.6.2"])  # the 0.6 series (0.6.1 is yanked on PyPI)
    def test_06_releases_apply(self, cli, version):
        line = verdict(cli("check", version), 0)
        assert line.startswith(f"megatron-bridge=={version} (PyPI): the patch applies (source hunks only")

    def test_default_target_is_what_the_interpreter_imports(self, cli, tool_env, site_packages):
        path = os.pathsep.join(filter(None, [str(site_packages.root), tool_env.get("PYTHONPATH")]))
        line = verdict(cli("check", env=dict(tool_env, PYTHONPATH=path)), 0)
        assert line.startswith(f"{site_packages.root}: the patch applies")

    def test_no_target_and_no_megatron_bridge_is_refused(self, cli, refused):
        refused(cli("check"), 2, "imports no megatron.bridge", sys.executable)


class TestEntryPoints:
    """`mtp-mask-fix` (console script) and `python -m mtp_mask_fix` are the same tool."""

    def test_console_script_matches_module(self, cli, tool_env, tmp_path, site_packages):
        script = Path(sys.executable).parent / "mtp-mask-fix"
        result = subprocess.run(
            [str(script), "check", str(site_packages.root)], cwd=tmp_path, env=tool_env, capture_output=True, text=True
        )
        assert (result.returncode, result.stdout, result.stderr) == (0, cli("check", site_packages.root).stdout, "")

    def test_the_tool_imports_neither_torch_nor_pytest(self, tool_env):
        """In a training container the tool runs with git and unidiff alone: only repro/effect import torch."""
        code = "import sys, mtp_mask_fix.cli; print(sorted({'torch', 'pytest', 'megatron'} & set(sys.modules)))"
        result = subprocess.run([sys.executable, "-c", code], env=tool_env, capture_output=True, text=True)
        assert result.stdout == "[]\n", result.stderr

    def test_help(self, cli):
        result = cli("--help")
        assert result.returncode == 0
        listed = re.findall(r"^    (\w+)\s+\S", result.stdout, re.M)  # argparse's one line per command
        assert listed == ["check", "apply", "verify", "gate", "pr", "status"]


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

    def test_other_values_are_not_the_fix(self, release_gpt_step):
        assert not fix_present(
            release_gpt_step.replace(LABELS, LABELS.replace("    }", '        "loss_mask": None,\n    }'))
        )
        assert not fix_present("def _forward_step_common(:\n")


class TestApplyGitCheckout:
    """apply on a git checkout changes the working tree only, by exactly the patch."""

    def test_working_tree_gets_exactly_the_patch(self, cli, git, checkout, patch):
        head = git(checkout.root, "rev-parse", "HEAD")
        result = cli("apply", "--no-verify", checkout.root)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"{checkout.root}: applied (source and tests, {PATCH_FILE})"
        assert git(checkout.root, "rev-parse", "HEAD") == head  # nothing committed
        assert git(checkout.root, "status", "--porcelain") == f" M {FIXED}\n M {UPSTREAM_TEST}\n"
        assert changed_lines(PatchSet(git(checkout.root, "diff"))) == hunk_parts(patch, src_only=False)

    def test_local_change_elsewhere_in_the_file_does_not_block(self, cli, edit, checkout, patched_gpt_step):
        edit(checkout, checkout.gpt_step, FAR_FROM_HUNK, "import logging  # local note\n", commit=False)
        result = cli("apply", "--no-verify", checkout.root)
        assert result.returncode == 0, result.stderr
        expected = patched_gpt_step.replace(FAR_FROM_HUNK, "import logging  # local note\n", 1)
        assert checkout.gpt_step.read_text() == expected

    def test_local_change_in_the_region_blocks(self, cli, edit, refused, snapshot, checkout):
        edit(checkout, checkout.gpt_step, CONTEXT, REGION_EDIT, commit=False)
        before = snapshot(checkout.root)
        line = refused(cli("apply", "--no-verify", checkout.root), 2, "local changes")
        assert "commit or stash" in line
        assert snapshot(checkout.root) == before
        # check says the same, as a verdict
        assert "local changes in the patch's region" in verdict(cli("check", checkout.root), 2)

    def test_again_when_already_fixed_changes_nothing_and_exits_0(self, cli, snapshot, checkout):
        assert cli("apply", "--no-verify", checkout.root).returncode == 0
        before = snapshot(checkout.root)
        result = cli("apply", "--no-verify", checkout.root)
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout == f"{checkout.root}: already fixed ({PATCH_FILE}); nothing changed\n"
        assert snapshot(checkout.root) == before

    def test_again_when_already_fixed_still_verifies(self, cli, refused, snapshot, tmp_path, probe_ok, checkout):
        """`apply || exit 1` at start-up: exit 0 means verified, also when there was nothing to write."""
        assert cli("apply", "--no-verify", checkout.root).returncode == 0
        before = snapshot(checkout.root)
        python = fake_python(tmp_path, "python-without-torch", "echo 'No module named torch' >&2; exit 1")
        refused(cli("apply", "--python", python, checkout.root), 5, "already fixed", f"not verified with {python}")
        result = cli("apply", "--python", probe_ok(checkout.root / "src"), checkout.root)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"{checkout.root}: already fixed ({PATCH_FILE}); nothing changed; verified")
        assert snapshot(checkout.root) == before

    def test_refuses_when_drifted(self, cli, edit, refused, snapshot, checkout):
        edit(checkout, checkout.gpt_step, CONTEXT, REGION_EDIT)  # committed: upstream moved on
        before = snapshot(checkout.root)
        line = refused(cli("apply", "--no-verify", checkout.root), 4, "drifted")
        assert "gpt_step.py" in line
        assert snapshot(checkout.root) == before


class TestApplyBranch:
    """`./run branch CHECKOUT NAME` (maintain/branch.py): one signed-off commit by the configured user on a new
    branch."""

    @pytest.fixture
    def submitter(self, git, checkout):
        git(checkout.root, "config", "user.name", SUBMITTER[0])
        git(checkout.root, "config", "user.email", SUBMITTER[1])
        return f"{SUBMITTER[0]} <{SUBMITTER[1]}>"

    def test_branch_holds_one_signed_off_commit(self, branch, git, checkout, patch, submitter):
        main = git(checkout.root, "rev-parse", "main").strip()
        result = branch(checkout.root, "fix-6103")
        assert result.returncode == 0, result.stderr
        assert "branch fix-6103 holds the fix" in result.stdout

        assert git(checkout.root, "rev-parse", "main").strip() == main  # original branch untouched
        assert git(checkout.root, "branch", "--show-current").strip() == "fix-6103"
        assert git(checkout.root, "rev-list", "main..fix-6103").count("\n") == 1
        assert git(checkout.root, "rev-parse", "fix-6103~1").strip() == main
        assert git(checkout.root, "status", "--porcelain") == ""

        message = git(checkout.root, "log", "-1", "--format=%B", "fix-6103")
        assert message == f"{patch.subject}\n\n{patch.body}\n\nSigned-off-by: {submitter}\n\n"
        assert git(checkout.root, "log", "-1", "--format=%an <%ae>|%cn <%ce>", "fix-6103").strip() == (
            f"{submitter}|{submitter}"
        )
        committed = PatchSet(git(checkout.root, "diff", "main", "fix-6103"))
        assert changed_lines(committed) == hunk_parts(patch, src_only=False)

    def test_unstaged_change_elsewhere_in_a_touched_file(self, branch, git, edit, refused, checkout, submitter):
        """`git am` needs touched files to match the index: a clean one-line refusal, nothing left behind."""
        edit(checkout, checkout.gpt_step, FAR_FROM_HUNK, "import logging  # local note\n", commit=False)
        branches = git(checkout.root, "branch")
        refused(branch(checkout.root, "fix-6103"), 2, "uncommitted changes")
        assert git(checkout.root, "branch") == branches
        assert git(checkout.root, "status", "--porcelain") == f" M {FIXED}\n"
        assert "# local note" in checkout.gpt_step.read_text()

    def test_detached_head_is_restored_after_a_failed_am(self, branch, git, refused, checkout, submitter):
        """From a detached HEAD, a failing `git am` (its pre-applypatch hook refuses) leaves HEAD where it was."""
        git(checkout.root, "switch", "--quiet", "--detach", "main")
        hook = checkout.root / ".git" / "hooks" / "pre-applypatch"
        hook.write_text("#!/bin/sh\nexit 1\n")
        hook.chmod(0o755)
        head = git(checkout.root, "rev-parse", "HEAD")
        refused(branch(checkout.root, "fix-6103"), 5, "git am failed")
        assert git(checkout.root, "branch", "--list", "fix-6103") == ""
        assert git(checkout.root, "branch", "--show-current") == ""  # still detached
        assert git(checkout.root, "rev-parse", "HEAD") == head
        assert git(checkout.root, "status", "--porcelain") == ""

    def test_failing_commit_hook(self, branch, git, refused, checkout, submitter):
        """A failing pre-commit hook (e.g. upstream's, with pre-commit not installed) must not half-finish the
        branch: either the commit is made (hooks skipped) or the refusal is one line and clean.
        """
        hook = checkout.root / ".git" / "hooks" / "pre-commit"
        hook.write_text("#!/bin/sh\necho 'pre-commit: command not found' >&2\nexit 1\n")
        hook.chmod(0o755)
        result = branch(checkout.root, "fix-6103")
        if result.returncode == 0:
            assert git(checkout.root, "log", "-1", "--format=%an <%ae>", "fix-6103").strip() == submitter
        else:
            refused(result, result.returncode)
            assert git(checkout.root, "branch", "--list", "fix-6103") == ""
            assert git(checkout.root, "branch", "--show-current") == "main\n"

    def test_branch_refused_when_it_exists(self, branch, git, refused, snapshot, checkout, submitter):
        git(checkout.root, "branch", "fix-6103")
        before = snapshot(checkout.root)
        refused(branch(checkout.root, "fix-6103"), 2, "already exists")
        assert snapshot(checkout.root) == before

    @pytest.mark.parametrize("existing, wanted", [("fix", "fix/mtp-mask"), ("fix/mtp-mask", "fix")])
    def test_branch_whose_name_clashes_with_a_branch(
        self, branch, git, refused, checkout, submitter, existing, wanted
    ):
        """git stores `fix` and `fix/x` as a file and a folder: one cannot be made beside the other. Refused with the
        checkout as it was: on its branch, nothing staged, no new branch."""
        git(checkout.root, "branch", existing)
        branches = git(checkout.root, "branch")
        refused(branch(checkout.root, wanted), 2, "nothing changed")
        assert git(checkout.root, "branch") == branches
        assert git(checkout.root, "status", "--porcelain") == ""

    def test_branch_when_already_fixed_exits_0_and_makes_none(self, branch, git, checkout, submitter):
        assert branch(checkout.root, "fix-6103").returncode == 0
        result = branch(checkout.root, "again")
        assert (result.returncode, result.stderr) == (0, "")
        assert "already fixed" in result.stdout and "no branch made" in result.stdout
        assert "again" not in git(checkout.root, "branch")


class TestApplySitePackages:
    """apply on an installed package: the source hunk only, verified by behaviour (the probe imports the tree)."""

    def test_failed_verification_rolls_back(self, cli, tmp_path, refused, snapshot, site_packages):
        """An interpreter whose probe finds no loss_mask: exit 5, and the file is put back."""
        fake_python = tmp_path / "fake-python"
        fake_python.write_text(
            '#!/bin/sh\necho \'{"file": "x", "delivered": false, "reason": "no loss_mask reached the model"}\'\n'
        )
        fake_python.chmod(0o755)
        before = snapshot(site_packages.root)
        refused(cli("apply", "--python", fake_python, site_packages.root), 5, "rolled back")
        assert snapshot(site_packages.root) == before

    def test_source_hunk_only(self, cli, site_packages, patched_gpt_step):
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        assert site_packages.gpt_step.read_text() == patched_gpt_step
        assert not (site_packages.root / "tests").exists()


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


# name: (gpt_step.py edit, apply this patch first); one copy of the release each. The probe's judgement of fixes
# written otherwise (#6105's, labels as the mask, ...) is pinned per variant in tests/test_wrong_fixes.py, whose
# sessions run it warm; here, the real CLI end to end.
VERIFY_CASES = {
    "unpatched": (None, False),
    "patched": (None, True),
}


def _verify_cases() -> dict:
    """`verify` (or, for "patched", `apply`, which verifies) on each case's site-packages, all at once: each run imports a whole Megatron-Bridge in a fresh
    interpreter. A case's site-packages is the release with its own gpt_step.py (and the directories above it); every
    other directory links to the release's, bytecode cache included (trees.materialise), so no run recompiles it.

    Returns (the site-packages, the verify or apply result, the check result, digests before, after) per case."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    release = release_target(PINNED)
    shutil.rmtree(WORK / "verify-cases", ignore_errors=True)

    def run(name):
        edit, apply = VERIFY_CASES[name]
        text = (release.root / GPT_STEP).read_text()
        root = materialise(
            release.root,
            WORK / "verify-cases" / str(list(VERIFY_CASES).index(name)),
            rewrite={GPT_STEP: text.replace(*edit) if edit else text},
        )
        tool = [sys.executable, "-m", "mtp_mask_fix"]
        before = digests(root)
        # apply verifies by behaviour itself: after it, the probe of `verify` would only repeat it
        commands = (
            [["apply", str(root)], ["check", str(root)]] if apply else [["verify", str(root)], ["check", str(root)]]
        )
        done = [subprocess.run([*tool, *command], env=env, capture_output=True, text=True) for command in commands]
        return root, *done, before, digests(root)

    with ThreadPoolExecutor(len(VERIFY_CASES)) as pool:
        return dict(zip(VERIFY_CASES, pool.map(run, VERIFY_CASES)))


EARLY = {}


def start_early(pool) -> None:
    """The probes need nothing else of the session: tests/conftest.py starts them once the suite is collected."""
    EARLY["verified"] = pool.submit(_verify_cases)


@pytest.fixture(scope="module")
def verified():
    return EARLY["verified"].result() if "verified" in EARLY else _verify_cases()


class TestVerify:
    """verify judges by behaviour: the probe runs the target's own forward_step under the training interpreter."""

    def test_unpatched_fails(self, verified, refused):
        refused(
            verified["unpatched"][1], 5, f"not verified with {sys.executable}", "received no loss_mask with MTP on"
        )

    def test_apply_verifies_by_behaviour_and_changes_only_gpt_step(self, verified, patched_gpt_step):
        """On an installed package: the source hunk only, verified by the probe under the training interpreter."""
        root, result, _, before, after = verified["patched"]
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout == (
            f"{root}: applied (source hunks only, {PATCH_FILE}); verified with {sys.executable}: "
            "the model receives the batch's loss_mask with MTP on\n"
        )
        assert {path for path in after if before.get(path) != after[path]} == {str(root / GPT_STEP)}
        assert set(after) == set(before)  # no tests/, no journal, no stray files
        assert (root / GPT_STEP).read_text() == patched_gpt_step

    def test_an_equivalent_fix_that_is_not_this_patch_says_retire(self, cli, tmp_path):
        """#6105's unconditional entry on the release: `check` (no probe) says retire; that `verify` passes it, and
        fails labels as the mask, is pinned in tests/test_wrong_fixes.py (TestVerifyProbeVerdict)."""
        release = release_target(PINNED)
        text = (release.root / GPT_STEP).read_text()
        assert LABELS in text
        root = materialise(
            release.root, tmp_path / "site-packages", rewrite={GPT_STEP: text.replace(LABELS, EQUIVALENT_FIX)}
        )
        assert verdict(cli("check", root), 3).endswith(
            "an equivalent fix: gpt_step passes loss_mask to the model; retire the patch"
        )

    def test_an_interpreter_that_cannot_import_it(self, cli, refused, tmp_path, site_packages):
        python = tmp_path / "python-without-torch"
        python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
        python.chmod(0o755)
        line = refused(cli("verify", "--python", python, site_packages.root), 5, "No module named 'torch'")
        assert "pass --python" in line


# Every PyPI release since MTP arrived (0.6.1 is yanked but still downloadable), and the file that fixes it.
RELEASES = {version: BACKPORT_FILE for version in ("0.3.0", "0.3.1", "0.4.0", "0.4.1", "0.4.2", "0.5.0", "0.5.1")}
RELEASES |= {version: PATCH_FILE for version in ("0.6.0", "0.6.1", "0.6.2")}


class TestReleaseLines:
    """Every release line with the bug: check picks the patch file that fits it (README's table), apply works."""

    @pytest.mark.parametrize("version", RELEASES)
    def test_check_names_the_file_that_applies(self, cli, version):
        line = verdict(cli("check", version), 0)
        assert line == (
            f"megatron-bridge=={version} (PyPI): the patch applies (source hunks only, {RELEASES[version]}); "
            "the bug is present"
        )

    @pytest.mark.parametrize("version", RELEASES)
    def test_status_says_the_release_still_needs_the_patch(self, cli, version):
        result = cli("status", version)
        assert result.stdout.splitlines()[-1] == (
            f"  on megatron-bridge=={version} (PyPI): the patch applies (source hunks only, {RELEASES[version]}); "
            "the bug is present"
        ), result.stderr

    def test_pinned_release_is_one_of_them(self):
        assert PINNED in RELEASES

    @pytest.mark.parametrize("version", ["0.3.0", "0.5.1"])
    def test_apply_then_again_on_an_older_line(self, cli, tmp_path, release_root, version):
        copy = tmp_path / "site-packages"
        shutil.copytree(release_root(version) / "megatron", copy / "megatron")
        result = cli("apply", "--no-verify", copy)
        assert result.stdout == f"{copy}: applied (source hunks only, {BACKPORT_FILE})\n", result.stderr
        assert fix_present((copy / FIXED.removeprefix("src/")).read_text())
        assert "already applied" in verdict(cli("check", copy), 3)
        assert cli("apply", "--no-verify", copy).returncode == 0

    def test_readme_names_each_file(self, repo_file):
        readme = repo_file("README.md").decode()
        for name in set(RELEASES.values()):
            assert f"`{name}`" in readme


@pytest.fixture
def release_root():
    from mtp_mask_fix.targets import release

    return lambda version: release(version).root


class TestBackport:
    """The backport is derived from the carried patch, never edited: a drift guard."""

    def test_committed_backport_equals_its_derivation(self, patch, repo_file):
        from maintain import refresh

        for line in refresh.LINES:
            committed = refresh.path(line, patch).read_text()
            assert committed == refresh.derive_for(line, patch), f"run `./run refresh --backports` ({line})"

    def test_same_added_lines_as_the_carried_patch(self, patch):
        from maintain import refresh
        from mtp_mask_fix.patch import Patch

        for path in (refresh.path(line, patch) for line in refresh.LINES):
            assert hunk_parts(Patch.load(path), src_only=True) == hunk_parts(patch, src_only=True)


def fake_python(tmp_path: Path, name: str, body: str) -> Path:
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


@pytest.fixture
def probe_ok(tmp_path):
    """An interpreter whose probe finds the fix at once (the behaviour probe itself is tested in TestVerify)."""

    def make(root: Path) -> Path:
        found = f'{{"file": "{root}/megatron/bridge/training/gpt_step.py", "delivered": true, "reason": "fake probe"}}'
        return fake_python(tmp_path, "python-ok", f"echo '{found}'")

    return make


def start_paused(tool_env, tmp_path, phase, *args):
    """Start `apply ARGS` and wait until it pauses at `phase` (tests/support/paused_apply.py); returns the process."""
    marker = tmp_path / f"paused-{phase}"
    env = dict(tool_env, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), tool_env.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.paused_apply", phase, str(marker), "apply", *map(str, args)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for _ in range(600):
        if marker.exists() or proc.poll() is not None:
            break
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()
    return proc


ROLLED_BACK = {"checked": "nothing changed", "journaled": "rolled back", "replaced": "rolled back"}
ROLLED_BACK |= {"verifying": "rolled back", "verified": "rolled back"}
INT, TERM, HUP = signal.SIGINT, signal.SIGTERM, signal.SIGHUP
# Each phase once, each signal at several phases, all three where the files are patched but not yet verified.
SIGNAL_CASES = [("checked", INT), ("journaled", TERM), ("replaced", INT), ("replaced", TERM), ("replaced", HUP)]
SIGNAL_CASES += [("verifying", TERM), ("verified", HUP), ("done", INT), ("done", TERM)]


class TestSignals:
    """SIGINT, SIGTERM, SIGHUP at each phase of apply: bytes as before (or patched and verified once it has
    finished), one line saying which, exit 128+n, no journal left."""

    @pytest.mark.parametrize(("phase", "signum"), SIGNAL_CASES, ids=[f"{p}-{s.name}" for p, s in SIGNAL_CASES])
    def test_signal_at_each_phase(self, tool_env, tmp_path, snapshot, probe_ok, site_packages, phase, signum):
        before = snapshot(site_packages.root)
        if phase == "verifying":  # the probe is running: an interpreter that says so, then takes its time
            python = fake_python(tmp_path, "python-slow", f"touch {tmp_path}/paused-verifying; exec sleep 60")
            proc = start_paused(tool_env, tmp_path, "verifying", "--python", python, site_packages.root)
        else:
            proc = start_paused(
                tool_env, tmp_path, phase, "--python", probe_ok(site_packages.root), site_packages.root
            )
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signum, (out, err)
        assert out == "" and len(err.splitlines()) == 1 and f"interrupted by {signum.name}" in err
        after = snapshot(site_packages.root)
        if phase == "done":
            assert "the apply had finished: patched and verified" in err
            assert {p for p in after if before.get(p) != after[p]} == {str(site_packages.gpt_step)}
        else:
            assert ROLLED_BACK[phase] in err
            assert after == before


class TestKilled:
    """kill -9 mid-apply: the journal makes the next check and verify tell the truth, and the next apply recovers."""

    @pytest.mark.parametrize(("phase", "state"), [("journaled", "as before"), ("replaced", "patched, not verified")])
    def test_check_verify_then_apply(self, cli, tool_env, tmp_path, refused, snapshot, site_packages, phase, state):
        before = snapshot(site_packages.root)
        proc = start_paused(tool_env, tmp_path, phase, "--no-verify", site_packages.root)
        proc.kill()
        proc.communicate()
        line = verdict(cli("check", site_packages.root), 5)
        assert "an interrupted apply left .mtp-mask-fix-journal.json" in line
        assert f"megatron/bridge/training/gpt_step.py {state}" in line
        refused(cli("verify", site_packages.root), 5, "an interrupted apply left")
        result = cli("apply", "--no-verify", site_packages.root)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"{site_packages.root}: restored the files an interrupted apply left")
        assert "already applied" in verdict(cli("check", site_packages.root), 3)
        assert {p for p in snapshot(site_packages.root) if before.get(p) != snapshot(site_packages.root)[p]} == {
            str(site_packages.gpt_step)
        }


def _python312() -> str | None:
    """A Python 3.12 (what training containers run), on PATH or under pyenv."""
    candidates = [
        shutil.which("python3.12"),
        *sorted(map(str, Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))),
    ]
    for python in filter(None, candidates):
        if subprocess.run([python, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"]).returncode == 0:
            return python
    return None


@pytest.fixture(scope="session")
def installed_tool():
    """A Python 3.12 venv (cached in .work/py312-tool) with this checkout pip-installed, not editable, and the pinned
    release's wheel installed --no-deps (no torch: the tool needs none to check and apply). Reinstalled each session."""
    from mtp_mask_fix.paths import REPO, WORK

    python = _python312()
    if python is None:
        pytest.skip("no Python 3.12 here")
    venv = WORK / "py312-tool"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check", "install"]
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "setuptools>=64", "unidiff>=0.7"], check=True, capture_output=True)
    subprocess.run(
        [*pip, "--no-deps", "--no-build-isolation", "--force-reinstall", str(REPO)],
        check=True,
        capture_output=True,
        cwd=venv,
    )
    subprocess.run(
        [*pip, "--no-deps", "--force-reinstall", f"megatron-bridge=={PINNED}"], check=True, capture_output=True
    )
    return venv


@pytest.fixture
def run_installed(installed_tool, tmp_path):
    """Run the installed `mtp-mask-fix ARGS` from tmp_path, with no PYTHONPATH but `pythonpath` and a HOME of its own
    (no downloads or caches of ours)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"HOME": str(tmp_path)}

    def run(*args, pythonpath=None) -> subprocess.CompletedProcess:
        more = {"PYTHONPATH": pythonpath} if pythonpath is not None else {}
        tool = [str(installed_tool / "bin" / "mtp-mask-fix"), *args]
        return subprocess.run(tool, cwd=tmp_path, env=env | more, capture_output=True, text=True)

    return run


class TestInstalledTool:
    """In a training environment: pip-installed (not editable), run from anywhere, no TARGET."""

    def test_apply_with_no_arguments_then_again(self, installed_tool, run_installed, tmp_path, refused, snapshot):
        python, run = str(installed_tool / "bin" / "python"), run_installed
        site = Path(
            subprocess.run(
                [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        assert verdict(run("check"), 0).startswith(f"{site}: the patch applies (source hunks only, {PATCH_FILE})")
        shadow = tmp_path / "megatron" / "bridge" / "training"  # where the command is run is not what trains
        shadow.mkdir(parents=True)
        (shadow.parent / "__init__.py").write_text("")
        (shadow / "gpt_step.py").write_bytes((site / "megatron/bridge/training/gpt_step.py").read_bytes())
        assert verdict(run("check"), 0).startswith(f"{site}: the patch applies")
        # an empty entry (`ENV PYTHONPATH=$PYTHONPATH:/x`), which Python reads as the cwd
        assert verdict(run("check", pythonpath=":/nowhere"), 0).startswith(f"{site}: the patch applies")
        # named: what trains imports it, wherever it runs
        assert verdict(run("check", pythonpath=str(tmp_path)), 0).startswith(f"{tmp_path}: the patch applies")
        status = run("status")  # on what this interpreter imports, as check
        assert status.returncode == 0 and status.stdout.splitlines()[-1].startswith(f"  on {site}: the patch applies")
        before = snapshot(site / "megatron")
        # verify needs torch and megatron-core in that interpreter: without them apply rolls back, never exit 0
        refused(run("apply"), 5, "rolled back", python, "No module named 'torch'")
        assert snapshot(site / "megatron") == before
        done = run("apply", "--no-verify")
        assert (done.returncode, done.stdout, done.stderr) == (
            0,
            f"{site}: applied (source hunks only, {PATCH_FILE})\n",
            "",
        )
        patched = snapshot(site / "megatron")
        again = run("apply", "--no-verify")
        assert (again.returncode, again.stderr) == (0, "") and "already fixed" in again.stdout
        assert snapshot(site / "megatron") == patched
        assert "already applied" in verdict(run("check"), 3)
        assert "already applied" in run("status").stdout.splitlines()[-1]
        refused(run("verify"), 5, f"not verified with {python}", "No module named 'torch'")
        assert not (site / ".work").exists() and not list(tmp_path.glob(".cache/mtp-mask-fix/pypi/*"))

    def test_gate_and_pr_say_what_they_need(self, run_installed, tmp_path, refused, checkout):
        """gate runs this repo's tests on a release (a clone has them) and pytest on a checkout; pr names gate as an
        installed tool spells it."""
        run = run_installed
        refused(run("gate"), 2, "a clone of this repo", "./run gate", "--checkouts-only")
        refused(run("gate", "--release", "0.6.0"), 2, "a clone of this repo")
        refused(run("gate", "--checkouts-only", "--checkout", str(tmp_path)), 2, "not a Megatron-Bridge tree")
        refused(run("gate", "--checkouts-only", "--checkout", str(checkout.root)), 2, "pytest", "pip install pytest")
        refused(run("pr", "--co-author", "A <a@b.c>"), 5, "run `mtp-mask-fix gate --checkout")
        assert not list(tmp_path.glob(".cache/mtp-mask-fix/pypi/*"))


class TestReleaseEnvironments:
    """Each release's tests run with the megatron-core its submodule pins and the transformers its wheel declares."""

    def test_pinned_release_uses_this_environment(self):
        from tests.support.envs import spec

        assert spec(PINNED)[0] == ""

    @pytest.mark.parametrize(
        ("version", "key"),
        [
            ("0.3.0", "core0.16.0-transformers-lt5.0.0"),
            ("0.4.2", "core0.17.1-transformers-le5.3.0-ge5.0.0"),
            ("0.5.1", "core0.18.2-transformers-lt5.9.0-ge5.8.1"),
        ],
    )
    def test_older_lines_get_their_own(self, version, key):
        from tests.support.envs import spec

        assert spec(version)[0] == key

    @pytest.fixture
    def upstream_checkout(self, git, tmp_path, monkeypatch):
        """A scratch Megatron-Bridge checkout: (bridge, its submodule, the pinned commit); .work/src in tmp_path."""
        import tests.support.envs

        monkeypatch.setattr(tests.support.envs, "WORK", tmp_path / "work")
        lm, bridge = tmp_path / "lm", tmp_path / "bridge"
        (lm / "megatron" / "core").mkdir(parents=True)
        (lm / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 20\nPATCH = 0\n")
        git(lm, "init", "-q")
        git(lm, "add", ".")
        git(lm, "commit", "-q", "-m", "core")
        bridge.mkdir()
        (bridge / "pyproject.toml").write_text(
            '[project]\ndependencies = ["transformers[torch]>=5.8,<=5.12.1", "datasets ; python_version>\'3\'"]\n'
        )
        git(bridge, "init", "-q")
        git(bridge, "-c", "protocol.file.allow=always", "submodule", "-q", "add", str(lm), "3rdparty/Megatron-LM")
        git(bridge, "add", ".")
        git(bridge, "commit", "-q", "-m", "bridge")
        return bridge, (bridge / "3rdparty" / "Megatron-LM").resolve(), git(lm, "rev-parse", "HEAD").strip()

    def test_an_upstream_checkout_gets_its_submodules_core(self, upstream_checkout, tmp_path):
        """Upstream main's megatron-core is on no package index: `./run python DIR` builds it from the commit DIR
        pins, unpacked from git (not the submodule's working tree, where pip would build in place), and keeps the
        transformers pin through its extras."""
        from tests.support.envs import checkout_spec

        bridge, source, commit = upstream_checkout
        (source / "megatron" / "core" / "uncommitted.py").write_text("")  # a local edit
        (source / "build" / "lib").mkdir(parents=True)  # a stale build
        unpacked = tmp_path / "work" / "src" / f"megatron-lm-{commit[:12]}"
        assert checkout_spec(bridge) == (
            f"core0.20.0-{commit[:12]}-transformers-ge5.8-le5.12.1",
            [f"megatron-core@{unpacked.as_uri()}", "transformers>=5.8,<=5.12.1", "datasets"],
        )
        assert sorted(str(p.relative_to(unpacked)) for p in unpacked.rglob("*")) == [
            "megatron",
            "megatron/core",
            "megatron/core/package_info.py",
        ]
        assert [p.name for p in unpacked.parent.iterdir()] == [unpacked.name]  # no temporary left
        (unpacked / "megatron" / "core" / "package_info.py").unlink()
        checkout_spec(bridge)  # unpacked once: an existing tree is reused as it is
        assert not (unpacked / "megatron" / "core" / "package_info.py").exists()

    @pytest.mark.parametrize("state", ["moved", "staged", "not checked out"])
    def test_an_upstream_checkout_off_its_pinned_core_is_refused(self, upstream_checkout, git, state):
        """Only the commit HEAD pins will do: the submodule moved on, or moved and staged (`git submodule status`
        would call that clean, as it compares with the index), or absent."""
        from mtp_mask_fix.errors import ToolError
        from tests.support.envs import checkout_spec

        bridge, source, _ = upstream_checkout
        if state == "not checked out":
            git(bridge, "submodule", "-q", "deinit", "-f", "3rdparty/Megatron-LM")
        else:
            git(source, "commit", "-q", "--allow-empty", "-m", "not the pinned commit")
            if state == "staged":
                git(bridge, "add", "3rdparty/Megatron-LM")
        with pytest.raises(ToolError, match="run `git -C .* submodule update --init 3rdparty/Megatron-LM`") as refused:
            checkout_spec(bridge)
        assert refused.value.code == 2 and "\n" not in str(refused.value)

    @pytest.mark.parametrize(
        ("breakage", "reason"),
        [
            ("no dependencies", "no static \\[project\\].dependencies"),
            ("dynamic dependencies", "no static \\[project\\].dependencies"),
            ("no package_info.py", "no 3rdparty/Megatron-LM/megatron/core/package_info.py"),
            ("no version", "no MAJOR/MINOR/PATCH version in"),
        ],
    )
    def test_a_broken_upstream_checkout_is_one_line(self, upstream_checkout, git, breakage, reason):
        from mtp_mask_fix.errors import ToolError
        from tests.support.envs import checkout_spec

        bridge, source, _ = upstream_checkout
        info = source / "megatron" / "core" / "package_info.py"
        if breakage == "no dependencies":
            (bridge / "pyproject.toml").write_text('[project]\nname = "megatron-bridge"\n')
        elif breakage == "dynamic dependencies":
            (bridge / "pyproject.toml").write_text('[project]\ndynamic = ["dependencies"]\n')
        else:
            info.unlink() if breakage == "no package_info.py" else info.write_text("MAJOR = 0\nMINOR = x\n")
            git(source, "commit", "-q", "-am", breakage)
            git(bridge, "commit", "-q", "-am", breakage)
        with pytest.raises(ToolError, match=reason) as refused:
            checkout_spec(bridge)
        assert refused.value.code == 2 and "\n" not in str(refused.value)

    def test_a_mistyped_checkout_is_no_such_directory(self, tmp_path):
        """A path that is not a directory must not read as a release version ("not on the package index")."""
        from mtp_mask_fix.paths import REPO

        typo = tmp_path / "Megatron-Brigde"
        done = subprocess.run(
            [sys.executable, "-m", "tests.support.envs", str(typo)], cwd=REPO, capture_output=True, text=True
        )
        assert (done.returncode, done.stdout, done.stderr) == (
            2,
            "",
            f"mtp-mask-fix: error: {typo}: no such directory\n",
        )

    @pytest.mark.parametrize("required", ["", "1"])
    def test_the_nightly_upstream_tests_cannot_skip(self, required):
        """Without MTP_UPSTREAM_CHECKOUT the tests in upstream's file skip, unless MTP_UPSTREAM_REQUIRED=1, which the
        nightly job that runs them sets: there a skip would pass having tested nothing."""
        from mtp_mask_fix.paths import REPO

        env = {k: v for k, v in os.environ.items() if not k.startswith("MTP_UPSTREAM_")}
        env.update(MTP_UPSTREAM_REQUIRED=required, MTP_UPSTREAM_PYTHON=sys.executable)  # the interpreter: no skip
        # --noconftest: tests/conftest.py would start every wrong-fix session in the background (about 50 s each)
        quiet = ["-q", "-x", "-p", "no:cacheprovider", "--noconftest"]
        args = ["-m", "pytest", *quiet, "-k", "TestUpstreamBoundTestsAreAsTight"]
        done = subprocess.run(
            [sys.executable, *args, "tests/test_wrong_fixes.py"], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert (done.returncode, "1 error" in done.stdout, "skipped" in done.stdout) == (
            (1, True, False) if required else (0, False, True)
        ), done.stdout
        job = (REPO / ".github" / "workflows" / "nightly.yml").read_text()
        assert re.search(r"MTP_UPSTREAM_REQUIRED=1 \\\n.*\n\s*\./run test tests/test_wrong_fixes\.py", job)

    @pytest.mark.skipif(
        not (os.environ.get("MEGATRON_BRIDGE_GIT") and os.environ.get("MEGATRON_LM_GIT")),
        reason="set MEGATRON_BRIDGE_GIT and MEGATRON_LM_GIT to clones (bare is fine) to check lines.toml",
    )
    def test_lines_toml_is_each_tags_submodule(self):
        import tomllib

        from mtp_mask_fix.paths import REPO

        table = tomllib.loads((REPO / "requirements" / "lines.toml").read_text())["megatron-core"]
        bridge, lm = os.environ["MEGATRON_BRIDGE_GIT"], os.environ["MEGATRON_LM_GIT"]
        for version, core in table.items():
            tree = subprocess.run(
                ["git", "-C", bridge, "ls-tree", f"v{version}", "3rdparty/Megatron-LM"], capture_output=True, text=True
            )
            if not tree.stdout:  # untagged (0.6.1): its row says why
                continue
            info = subprocess.run(
                ["git", "-C", lm, "show", f"{tree.stdout.split()[2]}:megatron/core/package_info.py"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\d+)", info, re.M))
            assert core == f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}", version
