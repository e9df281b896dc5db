"""Bad input: one `mtp-mask-fix: error:` line on stderr, a non-zero exit, and not one file changed."""

import json
import os
import sys

import pytest

from maintain.repo import WORK
from mtp_mask_fix.paths import PATCHES

from tests.support.targets import PINNED, UPSTREAM_TEST


REGION_EDIT = ('        "attention_mask": attention_mask,\n', '        "attention_mask": attention_mask,  # local\n')


@pytest.fixture
def patch_copy(tmp_path, patch):
    """Write a damaged copy of the committed patch into tmp_path; returns its path."""

    def make(name: str, data: bytes) -> os.PathLike:
        path = tmp_path / name
        path.write_bytes(data)
        return path

    return make


@pytest.fixture
def no_git_env(tmp_path, tool_env):
    """PATH holding only a python (a symlink to this interpreter) and no git."""
    bin_dir = tmp_path / "bin-without-git"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    (bin_dir / "python3").symlink_to(sys.executable)
    return dict(tool_env, PATH=str(bin_dir))


class TestBadTarget:
    """TARGETs that are not a Megatron-Bridge the tool can work on."""

    @pytest.mark.parametrize("command", [["check"], ["apply", "--no-verify"]])
    def test_missing_path(self, cli, refused, snapshot, tmp_path, site_packages, command):
        before = snapshot(tmp_path)
        refused(cli(*command, tmp_path / "no-such-dir"), 2, "no such file or directory")
        assert snapshot(tmp_path) == before

    def test_branch_on_a_missing_path(self, branch, refused, snapshot, tmp_path):
        before = snapshot(tmp_path)
        refused(branch(tmp_path / "no-such-dir", "fix-6103"), 2, "no such file or directory")
        assert snapshot(tmp_path) == before

    @pytest.mark.parametrize("command", [["check"], ["apply", "--no-verify"]])
    def test_directory_that_is_not_megatron_bridge(self, cli, refused, snapshot, tmp_path, command):
        other = tmp_path / "some-project"
        (other / "src" / "megatron").mkdir(parents=True)
        (other / "src" / "megatron" / "core.py").write_text("x = 1\n")
        (other / "README.md").write_text("not Bridge\n")
        before = snapshot(other)
        refused(cli(*command, other), 2, "not a Megatron-Bridge tree")
        assert snapshot(other) == before

    def test_bridge_without_gpt_step(self, cli, refused, snapshot, site_packages):
        site_packages.gpt_step.unlink()
        before = snapshot(site_packages.root)
        refused(cli("check", site_packages.root), 2, "without megatron/bridge/training/gpt_step.py")
        assert snapshot(site_packages.root) == before

    def test_a_file_is_not_a_target(self, cli, refused, snapshot, site_packages):
        before = snapshot(site_packages.root)
        refused(cli("check", site_packages.gpt_step), 2, "not a directory")
        assert snapshot(site_packages.root) == before

    @pytest.mark.parametrize("command", [["check"], ["verify"], ["gate", "--release"]])
    def test_release_that_does_not_exist(self, cli, refused, command):
        """A failed download leaves the release cache as it was: no version folder, no temporary one (the cache's
        own files are written only by a download that succeeded)."""
        before = sorted(path.name for path in (WORK / "pypi").iterdir())
        refused(cli(*command, "9.9.9"), 2, "megatron-bridge 9.9.9: not on the package index")
        assert sorted(path.name for path in (WORK / "pypi").iterdir()) == before
        assert "9.9.9" not in before

    def test_apply_to_a_pypi_release(self, cli, refused, snapshot, release):
        before = snapshot(release.root)
        refused(cli("apply", "--no-verify", PINNED), 2, "is a release on the package index")
        assert snapshot(release.root) == before

    def test_apply_to_a_release_is_refused_before_any_download(self, cli, refused, tool_env):
        offline = tool_env | {"PIP_INDEX_URL": "file:///nonexistent", "PIP_NO_INDEX": "1"}  # a download would fail
        refused(cli("apply", "--no-verify", "latest", env=offline), 2, "latest is a release on the package index")

    def test_an_empty_target_is_not_the_default(self, cli, refused, snapshot, tmp_path):
        before = snapshot(tmp_path)
        refused(cli("apply", "--no-verify", ""), 2, "an empty TARGET")
        assert snapshot(tmp_path) == before

    def test_a_home_that_cannot_be_found(self, cli, refused):
        refused(cli("check", "~no-such-user-here/site-packages"), 2, "~no-such-user-here")

    @pytest.mark.parametrize("prints", ["", "/"], ids=["nothing", "the-root"])
    def test_an_interpreter_that_names_no_megatron_bridge(self, cli, refused, tmp_path, prints):
        python = tmp_path / "python"
        python.write_text(f"#!/bin/sh\necho '{prints}'\n")
        python.chmod(0o755)
        for command in ("check", "status"):
            refused(cli(command, "--python", python), 2, f"{python}")

    def test_a_symlinked_gpt_step(self, cli, refused, snapshot, tmp_path, site_packages):
        """apply replaces the file by a rename, which would replace the link, not what it points at: refused, and
        check says why (git apply calls a link the wrong type); verify, which only runs the code, is not refused."""
        real = tmp_path / "gpt_step.py"
        real.write_bytes(site_packages.gpt_step.read_bytes())
        site_packages.gpt_step.unlink()
        site_packages.gpt_step.symlink_to(real)
        before = snapshot(site_packages.root, real)
        checked = cli("check", site_packages.root)  # a verdict, on stdout
        assert (checked.returncode, checked.stderr) == (2, "") and "gpt_step.py is a symlink" in checked.stdout
        refused(cli("apply", "--no-verify", site_packages.root), 2, "gpt_step.py is a symlink")
        found = {"file": str(site_packages.gpt_step), "delivered": True, "reason": "a fake probe"}
        python = tmp_path / "python"
        python.write_text(f"#!/bin/sh\necho '{json.dumps(found)}'\n")
        python.chmod(0o755)
        assert cli("verify", "--python", python, site_packages.root).returncode == 0
        assert snapshot(site_packages.root, real) == before

    def test_a_symlinked_gpt_step_that_is_already_fixed(self, cli, tmp_path, site_packages):
        """Nothing to write: already fixed, whatever the link (a start-up `apply || exit 1` must pass)."""
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        real = tmp_path / "gpt_step.py"
        real.write_bytes(site_packages.gpt_step.read_bytes())
        site_packages.gpt_step.unlink()
        site_packages.gpt_step.symlink_to(real)
        checked = cli("check", site_packages.root)
        assert checked.returncode == 3, checked.stdout + checked.stderr
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0

    def test_a_symlinked_folder_above_gpt_step(self, cli, refused, snapshot, tmp_path, site_packages):
        """git apply does not write beyond a symbolic link: that is said, not read as drift."""
        real = tmp_path / "training"
        site_packages.gpt_step.parent.rename(real)
        site_packages.gpt_step.parent.symlink_to(real)
        before = snapshot(site_packages.root, real)
        checked = cli("check", site_packages.root)
        assert (checked.returncode, checked.stderr) == (
            2,
            "",
        ) and "megatron/bridge/training is a symlink" in checked.stdout
        refused(cli("apply", "--no-verify", site_packages.root), 2, "is a symlink")
        assert snapshot(site_packages.root, real) == before

    def test_branch_on_a_tree_without_git(self, branch, refused, snapshot, source_tree):
        before = snapshot(source_tree.root)
        refused(branch(source_tree.root, "fix-6103"), 2, "not the top of a Megatron-Bridge git checkout")
        assert snapshot(source_tree.root) == before

    def test_branch_on_site_packages(self, branch, refused, snapshot, site_packages):
        before = snapshot(site_packages.root)
        refused(branch(site_packages.root, "fix-6103"), 2, "not the top of a Megatron-Bridge git checkout")
        assert snapshot(site_packages.root) == before


class TestDirtyTarget:
    """Local changes in the patch's region, staged changes, read-only files."""

    def test_conflicting_local_change(self, cli, edit, refused, snapshot, checkout):
        edit(checkout, checkout.gpt_step, *REGION_EDIT, commit=False)
        before = snapshot(checkout.root)
        refused(cli("apply", "--no-verify", checkout.root), 2, "local changes")
        assert snapshot(checkout.root) == before

    def test_conflicting_local_change_with_branch(self, branch, edit, git, refused, snapshot, checkout):
        git(checkout.root, "config", "user.name", "Ada Submitter")
        git(checkout.root, "config", "user.email", "ada@example.org")
        edit(checkout, checkout.gpt_step, *REGION_EDIT, commit=False)
        before = snapshot(checkout.root)
        refused(branch(checkout.root, "fix-6103"), 2, "local changes")
        assert snapshot(checkout.root) == before

    def test_conflicting_change_in_a_tree_without_git(self, cli, edit, refused, snapshot, source_tree):
        edit(source_tree, source_tree.gpt_step, *REGION_EDIT)
        before = snapshot(source_tree.root)
        refused(cli("apply", "--no-verify", source_tree.root), 4, "drifted")
        assert snapshot(source_tree.root) == before

    def test_staged_changes_block_branch(self, branch, git, refused, snapshot, checkout):
        git(checkout.root, "config", "user.name", "Ada Submitter")
        git(checkout.root, "config", "user.email", "ada@example.org")
        (checkout.root / "README.md").write_text("staged edit\n")
        git(checkout.root, "add", "README.md")
        before = snapshot(checkout.root)
        refused(branch(checkout.root, "fix-6103"), 2, "staged changes")
        assert snapshot(checkout.root) == before

    def test_branch_without_git_identity(self, branch, refused, snapshot, checkout):
        before = snapshot(checkout.root)
        refused(branch(checkout.root, "fix-6103"), 2, "user.name is not set")
        assert snapshot(checkout.root) == before

    def test_read_only_file(self, cli, refused, snapshot, target):
        target.gpt_step.chmod(0o444)
        before = snapshot(target.root)
        refused(cli("apply", "--no-verify", target.root), 2, "read-only")
        assert snapshot(target.root) == before

    def test_read_only_test_file(self, cli, refused, snapshot, checkout):
        """upstream's test file cannot be written: refused before gpt_step.py is touched."""
        (checkout.root / UPSTREAM_TEST).chmod(0o444)
        before = snapshot(checkout.root)
        refused(cli("apply", "--no-verify", checkout.root), 2, "read-only")
        assert snapshot(checkout.root) == before


class TestNoGit:
    """git is what applies and checks the patch; without it on PATH the tool says so."""

    @pytest.mark.parametrize("command", [["check"], ["apply", "--no-verify"]])
    @pytest.mark.parametrize("kind", ["site_packages", "source_tree", "checkout"])
    def test_no_git_on_path(self, request, cli, refused, snapshot, no_git_env, command, kind):
        tree = request.getfixturevalue(kind)
        before = snapshot(tree.root)
        refused(cli(*command, tree.root, env=no_git_env), 2, "git is not on PATH")
        assert snapshot(tree.root) == before


class TestBadPatch:
    """`--patch` pointing at a damaged copy of the patch: refused before anything is touched."""

    @pytest.fixture
    def guarded(self, snapshot, checkout):
        """The target's root, and a function telling that neither it nor patches/ changed since the test began."""
        before = snapshot(checkout.root, PATCHES)
        return checkout.root, lambda: snapshot(checkout.root, PATCHES) == before

    @pytest.mark.parametrize("command", [["check"], ["apply", "--no-verify"]])
    @pytest.mark.parametrize(
        "cut_before",
        [b"     }\n+    if use_mtp:", b"+    def test_forward_common_without_mtp"],
        ids=["in-the-source-hunk", "in-the-test-hunk"],
    )
    def test_truncated_in_a_hunk(self, cli, refused, patch_copy, patch, guarded, command, cut_before):
        root, unchanged = guarded
        text = patch.text.encode()
        damaged = patch_copy("truncated.patch", text[: text.index(cut_before)])
        refused(cli("--patch", damaged, *command, root), 2, "corrupted")
        assert unchanged()

    def test_truncated_at_a_file_boundary(self, cli, refused, patch_copy, patch, guarded):
        """Cut just before the test file's diff, the copy still parses: the mailbox's own diffstat catches it."""
        root, unchanged = guarded
        text = patch.text.encode()
        damaged = patch_copy(
            "truncated.patch", text[: text.index(b"diff --git a/tests/unit_tests/training/test_gpt_step.py")]
        )
        refused(cli("--patch", damaged, "apply", "--no-verify", root), 2, "corrupted")
        assert unchanged()

    @pytest.mark.parametrize(
        "data",
        [b"", b"\x00\xff\xfe garbage \x13\x37\n" * 50, b"From 0000 Mon Sep 17 00:00:00 2001\nSubject: x\n\nno diff\n"],
        ids=["empty", "binary-garbage", "no-diff"],
    )
    def test_garbage(self, cli, refused, patch_copy, guarded, data):
        root, unchanged = guarded
        refused(cli("--patch", patch_copy("garbage.patch", data), "check", root), 2, "corrupted")
        assert unchanged()

    def test_crlf_line_endings(self, cli, refused, patch_copy, patch, guarded):
        root, unchanged = guarded
        crlf = patch_copy("crlf.patch", patch.text.replace("\n", "\r\n").encode())
        refused(cli("--patch", crlf, "apply", "--no-verify", root), 2, "CRLF line endings")
        assert unchanged()

    def test_a_patch_that_changes_no_source_file(self, cli, refused, patch_copy, patch, guarded):
        """The test part alone (no diffstat to contradict it) is no fix: refused, not reported as drifted."""
        root, unchanged = guarded
        header = patch.text.split("\n---\n", 1)[0]
        tests_only = patch_copy("tests-only.patch", f"{header}\n---\n\n{patch.part(src=False)}".encode())
        for command in (["check"], ["apply", "--no-verify"]):
            refused(cli("--patch", tests_only, *command, root), 2, "changes to existing files")
        assert unchanged()

    def test_a_patch_that_creates_a_file(self, cli, refused, patch_copy, patch, guarded):
        """apply replaces files that exist; a patch creating one is refused by every command alike."""
        root, unchanged = guarded
        new = "src/megatron/bridge/training/new_module.py"
        diff = f"diff --git a/{new} b/{new}\nnew file mode 100644\n--- /dev/null\n+++ b/{new}\n@@ -0,0 +1 @@\n+x = 1\n"
        creates = patch_copy("creates.patch", (patch.text.split("\n---\n", 1)[0] + "\n---\n\n" + diff).encode())
        for command in (["check"], ["apply", "--no-verify"]):
            refused(cli("--patch", creates, *command, root), 2, "changes to existing files")
        assert unchanged()

    def test_patch_after_the_command(self, cli, refused, tmp_path, guarded):
        root, unchanged = guarded
        refused(cli("apply", "--patch", tmp_path / "nope.patch", "--no-verify", root), 2, "cannot read patch")
        assert unchanged()

    def test_patch_before_and_after_the_command(self, cli, refused, tmp_path, guarded, patch):
        root, unchanged = guarded
        twice = ["--patch", tmp_path / "nope.patch", "apply", "--patch", patch.path, "--no-verify", root]
        refused(cli(*twice), 2, "--patch given twice")
        assert unchanged()

    def test_missing_patch_file(self, cli, refused, tmp_path, guarded):
        root, unchanged = guarded
        refused(cli("--patch", tmp_path / "nope.patch", "check", root), 2, "cannot read patch")
        assert unchanged()


class TestBadCommandLine:
    """argparse's complaints are one line too (cli.Parser), exit 2."""

    @pytest.mark.parametrize(
        ("argv", "words"),
        [
            (["frobnicate"], ["invalid choice: 'frobnicate'"]),
            ([], ["required: command"]),
            (["check", "--frobnicate"], ["unrecognized arguments: --frobnicate"]),
            (["--patch"], ["expected one argument"]),
        ],
        ids=[
            "unknown-subcommand",
            "no-subcommand",
            "unknown-option",
            "option-without-value",
        ],
    )
    def test_usage_errors(self, cli, refused, snapshot, tmp_path, argv, words):
        before = snapshot(tmp_path, PATCHES)
        line = refused(cli(*argv), 2, *words)
        assert "(see mtp-mask-fix" in line
        assert snapshot(tmp_path, PATCHES) == before


class TestBadBranch:
    """An empty or invalid branch name is refused before any work (`git check-ref-format --branch`)."""

    @pytest.mark.parametrize("name", ["", "bad..name", "-x", "a b", "ends.lock"], ids=repr)
    def test_refused_first(self, branch, git, refused, snapshot, checkout, name):
        git(checkout.root, "config", "user.name", "Ada Submitter")
        git(checkout.root, "config", "user.email", "ada@example.org")
        branches = git(checkout.root, "branch")
        before = snapshot(checkout.root)
        refused(branch(checkout.root, name), 2, "not a valid branch name")
        assert snapshot(checkout.root) == before
        assert git(checkout.root, "branch") == branches


class TestNotWritable:
    def test_read_only_directory(self, cli, refused, snapshot, site_packages):
        """The file is replaced by a rename in its folder: a read-only folder is refused before any work."""
        folder = site_packages.gpt_step.parent
        folder.chmod(0o555)
        try:
            before = snapshot(site_packages.root)
            refused(cli("apply", "--no-verify", site_packages.root), 2, "read-only")
            assert snapshot(site_packages.root) == before
        finally:
            folder.chmod(0o755)

    def test_a_git_checkout_without_a_commit(self, cli, refused, snapshot, git, source_tree):
        """Nothing to gate at HEAD; check reads it as a plain tree."""
        git(source_tree.root, "init", "--quiet")
        before = snapshot(source_tree.root)
        refused(cli("gate", "--checkouts-only", "--checkout", source_tree.root), 2, "with a commit")
        assert cli("check", source_tree.root).returncode == 0
        assert snapshot(source_tree.root) == before

    @pytest.mark.parametrize("entry", ["", ".", "megatron/../../outside.txt", "megatron", "no-folder/x.py"])
    def test_a_journal_entry_that_is_not_a_file_inside_target(self, cli, site_packages, entry):
        journal = {"files": {entry: {"before": "aGkK", "after": "0" * 64}}}
        (site_packages.root / ".mtp-mask-fix-journal.json").write_text(json.dumps(journal))
        assert "naming no file it can restore" in cli("check", site_packages.root).stdout
        result = cli("apply", "--no-verify", site_packages.root)
        assert result.returncode == 0, result.stderr
        assert not (site_packages.root.parent / "outside.txt").exists()
        assert not list(site_packages.root.glob("**/*.mtp-mask-fix.tmp"))

    def test_a_journal_that_is_not_a_file(self, cli, refused, snapshot, site_packages):
        (site_packages.root / ".mtp-mask-fix-journal.json").mkdir()
        before = snapshot(site_packages.root)
        for command in (["check"], ["apply", "--no-verify"], ["verify"]):
            refused(cli(*command, site_packages.root), 2, ".mtp-mask-fix-journal.json is not a file")
        assert snapshot(site_packages.root) == before

    def test_read_only_target_folder(self, cli, refused, snapshot, site_packages):
        """The journal is written in TARGET itself: a read-only TARGET folder is refused before any work."""
        site_packages.root.chmod(0o555)
        try:
            before = snapshot(site_packages.root)
            refused(cli("apply", "--no-verify", site_packages.root), 2, "read-only")
            assert snapshot(site_packages.root) == before
        finally:
            site_packages.root.chmod(0o755)

    def test_verify_with_an_interpreter_that_prints_no_result(self, cli, refused, tmp_path, site_packages):
        python = tmp_path / "python-that-echoes"
        python.write_text("#!/bin/sh\necho hello\n")
        python.chmod(0o755)
        refused(cli("verify", "--python", python, site_packages.root), 5, f"not verified with {python}", "hello")

    def test_a_journal_naming_a_file_outside_the_target_is_not_followed(self, cli, site_packages):
        """A journal is the tool's own, but it is read from disk: no entry reaches outside TARGET."""
        outside = site_packages.root.parent / "outside.txt"
        journal = {"files": {"../outside.txt": {"before": "aGkK", "after": "0" * 64}}}
        (site_packages.root / ".mtp-mask-fix-journal.json").write_text(json.dumps(journal))
        result = cli("apply", "--no-verify", site_packages.root)
        assert result.returncode == 0, result.stderr
        assert not outside.exists()
        assert not (site_packages.root / ".mtp-mask-fix-journal.json").exists()

    def test_verify_without_torch_is_never_0(self, cli, refused, tmp_path, site_packages):
        python = tmp_path / "python-without-torch"
        python.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
        python.chmod(0o755)
        refused(cli("verify", "--python", python, site_packages.root), 5, f"not verified with {python}", "torch")
