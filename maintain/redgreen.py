"""Red/green: its contract (Outcome, Run, problems), and the runner and pytest plugin that measure it.

`run_many` runs `python -m maintain.redgreen` in the interpreter under test (`start_runner` may start it before the
jobs are known), which imports the third-party stack and the first tree's megatron.bridge once (or the tree it was
started with), then forks a pytest session per job with that job's tree first on the import path. A forked session
keeps the warm megatron.bridge only where each of its modules is the same file in its own tree: it saves the push tier
about a third of the wrong fixes' CPU time (CONTRIBUTING.md). Megatron-LM's trees hold megatron.core itself, which that
stack would import from the environment: their sessions start warm with torch alone.
"""

import importlib.util
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import pytest

from maintain.repo import REPO
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.paths import GPT_STEP_MODULE


PYTEST = ("-p", "maintain.redgreen", "-p", "no:cacheprovider", "-q", "-o", "addopts=", "--strict-markers")
# What every session under test imports before megatron.bridge, whatever the tree: imported once, before the fork.
WARM = ("megatron.core", "megatron.training", "modelopt.torch.distill", "transformers")


class Outcome(Enum):
    """How a test ended. Only ASSERTION is red (SWE-bench's rule): no other failure proves a test catches the bug."""

    PASSED = "passed"
    ASSERTION = "failed by assertion"
    OTHER_FAILURE = "failed by another exception"
    SETUP_ERROR = "error in setup"
    SKIPPED = "skipped"
    COLLECTION_ERROR = "collection error"
    MISSING = "did not run"  # never recorded: what a run reports for a test it did not see


@dataclass(frozen=True)
class Job:
    """One pytest session: its arguments, the tree first on its import path, where it runs, and the patch's module."""

    args: tuple[str, ...]
    tree: Path
    cwd: Path = REPO
    module: str = GPT_STEP_MODULE


@dataclass
class Run:
    """One finished session: each test's outcome, those marked `fail_to_pass`, and which files of its module it imported."""

    outcomes: dict[str, Outcome]
    marked: set[str]
    module_files: set[str]
    # A collection error's last `E` line; a test's record_property("reason").
    reasons: dict[str, str] = field(default_factory=dict)

    def of(self, nodeid: str) -> Outcome:
        return self.outcomes.get(nodeid, Outcome.MISSING)

    def collection_errors(self) -> list[str]:
        found = [n for n, outcome in self.outcomes.items() if outcome == Outcome.COLLECTION_ERROR]
        return [f"{n}: {self.reasons.get(n, 'collection error')}" for n in found]


def problems(base: Run, patched: Run, fail_to_pass: list[str], pass_to_pass: list[str]) -> list[str]:
    """Everything that breaks the red/green contract; empty means it holds."""
    found = [f"{side}: {e}" for side, run in (("base", base), ("patched", patched)) for e in run.collection_errors()]
    if found:  # every test id would read "did not run"; the collection error says why
        return found

    def unlike(run: Run, side: str, nodeids: list[str], want: Outcome, note: str = "") -> list[str]:
        return [f"{side}: {n} {run.of(n).value}{note}" for n in nodeids if run.of(n) != want]

    return (
        unlike(patched, "patched", fail_to_pass + pass_to_pass, Outcome.PASSED)
        + unlike(base, "base", fail_to_pass, Outcome.ASSERTION, ", not by assertion")
        + unlike(base, "base", pass_to_pass, Outcome.PASSED)
    )


def start_runner(python: str = sys.executable, bridge_tree: Path | None = None) -> subprocess.Popen:
    """The runner, `python -m maintain.redgreen`, waiting for its jobs on stdin; warm from `bridge_tree` meanwhile."""
    command = [python, "-m", "maintain.redgreen", *([str(bridge_tree)] if bridge_tree else [])]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.Popen(command, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), **pipes)


def run_many(jobs: list[Job], python: str = sys.executable, runner: subprocess.Popen | None = None) -> list[Run]:
    """Run the jobs' sessions, forked from one warm runner; each must import its module from its own tree."""
    runner = runner or start_runner(python)
    with tempfile.TemporaryDirectory() as tmp:
        specs = [(f"{tmp}/{i}", str(job.tree), job.args, str(job.cwd), job.module) for i, job in enumerate(jobs)]
        _, stderr = runner.communicate(json.dumps(specs))  # the specs as JSON on stdin
        if runner.returncode != 0:
            why = (stderr.strip().splitlines() or ["?"])[-1]
            raise ToolError(f"the pytest runner failed: {why}", Exit.FAILED)
        runs = [read_run(Path(out)) for out, *_ in specs]
    for job, run in zip(jobs, runs):
        own = os.path.abspath(job.tree / (job.module.replace(".", "/") + ".py"))  # by path: the rest may be links
        if stray := {f for f in run.module_files if os.path.abspath(f) != own}:  # what every verdict rests on
            raise ToolError(f"a session meant to test {job.tree} imported {sorted(stray)}", Exit.FAILED)
    return runs


def read_run(out: Path, under: str = "") -> Run:
    """One session's records of the tests under `under` (none if it was killed before it began)."""
    entries = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    entries = [e for e in entries if e["nodeid"].startswith(under)]
    return Run(
        {e["nodeid"]: Outcome(e["outcome"]) for e in entries},
        {e["nodeid"] for e in entries if e["fail_to_pass"]},
        {e["module"] for e in entries if e["module"]},
        {e["nodeid"]: e["reason"] for e in entries if "reason" in e},
    )


CONFIG = []  # the session's pytest config, once it is configured


def pytest_addoption(parser):
    """Plugin: the file a session records its outcomes in, and the module whose file each record names."""
    parser.addoption("--outcomes", metavar="FILE", help="record each test's outcome in FILE (JSON lines)")
    parser.addoption("--outcomes-module", metavar="MODULE", default=GPT_STEP_MODULE, help="the module it changes")


def pytest_configure(config):
    """Plugin: the session's config, for `--outcomes`."""
    CONFIG[:] = [config]


def _record(nodeid: str, outcome: Outcome, **more) -> None:
    module = getattr(sys.modules.get(CONFIG[0].getoption("outcomes_module")), "__file__", None)
    entry = {"nodeid": nodeid, "outcome": outcome.value, "module": module, "fail_to_pass": False} | more
    with open(CONFIG[0].getoption("outcomes"), "a") as handle:
        handle.write(json.dumps(entry) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Plugin: the outcome of each test body, or of its failed setup."""
    report = (yield).get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.passed or report.skipped:
            outcome = Outcome.PASSED if report.passed else Outcome.SKIPPED
        elif report.when == "setup":
            outcome = Outcome.SETUP_ERROR
        else:
            outcome = Outcome.ASSERTION if call.excinfo.errisinstance(AssertionError) else Outcome.OTHER_FAILURE
        reason = {key: value for key, value in item.user_properties if key == "reason"}  # record_property's
        _record(item.nodeid, outcome, fail_to_pass=item.get_closest_marker("fail_to_pass") is not None, **reason)


def pytest_collectreport(report):
    """Plugin: a module that fails to import or collect, and why."""
    if report.failed:
        reason = (re.findall(r"^E\s+(.+)$", report.longreprtext, re.M) or ["collection error"])[-1]
        _record(report.nodeid, Outcome.COLLECTION_ERROR, reason=reason)


def _bridge() -> list[str]:
    return [name for name in sys.modules if name.split(".")[:2] == ["megatron", "bridge"]]


def _drop_bridge() -> None:
    """No megatron.bridge at all: out of sys.modules and off `megatron` (`from megatron import bridge` reads that)."""
    for name in _bridge():
        del sys.modules[name]
    if hasattr(sys.modules.get("megatron"), "bridge"):
        del sys.modules["megatron"].bridge


def _warm_bridge(tree: str) -> None:
    """Import megatron.bridge from `tree` once, or none where that fails or imports gpt_step (each session's own)."""
    sys.path.insert(0, tree)
    try:
        importlib.import_module("megatron.bridge")
        shared = GPT_STEP_MODULE not in sys.modules
    except Exception:
        shared = False
    sys.path.remove(tree)
    if not shared:
        _drop_bridge()


def _adopt_bridge(tree: str, warmed: str) -> None:
    """Keep the warm megatron.bridge, searched in `tree`, where each module is the same file there; else drop it."""
    tree, found = os.path.abspath(tree), {}  # absolute: the session changes directory before it imports
    for module in map(sys.modules.get, _bridge()):
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
        mine = os.path.join(tree, os.path.relpath(where, warmed)) if where else None
        if not (mine and os.path.exists(mine) and os.path.samefile(mine, where)):
            _drop_bridge()
            return
        found[module] = mine
    for module, mine in found.items():
        if hasattr(module, "__path__"):  # a package: its own directory there, or a namespace package's
            module.__path__ = [os.path.dirname(mine) if getattr(module, "__file__", None) else mine]


def _session(out: str, tree: str, args: list[str], cwd: str, module: str, warmed: str) -> None:
    _adopt_bridge(tree, warmed)
    os.chdir(cwd)
    Path(out).touch()  # a session that records nothing still leaves its file
    pytest.main([*PYTEST, "-o", f"pythonpath={tree}", f"--outcomes={out}", f"--outcomes-module={module}", *args])


if __name__ == "__main__":  # the runner: each [out, tree, args, cwd, module] on stdin is one session, in a fork
    early = sys.argv[1:2]  # a Megatron-Bridge tree to warm from before the specs come; its sessions test that module
    specs = [] if early else json.loads(sys.stdin.read() or "[]")  # nothing: the suite that started it has ended
    bridge = all(spec[4] == GPT_STEP_MODULE for spec in specs)
    for module in WARM if bridge else ("torch",):  # what the environment lacks is skipped (core < 0.17: no training)
        if importlib.util.find_spec(module.split(".")[0]) and importlib.util.find_spec(module):
            importlib.import_module(module)
    warmed = (early or [spec[1] for spec in specs] or [None])[0]
    if warmed and bridge:
        _warm_bridge(warmed)
    specs = json.loads(sys.stdin.read() or "[]") if early else specs
    parallel = os.cpu_count() or 1
    fork = multiprocessing.get_context("fork")  # not a Pool: it waits forever on a worker that died
    pending, running = [fork.Process(target=_session, args=(*spec, warmed)) for spec in specs], []
    while pending or running:  # a session that dies (os._exit, a signal) ends there: its tests read "did not run"
        while pending and len(running) < parallel:
            running.append(pending.pop(0))
            running[-1].start()
        multiprocessing.connection.wait([process.sentinel for process in running])
        running = [process for process in running if process.is_alive()]
