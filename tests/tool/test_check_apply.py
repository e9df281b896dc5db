"""`check` and `apply` on each kind of target: a site-packages dir, a plain source tree, a git checkout."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from unidiff import PatchSet

from mtp_mask_fix.check import fix_present

from tests.support.targets import (
    BACKPORT_FILE,
    CONTEXT,
    EQUIVALENT_FIX,
    FAR_FROM_HUNK,
    FIXED,
    LABELS,
    PATCH_FILE,
    PINNED,
    REGION_EDIT,
    SUBMITTER,
    UPSTREAM_TEST,
    Tree,
    changed_lines,
    hunk_parts,
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
        assert "already fixed another way" in line and "nothing to apply" in line

    def test_drifted_context_names_the_file(self, cli, edit, snapshot, target):
        edit(target, target.gpt_step, CONTEXT, '        "attention_mask": attention_mask if use_mask else None,\n')
        before = snapshot(target.root)
        line = verdict(cli("check", target.root), 4)
        assert snapshot(target.root) == before
        assert "drifted" in line
        assert re.search(r"patch failed: (src/)?megatron/bridge/training/gpt_step\.py:\d+", line)

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

    @pytest.mark.parametrize("version", ["0.6.0", "0.6.1", "0.6.2"])  # the 0.6 series (0.6.1 is yanked on PyPI)
    def test_06_releases_apply(self, cli, version):
        line = verdict(cli("check", version), 0)
        assert line.startswith(f"megatron-bridge=={version} (PyPI): the patch applies (source hunks only")

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
        refused(cli("check"), 2, "imports no megatron.bridge", sys.executable)


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
            "the bug is present: `apply` fixes it"
        )

    @pytest.mark.parametrize("version", RELEASES)
    def test_status_says_the_release_still_needs_the_patch(self, cli, version):
        result = cli("status", version)
        assert result.stdout.splitlines()[-1] == (
            f"  on megatron-bridge=={version} (PyPI): the patch applies (source hunks only, {RELEASES[version]}); "
            "the bug is present: `apply` fixes it"
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
    from maintain.repo import release

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


class TestReleaseEnvironments:
    """Each release's tests run with the megatron-core its submodule pins and the transformers its wheel declares."""

    def test_pinned_release_uses_this_environment(self):
        from maintain.envs import spec

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
        from maintain.envs import spec

        assert spec(version)[0] == key

    @pytest.fixture
    def upstream_checkout(self, git, tmp_path, monkeypatch):
        """A scratch Megatron-Bridge checkout: (bridge, its submodule, the pinned commit); .work/src in tmp_path."""
        import maintain.envs

        monkeypatch.setattr(maintain.envs, "WORK", tmp_path / "work")
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
        from maintain.envs import checkout_spec

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
        from maintain.envs import checkout_spec
        from mtp_mask_fix.errors import ToolError

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
        from maintain.envs import checkout_spec
        from mtp_mask_fix.errors import ToolError

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
        from maintain.repo import REPO

        typo = tmp_path / "Megatron-Brigde"
        done = subprocess.run(
            [sys.executable, "-m", "maintain.envs", str(typo)], cwd=REPO, capture_output=True, text=True
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
        from maintain.repo import REPO

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

        from maintain.repo import REPO

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
