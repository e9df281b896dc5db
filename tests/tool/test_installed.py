"""The tool as a training environment has it: pip-installed (not editable) into a Python 3.12 venv, run from anywhere
with no TARGET; its console script and `python -m mtp_mask_fix` are one tool."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from maintain.repo import REPO, WORK
from mtp_mask_fix import __version__
from tests.support.targets import PATCH_FILE, PINNED, verdict


pytestmark = pytest.mark.slow  # a pip install in a venv of its own: `./run test --all`


class TestEntryPoints:
    """`mtp-mask-fix` (console script) and `python -m mtp_mask_fix` are the same tool."""

    def test_console_script_matches_module(self, cli, tool_env, tmp_path, site_packages):
        script = Path(sys.executable).parent / "mtp-mask-fix"
        result = subprocess.run(
            [str(script), "check", str(site_packages.root)], cwd=tmp_path, env=tool_env, capture_output=True, text=True
        )
        assert (result.returncode, result.stdout, result.stderr) == (0, cli("check", site_packages.root).stdout, "")

    def test_help(self, cli):
        """Its commands, and an exit table of what the installed tool has (nothing of this clone's upkeep)."""
        result = cli("--help")
        assert result.returncode == 0
        listed = re.findall(r"^    (\w+)\s+\S", result.stdout, re.M)  # argparse's one line per command
        assert listed == ["check", "apply", "revert", "verify", "status", "watch"]
        table = result.stdout.split("exit codes:")[1]
        assert not re.search(r"gate|red/green|figure|\./run", table), table


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
    python = _python312()
    if python is None:
        pytest.skip("no Python 3.12 here")
    venv = WORK / "py312-tool"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "install"]
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([*pip, "-q", "unidiff>=0.7"], check=True, capture_output=True)
    # As a user installs it: its own build environment (pyproject's build-system), no cached wheel; -v shows what
    # the build backend says (a newer pip shows its deprecations by default).
    install = [*pip, "-v", "--no-deps", "--no-cache-dir", "--force-reinstall", str(REPO)]
    built = subprocess.run(install, capture_output=True, text=True, cwd=venv)
    assert built.returncode == 0, built.stderr
    subprocess.run(
        [*pip, "-q", "--no-deps", "--force-reinstall", f"megatron-bridge=={PINNED}"], check=True, capture_output=True
    )
    return venv, built.stdout + built.stderr


@pytest.fixture
def run_installed(installed_tool, tmp_path):
    """Run the installed `mtp-mask-fix ARGS` from tmp_path, with no PYTHONPATH but `pythonpath` and a HOME of its own
    (no downloads or caches of ours)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"HOME": str(tmp_path)}

    venv, _ = installed_tool

    def run(*args, pythonpath=None) -> subprocess.CompletedProcess:
        more = {"PYTHONPATH": pythonpath} if pythonpath is not None else {}
        tool = [str(venv / "bin" / "mtp-mask-fix"), *args]
        return subprocess.run(tool, cwd=tmp_path, env=env | more, capture_output=True, text=True)

    return run


class TestInstalledTool:
    """In a training environment: pip-installed (not editable), run from anywhere, no TARGET."""

    def test_it_builds_without_a_deprecation(self, installed_tool):
        _, said = installed_tool
        assert not re.search(r"(?i)deprecat", said), said

    def test_version(self, run_installed):
        result = run_installed("--version")
        assert (result.returncode, result.stdout, result.stderr) == (0, f"mtp-mask-fix {__version__}\n", "")

    def test_apply_with_no_arguments_then_again(self, installed_tool, run_installed, tmp_path, refused, snapshot):
        python, run = str(installed_tool[0] / "bin" / "python"), run_installed
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
        # verify needs torch and megatron-core in that interpreter: without them apply writes nothing, never exit 0
        refused(run("apply"), 5, "nothing changed", python, "No module named 'torch'")
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

    def test_it_installs_the_tool_and_the_patches_and_nothing_else(self, installed_tool):
        venv, _ = installed_tool
        (record,) = venv.glob("lib/python3.12/site-packages/mtp_mask_fix-*.dist-info/RECORD")
        files = {line.split(",")[0] for line in record.read_text().splitlines()}
        tracked = subprocess.run(
            ["git", "ls-files", "mtp_mask_fix", "patches"], cwd=REPO, capture_output=True, text=True
        )
        expected = {
            re.sub(r"^patches/", "mtp_mask_fix/patches/", f)
            for f in tracked.stdout.split()
            if f != "mtp_mask_fix/patches"
        }
        installed = {f for f in files if not f.startswith(("mtp_mask_fix-", "../")) and "__pycache__" not in f}
        assert installed == expected
        assert {f for f in files if f.startswith("../")} == {"../../../bin/mtp-mask-fix"}
