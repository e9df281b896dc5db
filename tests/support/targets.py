"""Fixtures for the tests of the tool and of maintain/: throwaway Megatron-Bridge-shaped targets built in tmp_path at
run time, and the tool run as a user runs it (a pytest plugin: tests/conftest.py loads it).

No upstream code is committed here. gpt_step.py is copied from the pinned PyPI release (downloaded and cached by
`mtp_mask_fix.targets.release`); upstream's tests/unit_tests/training/test_gpt_step.py is synthesized from the
patch's own hunks for that file (their context and removed lines, the only upstream lines we carry).
These tests never import torch or megatron: they run the tool's command line as a user does, in this process
(`cli`), or in a process of its own where a test signals or kills it.
"""

import base64
import hashlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest
from unidiff import PatchSet

from maintain.repo import FIXED_FILE as FIXED
from maintain.repo import REPO, UPSTREAM_TEST, patch_file, pins, release_lines
from maintain.repo import release as release_target
from maintain.upstreams import load
from mtp_mask_fix.cli import main as tool_main
from mtp_mask_fix.patch import Patch


PINNED = pins()["megatron-bridge"]
PATCH_FILE = patch_file(PINNED)
BACKPORT_FILE = patch_file(next(iter(release_lines())))  # the oldest line's


CONTEXT = '        "attention_mask": attention_mask,\n'  # a context line of the source hunk
REGION_EDIT = '        "attention_mask": attention_mask,  # local tweak\n'
LABELS = '        "labels": labels,\n    }\n'
EQUIVALENT_FIX = '        "labels": labels,\n        "loss_mask": loss_mask,\n    }\n'
FAR_FROM_HUNK = "import logging\n"  # line 15; the hunk sits at ~436

UPSTREAM_AUTHOR = ("Upstream Dev", "upstream@example.org")
SUBMITTER = ("Ada Submitter", "ada@example.org")


@dataclass
class Tree:
    """A throwaway target: its root, its kind ("installed", "tree" or "git") and the gpt_step.py in it."""

    root: Path
    kind: str

    @property
    def gpt_step(self) -> Path:
        return self.root / (FIXED if self.kind != "installed" else FIXED.removeprefix("src/"))

    @property
    def upstream_test(self) -> Path:
        return self.root / UPSTREAM_TEST


# --- the carried patch and the upstream files it is applied to ------------------------------------


@pytest.fixture(scope="session")
def patch() -> Patch:
    """The committed patch, first in patches/series."""
    return load()


@pytest.fixture(scope="session")
def release():
    """The pinned PyPI release as a site-packages-shaped Target (downloaded once into .work/pypi/)."""
    return release_target(PINNED)


@pytest.fixture(scope="session")
def release_gpt_step(release) -> str:
    """The release's gpt_step.py, unpatched."""
    return release.fixed_file.read_text()


@pytest.fixture(scope="session")
def patched_gpt_step(patch, release, tmp_path_factory) -> str:
    """The release's gpt_step.py with the patch applied (built aside: the view src/ is never rewritten here)."""
    from maintain.trees import materialise

    tree = materialise(release.root, tmp_path_factory.mktemp("patched") / "tree", patch, src=True)
    return (tree / FIXED.removeprefix("src/")).read_text()


@pytest.fixture(scope="session")
def upstream_test_text(patch) -> str:
    """upstream's test_gpt_step.py as far as we carry it: each hunk's old lines at their line numbers, filler
    lines between them."""
    lines = []
    for hunk in next(f for f in patch.files if f.path == UPSTREAM_TEST):
        lines += [f"# upstream line {n} (not carried here)\n" for n in range(len(lines) + 1, hunk.source_start)]
        lines += [line.value for line in hunk if line.is_context or line.is_removed]
    return "".join(lines)


# --- running the tool and git as a user would -------------------------------------------------------


@pytest.fixture
def home(tmp_path) -> Path:
    """An empty HOME, so that no global git config (identity, hooks, signing) leaks in."""
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def tool_env(home) -> dict:
    """The environment the tool runs in: isolated git config, no inherited git identity or repo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k == "GIT_SSL_CAINFO"}
    env.update(HOME=str(home), GIT_CONFIG_NOSYSTEM="1", XDG_CONFIG_HOME=str(home / ".config"))
    return env


@pytest.fixture
def cli(tool_env, tmp_path, monkeypatch):
    """Run `mtp-mask-fix ARGS` from tmp_path (or cwd) with `env` (or tool_env) as its whole environment, in this
    process (a start-up costs more than most commands) but `watch`, whose job prints too; returns what it exited with
    and printed, as subprocess.run."""

    def run(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
        if args[:1] == ("watch",):
            command = [sys.executable, "-m", "mtp_mask_fix", *map(str, args)]
            return subprocess.run(command, cwd=cwd or tmp_path, env=env or tool_env, capture_output=True, text=True)
        out, err, mask = io.StringIO(), io.StringIO(), signal.pthread_sigmask(signal.SIG_BLOCK, [])
        with monkeypatch.context() as patched, redirect_stdout(out), redirect_stderr(err):
            patched.chdir(cwd or tmp_path)
            for key in os.environ:
                patched.delenv(key)
            for key, value in (env or tool_env).items():
                patched.setenv(key, value)
            patched.setattr(tempfile, "tempdir", None)  # $TMPDIR as `env` says
            with pytest.raises(SystemExit) as done:
                tool_main(list(map(str, args)))
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # main() blocks signals as it exits
        return subprocess.CompletedProcess(args, done.value.code, out.getvalue(), err.getvalue())

    return run


@pytest.fixture
def maintain(tool_env):
    """Run `./run MODULE ARGS` of maintain/ (this repo's upkeep) as ./run does, from this checkout."""

    def run(module: str, *args) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", f"maintain.{module}", *map(str, args)]
        return subprocess.run(command, cwd=REPO, env=tool_env, capture_output=True, text=True, timeout=300)

    return run


@pytest.fixture
def branch(maintain):
    """`./run branch -- CHECKOUT NAME` (`--`: a NAME such as `-x` reaches git's check, not argparse's)."""
    return lambda root, name: maintain("branch", "--", root, name)


@pytest.fixture
def git(tool_env):
    """Run git in a directory as the upstream developer (`git -c` identity); returns stdout, raises on failure."""

    def run(cwd, *args, check=True) -> str:
        cmd = ["git", "-c", f"user.name={UPSTREAM_AUTHOR[0]}", "-c", f"user.email={UPSTREAM_AUTHOR[1]}", *args]
        result = subprocess.run(cmd, cwd=cwd, env=tool_env, capture_output=True, text=True)
        if check and result.returncode != 0:
            raise AssertionError(f"git {' '.join(args)} failed: {result.stderr}")
        return result.stdout

    return run


def digests(*roots: Path) -> dict[str, str]:
    """sha256 of every file under the given roots (relative path -> digest, file mode included); links not followed."""
    found = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if path.is_file() and not path.is_symlink():
                found[str(path)] = hashlib.sha256(path.read_bytes() + oct(path.stat().st_mode).encode()).hexdigest()
    return found


@pytest.fixture
def snapshot():
    """digests(*roots), for the tests to compare a target before and after."""
    return digests


@pytest.fixture
def refused():
    """Assert the tool refused the way every refusal must: one `mtp-mask-fix: error:` line, the exit code."""

    def check(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
        assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("mtp-mask-fix: error: "), lines[0]
        for word in words:
            assert word in lines[0]
        return lines[0]

    return check


# --- targets ------------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def record(root: Path) -> None:
    """Write the RECORD a wheel installs beside its files: each file under megatron/ with its sha256 and size."""
    rows = []
    for path in sorted((root / "megatron").rglob("*.py")):
        data = path.read_bytes()
        sha = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
        rows.append(f"{path.relative_to(root)},sha256={sha},{len(data)}\n")
    _write(root / f"megatron_bridge-{PINNED}.dist-info" / "RECORD", "".join(rows))


@pytest.fixture
def site_packages(tmp_path, release_gpt_step) -> Tree:
    """A site-packages-shaped directory holding megatron/bridge/training/gpt_step.py and its wheel's RECORD."""
    tree = Tree(tmp_path / "site-packages", "installed")
    for package in ("megatron/bridge", "megatron/bridge/training"):
        _write(tree.root / package / "__init__.py", "")
    _write(tree.gpt_step, release_gpt_step)
    record(tree.root)
    return tree


@pytest.fixture
def source_tree(tmp_path, release_gpt_step, upstream_test_text) -> Tree:
    """A plain source tree without .git: src/megatron/bridge/... and upstream's test_gpt_step.py."""
    tree = Tree(tmp_path / "Megatron-Bridge-src", "tree")
    _write(tree.gpt_step, release_gpt_step)
    _write(tree.upstream_test, upstream_test_text)
    return tree


@pytest.fixture
def checkout(tmp_path, release_gpt_step, upstream_test_text, git) -> Tree:
    """A git checkout of "upstream" on branch main: one commit with gpt_step.py and test_gpt_step.py."""
    tree = Tree(tmp_path / "Megatron-Bridge", "git")
    _write(tree.gpt_step, release_gpt_step)
    _write(tree.upstream_test, upstream_test_text)
    _write(tree.root / "README.md", "Megatron-Bridge (throwaway test checkout)\n")
    git(tree.root, "init", "--quiet", "--initial-branch=main")
    git(tree.root, "add", "-A")
    git(tree.root, "commit", "--quiet", "-m", "upstream base")
    return tree


@pytest.fixture(params=["installed", "tree", "git"])
def target(request) -> Tree:
    """Each kind of target in turn: site-packages dir, plain source tree, git checkout."""
    return request.getfixturevalue(
        {"installed": "site_packages", "tree": "source_tree", "git": "checkout"}[request.param]
    )


@pytest.fixture
def edit(git):
    """Replace one exact snippet in a target file as upstream would (a commit; installed: another release's RECORD), or
    as a local edit (`commit=False`)."""

    def change(tree: Tree, path: Path, old: str, new: str, *, commit: bool = True) -> None:
        text = path.read_text()
        assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {path}"
        path.write_text(text.replace(old, new))
        if tree.kind == "git" and commit:
            git(tree.root, "commit", "--quiet", "-am", f"upstream edits {path.name}")
        if tree.kind == "installed" and commit:
            record(tree.root)

    return change


@pytest.fixture
def repo_file():
    """A file of this repository, as bytes."""
    return lambda rel: (REPO / rel).read_bytes()


# --- verdicts, interpreters and a paused apply ---------------------------------------------------------------------


def verdict(result: subprocess.CompletedProcess, code: int) -> str:
    """`check` prints its verdict as one line on stdout, nothing on stderr, and exits with the state's code."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return lines[0]


def fake_python(tmp_path: Path, name: str, body: str) -> Path:
    """An executable standing in for an interpreter: a shell script with `body`."""
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def probe_says(delivered: bool = True, reason: str = "fake probe") -> str:
    """A shell line that prints what the probe prints, of the gpt_step.py where it runs (its folder, as the probe's)."""
    said = (
        '{"file": "%s/megatron/bridge/training/gpt_step.py", "delivered": '
        + f'{str(delivered).lower()}, "reason": "{reason}"}}'
    )
    return f"printf '{said}\\n' \"$PWD\""


@pytest.fixture
def probe_ok(tmp_path):
    """An interpreter whose probe finds the fix at once (the behaviour probe itself is tested in test_verify.py)."""
    return lambda *, seconds=0: fake_python(tmp_path, "python-ok", f"sleep {seconds}; {probe_says()}")


def start_paused(tool_env, tmp_path, phase, *args):
    """Start the tool's `ARGS` (apply or revert) and wait until it pauses at `phase` (tests/support/paused_apply.py);
    returns the process."""
    marker = tmp_path / f"paused-{phase}"
    env = dict(tool_env, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), tool_env.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.paused_apply", phase, str(marker), *map(str, args)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait_until(marker.exists, proc), proc.communicate()
    return proc


def wait_until(done, proc: subprocess.Popen | None = None, *, timeout: float = 600) -> bool:
    """Whether `done()` came true before `proc` (if given) ended: polled, with a bound no loaded machine reaches."""
    deadline = time.monotonic() + timeout
    while not done() and (proc is None or proc.poll() is None) and time.monotonic() < deadline:
        time.sleep(0.05)
    return done()


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
