"""FAIL_TO_PASS / PASS_TO_PASS: the manifest, a pytest run that records outcomes, and the verdicts.

A FAIL_TO_PASS test counts as red only when it fails by an AssertionError in the test body; an import
error, a collection error, a fixture error or a skip never does (SWE-bench's rule).
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mtp_mask_fix.errors import FAILED, ToolError
from mtp_mask_fix.patch import REPO


MANIFEST = REPO / "tests" / "red_green.toml"


@dataclass
class Manifest:
    """Test ids (relative to the repo root, or to an upstream tree for [upstream]) per suite."""

    fail_to_pass: dict[str, list[str]]
    pass_to_pass: dict[str, list[str]]

    @classmethod
    def load(cls, path: Path = MANIFEST) -> "Manifest":
        data = tomllib.loads(path.read_text())
        return cls(
            {suite: body.get("fail_to_pass", []) for suite, body in data.items()},
            {suite: body.get("pass_to_pass", []) for suite, body in data.items()},
        )


@dataclass
class Run:
    """One pytest process: outcome per node id, the gpt_step.py files it imported, and its wall time."""

    outcomes: dict[str, str]
    gpt_step_files: set[str]
    seconds: float
    output: str = field(repr=False, default="")


PYTEST_ARGS = ["-p", "mtp_mask_fix.harness.pytest_plugin", "-q", "-p", "no:cacheprovider"]


@dataclass
class Job:
    """One pytest session to run: its arguments, working directory and extra environment."""

    args: list[str]
    cwd: Path = REPO
    env: dict[str, str] = field(default_factory=dict)


def _session_env(env: dict[str, str], outcomes_file: str) -> dict[str, str]:
    merged = dict(env, MTP_FIX_OUTCOMES=outcomes_file)
    merged["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(REPO)) if p)
    return merged


def _read_run(outcomes_file: Path, seconds: float, output: str) -> Run:
    outcomes, files = {}, set()
    if outcomes_file.exists():
        for line in outcomes_file.read_text().splitlines():
            entry = json.loads(line)
            outcomes[entry["nodeid"]] = entry["outcome"]
            if entry["gpt_step"]:
                files.add(entry["gpt_step"])
    return Run(outcomes, files, seconds, output)


def run_pytest(args: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None) -> Run:
    """Run pytest in a fresh process (each selects its gpt_step.py before importing Bridge)."""
    with tempfile.TemporaryDirectory() as tmp:
        outcomes_file = Path(tmp) / "outcomes.jsonl"
        full_env = dict(os.environ, **_session_env(env or {}, str(outcomes_file)))
        start = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *args]
        result = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True)
        return _read_run(outcomes_file, time.monotonic() - start, result.stdout + result.stderr)


def run_many(
    jobs: list[Job], on_done: Callable[[int, Run], None] | None = None, python: str = sys.executable
) -> list[Run]:
    """Run the jobs from one warm `python` process that forks a child per job (see warm_pytest)."""
    with tempfile.TemporaryDirectory() as tmp:
        specs = [
            {
                "args": [*PYTEST_ARGS, *job.args],
                "cwd": str(job.cwd),
                "env": _session_env(job.env, f"{tmp}/{index}.jsonl"),
                "log": f"{tmp}/{index}.log",
            }
            for index, job in enumerate(jobs)
        ]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        runner = subprocess.Popen(
            [python, "-m", "mtp_mask_fix.warm_pytest"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        runner.stdin.write(json.dumps(specs))
        runner.stdin.close()
        runs: list[Run | None] = [None] * len(jobs)
        for line in runner.stdout:
            done = json.loads(line)
            index = done["job"]
            output = Path(specs[index]["log"]).read_text(errors="replace")
            runs[index] = _read_run(Path(specs[index]["env"]["MTP_FIX_OUTCOMES"]), done["seconds"], output)
            if on_done:
                on_done(index, runs[index])
        stderr = runner.stderr.read()
        if runner.wait() != 0 or any(run is None for run in runs):
            tail = (stderr.strip().splitlines() or ["no output"])[-1]
            raise ToolError(f"the pytest runner failed: {tail}", FAILED)
        return runs


def problems(base: Run | None, patched: Run, fail_to_pass: list[str], pass_to_pass: list[str]) -> list[str]:
    """Everything that breaks the red/green contract; empty means the contract holds."""
    found = [
        f"{side}: {nodeid} {outcome}"
        for side, run in (("base", base), ("patched", patched))
        if run is not None
        for nodeid, outcome in run.outcomes.items()
        if outcome.startswith("error:collection")
    ]
    if found:  # every test id would read "missing"; the collection error says why
        return found
    for nodeid in fail_to_pass + pass_to_pass:
        outcome = patched.outcomes.get(nodeid, "missing")
        if outcome != "passed":
            found.append(f"patched: {nodeid} {outcome}")
    if base is not None:
        for nodeid in fail_to_pass:
            outcome = base.outcomes.get(nodeid, "missing")
            if outcome != "assertion":
                found.append(f"base: {nodeid} {outcome}, expected an assertion failure")
        for nodeid in pass_to_pass:
            outcome = base.outcomes.get(nodeid, "missing")
            if outcome != "passed":
                found.append(f"base: {nodeid} {outcome}")
    return found


def still_red(run: Run, fail_to_pass: list[str]) -> bool:
    """Whether at least one FAIL_TO_PASS test fails by assertion (a needed hunk was left out)."""
    return any(run.outcomes.get(nodeid) == "assertion" for nodeid in fail_to_pass)
