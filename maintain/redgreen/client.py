"""Red/green's client: it asks the runner, in the interpreter under test, for sessions and reads what they recorded."""

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from maintain.redgreen.contract import GPT_STEP_MODULE, Outcome, Run
from maintain.repo import REPO
from mtp_mask_fix.errors import Exit, ToolError


@dataclass(frozen=True)
class Job:
    """One pytest session: its arguments, the tree first on its import path, where it runs, and the patch's module."""

    args: tuple[str, ...]
    tree: Path
    cwd: Path = REPO
    module: str = GPT_STEP_MODULE


def start_runner(python: str = sys.executable, bridge_tree: Path | None = None) -> subprocess.Popen:
    """The runner (`-m maintain.redgreen.runner`), waiting for its jobs on stdin; warm from `bridge_tree` meanwhile."""
    command = [python, "-m", "maintain.redgreen.runner", *([str(bridge_tree)] if bridge_tree else [])]
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.Popen(command, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), **pipes)


def run_many(jobs: list[Job], python: str = sys.executable, runner: subprocess.Popen | None = None) -> list[Run]:
    """Run the jobs' sessions, forked from one warm runner; each must import its module from its own tree."""
    runner = runner or start_runner(python)
    with tempfile.TemporaryDirectory() as tmp:
        sessions = [{"out": f"{tmp}/{i}", **asdict(job)} for i, job in enumerate(jobs)]  # a job and its record's file
        _, stderr = runner.communicate(json.dumps(sessions, default=str))  # as JSON on stdin, its paths as text
        if runner.returncode != 0:
            why = (stderr.strip().splitlines() or ["?"])[-1]
            raise ToolError(f"the pytest runner failed: {why}", Exit.FAILED)
        runs = [read_run(Path(session["out"])) for session in sessions]
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
