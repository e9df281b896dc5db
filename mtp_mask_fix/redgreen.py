"""FAIL_TO_PASS / PASS_TO_PASS: the manifest, pytest sessions that record outcomes, and the contract between them.

Each session chooses its code under test the one way this repo knows: a tree first on the import path
(`-o pythonpath=TREE`). Sessions are forked from one warm process (warm_pytest), two at a time.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.outcome import Outcome
from mtp_mask_fix.patch import REPO


MANIFEST = REPO / "tests" / "red_green.toml"


@dataclass(frozen=True)
class Manifest:
    """Test ids per suite ([unit], [functional]): which must go red on the base, which must stay green."""

    fail_to_pass: dict[str, list[str]]
    pass_to_pass: dict[str, list[str]]

    @classmethod
    def load(cls, path: Path = MANIFEST) -> "Manifest":
        data = tomllib.loads(path.read_text())
        return cls(
            {suite: body.get("fail_to_pass", []) for suite, body in data.items()},
            {suite: body.get("pass_to_pass", []) for suite, body in data.items()},
        )


@dataclass(frozen=True)
class Job:
    """One pytest session: its arguments, the tree first on its import path, and where it runs."""

    args: tuple[str, ...]
    tree: Path
    cwd: Path = REPO


@dataclass
class Run:
    """One finished session: the outcome of each test, the gpt_step.py files it imported, its wall time, its log."""

    outcomes: dict[str, Outcome]
    gpt_step_files: set[str]
    seconds: float
    log: str = field(repr=False, default="")

    def of(self, nodeid: str) -> Outcome:
        return self.outcomes.get(nodeid, Outcome.MISSING)

    def collection_errors(self) -> list[str]:
        """Each collection error with the last `E` line pytest printed for it (e.g. the ImportError)."""
        reasons = re.findall(r"^E\s+(.+)$", self.log, re.M)
        return [
            f"{n}: {reasons[-1] if reasons else 'collection error'}"
            for n, o in self.outcomes.items()
            if o == Outcome.COLLECTION_ERROR
        ]


PYTEST = ("-p", "mtp_mask_fix.harness.recorder", "-p", "no:cacheprovider", "-q")


def run_many(jobs: list[Job], python: str = sys.executable) -> list[Run]:
    """Run the jobs from one warm `python` process that forks a child per job (harness/warm_pytest.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        specs = [
            {"args": [*PYTEST, "-o", f"pythonpath={job.tree}", *job.args], "cwd": str(job.cwd), "out": f"{tmp}/{i}"}
            for i, job in enumerate(jobs)
        ]
        runner = subprocess.run(
            [python, "-m", "mtp_mask_fix.harness.warm_pytest"],
            input=json.dumps(specs),
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        seconds = {done["job"]: done["seconds"] for done in map(json.loads, runner.stdout.splitlines())}
        if runner.returncode != 0 or len(seconds) != len(jobs):
            raise ToolError(
                f"the pytest runner failed: {(runner.stderr.strip().splitlines() or ['?'])[-1]}", Exit.FAILED
            )
        runs = [_read(Path(spec["out"]), seconds[i]) for i, spec in enumerate(specs)]
    for job, run in zip(jobs, runs):
        stray = {
            f for f in run.gpt_step_files if not Path(os.path.abspath(f)).is_relative_to(os.path.abspath(job.tree))
        }
        if stray:  # the one guarantee every red/green verdict rests on
            raise ToolError(f"a session meant to test {job.tree} imported {sorted(stray)}", Exit.FAILED)
    return runs


def _read(out: Path, seconds: float) -> Run:
    outcomes = out.with_suffix(".jsonl")
    entries = [json.loads(line) for line in outcomes.read_text().splitlines()] if outcomes.exists() else []
    found = {e["nodeid"]: Outcome(e["outcome"]) for e in entries}
    return Run(
        found,
        {e["gpt_step"] for e in entries if e["gpt_step"]},
        seconds,
        out.with_suffix(".log").read_text(errors="replace"),
    )


def problems(base: Run, patched: Run, fail_to_pass: list[str], pass_to_pass: list[str]) -> list[str]:
    """Everything that breaks the red/green contract; empty means it holds."""
    found = [
        f"{side}: {error}" for side, run in (("base", base), ("patched", patched)) for error in run.collection_errors()
    ]
    if found:  # every test id would read "did not run"; the collection error says why
        return found
    found += [
        f"patched: {n} {patched.of(n).value}" for n in fail_to_pass + pass_to_pass if patched.of(n) != Outcome.PASSED
    ]
    found += [
        f"base: {n} {base.of(n).value}, not by assertion" for n in fail_to_pass if base.of(n) != Outcome.ASSERTION
    ]
    return found + [f"base: {n} {base.of(n).value}" for n in pass_to_pass if base.of(n) != Outcome.PASSED]
