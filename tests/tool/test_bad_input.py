"""Bad input to the tool: one `mtp-mask-fix: error:` line on stderr, its own exit code, and not one file changed.

Each case of the table makes its input in a fresh tmp_path (a target, a damaged patch, an interpreter), then runs one
command line; the table is every refusal a user can meet before the tool has written anything."""

import errno
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtp_mask_fix.paths import PATCHES
from tests.support.targets import CONTEXT, REGION_EDIT, UPSTREAM_TEST, fake_python


JOURNAL = ".mtp-mask-fix-journal.json"
READ_ONLY = "is read-only or not yours to write"  # one sentence, by its mode or by its mount


@dataclass
class Case:
    """A target kind, what to break, the command (TARGET, PY: the inputs made), the exit code and the words the
    line must hold ({PY}: the interpreter made)."""

    target: str
    breaks: str
    argv: tuple[str, ...]
    code: int
    words: tuple[str, ...]


CASES = {
    # TARGET
    "a missing path": Case("installed", "missing", ("apply", "--no-verify", "TARGET"), 2, ("no such file",)),
    "not Megatron-Bridge": Case("installed", "not bridge", ("check", "TARGET"), 2, ("not a Megatron-Bridge tree",)),
    "no gpt_step.py": Case("installed", "no gpt_step", ("check", "TARGET"), 2, ("without megatron/bridge/training",)),
    "a file": Case("installed", "a file", ("check", "TARGET"), 2, ("not a directory",)),
    "an empty TARGET": Case("installed", "", ("apply", "--no-verify", ""), 2, ("an empty TARGET",)),
    "an unknown home": Case("installed", "", ("check", "~no-such-user-here/x"), 2, ("~no-such-user-here",)),
    "a symlinked folder": Case("installed", "linked folder", ("apply", "--no-verify", "TARGET"), 2, ("is a symlink",)),
    # what is in the way of a write
    "local edits in the region": Case("git", "region edit", ("apply", "--no-verify", "TARGET"), 2, ("local changes",)),
    "edits in a tree without git": Case("tree", "region edit", ("apply", "--no-verify", "TARGET"), 4, ("drifted",)),
    "a read-only gpt_step.py": Case(
        "installed", "read-only file", ("apply", "--no-verify", "TARGET"), 2, ("read-only",)
    ),
    "a read-only test file": Case("git", "read-only test", ("apply", "--no-verify", "TARGET"), 2, ("read-only",)),
    "a read-only folder": Case("installed", "read-only folder", ("apply", "--no-verify", "TARGET"), 2, ("read-only",)),
    "a read-only TARGET": Case("installed", "read-only root", ("apply", "--no-verify", "TARGET"), 2, (READ_ONLY,)),
    "a read-only mount": Case("installed", "read-only mount", ("apply", "--no-verify", "TARGET"), 2, (READ_ONLY,)),
    "a journal that is a folder": Case("installed", "journal folder", ("verify", "TARGET"), 2, ("is not a file",)),
    "no git on PATH": Case("git", "no git", ("check", "TARGET"), 2, ("git is not on PATH",)),
    # the interpreter
    "an interpreter naming no bridge": Case(
        "installed", "python /", ("status", "--python", "PY"), 2, ("{PY} imports", "give --python")
    ),
    "no such interpreter": Case(
        "installed", "", ("check", "--python", "no-such-python"), 2, ("no executable file of that name on PATH",)
    ),
    "an interpreter it may not run": Case(
        "installed",
        "python not executable",
        ("verify", "--python", "PY", "TARGET"),
        2,
        ("--python {PY}: no executable file of that name",),
    ),
    "a folder as the interpreter": Case(
        "installed",
        "python folder",
        ("apply", "--python", "PY", "TARGET"),
        2,
        ("--python {PY}: no executable file of that name",),
    ),
    "an interpreter no system can run": Case(
        "installed",
        "python no format",
        ("verify", "--python", "PY", "TARGET"),
        2,
        ("running {PY}: Exec format error",),
    ),
    "a program that is not Python": Case(
        "installed", "python ls", ("verify", "--python", "PY", "TARGET"), 2, ("--python {PY} is not a Python",)
    ),
    "a program that is not Python, to verify a write": Case(
        "installed", "python ls", ("apply", "--python", "PY", "TARGET"), 2, ("is not a Python",)
    ),
    "an interpreter without torch": Case(
        "installed", "python no torch", ("verify", "--python", "PY", "TARGET"), 5, ("not verified with {PY}", "torch")
    ),
    "an interpreter that prints junk": Case(
        "installed",
        "python hello",
        ("verify", "--python", "PY", "TARGET"),
        2,
        ("--python {PY} is not a Python", "hello"),
    ),
    # the command line
    "an unknown command": Case("installed", "", ("frobnicate",), 2, ("invalid choice: 'frobnicate'",)),
    "no command": Case("installed", "", (), 2, ("required: command",)),
    "an unknown option": Case(
        "installed", "", ("check", "--frobnicate"), 2, ("arguments: --frobnicate (see mtp-mask-fix --help)",)
    ),
    "an option without a value": Case("installed", "", ("check", "--python"), 2, ("expected one argument",)),
}


@pytest.fixture
def broken(request, tmp_path, edit, monkeypatch):
    """The case's target, broken as it says; returns (target root, the interpreter, extra env)."""
    case = CASES[request.node.callspec.params["name"]]
    tree = request.getfixturevalue(
        {"installed": "site_packages", "tree": "source_tree", "git": "checkout"}[case.target]
    )
    root, python, env = tree.root, sys.executable, {}
    what = case.breaks
    if what == "missing":
        root = tmp_path / "no-such-dir"
    elif what == "not bridge":
        root = tmp_path / "some-project"
        (root / "src" / "megatron").mkdir(parents=True)
    elif what == "no gpt_step":
        tree.gpt_step.unlink()
    elif what == "a file":
        root = tree.gpt_step
    elif what == "linked folder":
        real = tmp_path / "training"
        tree.gpt_step.parent.rename(real)
        tree.gpt_step.parent.symlink_to(real)
    elif what == "region edit":
        edit(tree, tree.gpt_step, CONTEXT, REGION_EDIT, commit=False)
    elif what == "read-only file":
        tree.gpt_step.chmod(0o444)
    elif what == "read-only test":
        (root / UPSTREAM_TEST).chmod(0o444)
    elif what == "read-only folder":
        tree.gpt_step.parent.chmod(0o555)
    elif what == "read-only root":
        root.chmod(0o555)
    elif what == "read-only mount":  # as a read-only bind mount answers: writable by its mode, EROFS to a write
        inside, access, unlink = (
            lambda path: Path(path).resolve().is_relative_to(root.resolve()),
            os.access,
            Path.unlink,
        )
        read_only = OSError(errno.EROFS, os.strerror(errno.EROFS))
        monkeypatch.setattr(
            os, "access", lambda path, mode: not (mode & os.W_OK and inside(path)) and access(path, mode)
        )
        monkeypatch.setattr(
            Path, "unlink", lambda path, **kw: unlink(path, **kw) if not inside(path) else _raise(read_only)
        )
    elif what == "journal folder":
        (root / JOURNAL).mkdir()
    elif what == "no git":
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "python").symlink_to(sys.executable)
        env = {"PATH": str(tmp_path / "bin")}
    elif what == "python /":
        python = fake_python(tmp_path, "python", "echo /")
    elif what == "python no torch":
        python = fake_python(tmp_path, "python", "echo \"ModuleNotFoundError: No module named 'torch'\" >&2; exit 1")
    elif what == "python ls":
        python = Path(shutil.which("ls"))
    elif what == "python hello":
        python = fake_python(tmp_path, "python", "echo hello")
    elif what == "python not executable":
        python = fake_python(tmp_path, "python", "echo hello")
        python.chmod(0o644)
    elif what == "python folder":
        python = tmp_path / "bin"
        python.mkdir()
    elif what == "python no format":
        python = tmp_path / "python"
        python.write_bytes(b"\x7fELF not really\n")
        python.chmod(0o755)
    yield root, python, env
    for path in (tree.gpt_step.parent, tree.root):
        if path.exists() and not path.is_symlink():
            path.chmod(0o755)


def _raise(error: OSError):
    raise error


@pytest.mark.parametrize("name", CASES)
def test_refused_in_one_line_and_nothing_changed(cli, tool_env, refused, snapshot, tmp_path, broken, name):
    case, (root, python, env) = CASES[name], broken
    places = {"TARGET": str(root), "PY": str(python)}
    argv = [places.get(arg, arg) for arg in case.argv]
    before = snapshot(tmp_path, PATCHES)
    line = refused(cli(*argv, env=dict(tool_env, **env)), case.code, *(word.format(**places) for word in case.words))
    assert snapshot(tmp_path, PATCHES) == before
    if case.breaks.startswith("python"):  # a line a person reads at once, the paths made here aside
        assert len(line.replace(str(tmp_path), "")) < 200, line


class TestNotRefused:
    """Inputs that look odd but are the user's to have: read through, or cleaned up, never followed outside TARGET."""

    def test_a_symlinked_gpt_step(self, cli, refused, snapshot, tmp_path, site_packages, probe_ok):
        """apply replaces a file by a rename, which would replace the link, not what it points at: check says why
        (exit 2) and apply refuses; verify, which only runs the code, is not refused."""
        real = tmp_path / "gpt_step.py"
        real.write_bytes(site_packages.gpt_step.read_bytes())
        site_packages.gpt_step.unlink()
        site_packages.gpt_step.symlink_to(real)
        before = snapshot(site_packages.root, real)
        checked = cli("check", site_packages.root)
        assert (checked.returncode, checked.stderr) == (2, "") and "gpt_step.py is a symlink" in checked.stdout
        refused(cli("apply", "--no-verify", site_packages.root), 2, "gpt_step.py is a symlink")
        assert cli("verify", "--python", probe_ok(), site_packages.root).returncode == 0
        assert snapshot(site_packages.root, real) == before

    def test_a_symlinked_gpt_step_that_is_already_fixed(self, cli, tmp_path, site_packages):
        """Nothing to write: already fixed, whatever the link (a start-up `apply || exit 1` must pass)."""
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        real = tmp_path / "gpt_step.py"
        real.write_bytes(site_packages.gpt_step.read_bytes())
        site_packages.gpt_step.unlink()
        site_packages.gpt_step.symlink_to(real)
        assert cli("check", site_packages.root).returncode == 3
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0

    @pytest.mark.parametrize("command", [("check",), ("status",), ("apply", "--no-verify"), ("revert",)])
    def test_an_interpreter_a_command_never_runs(self, cli, site_packages, command):
        """With a TARGET, these never run --python: a bad one is no reason to refuse them."""
        if command == ("revert",):
            assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        result = cli(*command, "--python", "/no/such/python", site_packages.root)
        assert result.returncode in (0, 3) and result.stderr == "", result.stderr

    @pytest.mark.parametrize("entry", ["", ".", "../outside.txt", "megatron/../../outside.txt", "megatron", "no/x.py"])
    def test_a_journal_naming_no_file_inside_target(self, cli, site_packages, entry):
        """A journal is the tool's own, but it is read from disk: an entry outside TARGET, or not a file, is never
        followed, and apply drops the journal."""
        journal = {"release": "", "files": {entry: {"before": "aGkK", "after": "0" * 64}}}
        (site_packages.root / JOURNAL).write_text(json.dumps(journal))
        assert "naming no file it can restore" in cli("check", site_packages.root).stdout
        result = cli("apply", "--no-verify", site_packages.root)
        assert result.returncode == 0, result.stderr
        assert not (site_packages.root.parent / "outside.txt").exists() and not (site_packages.root / JOURNAL).exists()
