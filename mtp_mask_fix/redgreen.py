"""FAIL_TO_PASS / PASS_TO_PASS: pytest sessions that record outcomes, and the contract between them.

FAIL_TO_PASS are the tests marked `@pytest.mark.fail_to_pass` (the one place that says so); every other test of a
session is PASS_TO_PASS.

Each session chooses its code under test the one way this repo knows: a tree first on the import path
(`-o pythonpath=TREE`). Sessions are forked from one warm process (warm_pytest), two at a time.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.paths import REPO, is_gpt_step_of


class Outcome(Enum):
    """How one test ended. Only ASSERTION counts as red (SWE-bench's rule): an import or collection error, a failed
    setup, another exception or a skip never proves that a test catches the bug."""

    PASSED = "passed"
    ASSERTION = "failed by assertion"
    OTHER_FAILURE = "failed by another exception"
    SETUP_ERROR = "error in setup"
    SKIPPED = "skipped"
    COLLECTION_ERROR = "collection error"
    MISSING = "did not run"  # never recorded: what a run reports for a test it did not see


@dataclass(frozen=True)
class Job:
    """One pytest session: its arguments, the tree first on its import path, and where it runs."""

    args: tuple[str, ...]
    tree: Path
    cwd: Path = REPO


@dataclass
class Run:
    """One finished session: the outcome of each test, which are marked `fail_to_pass`, the gpt_step.py files it
    imported, and its log."""

    outcomes: dict[str, Outcome]
    marked: set[str]
    gpt_step_files: set[str]
    log: str = field(repr=False, default="")

    def split(self) -> tuple[list[str], list[str]]:
        """(FAIL_TO_PASS, PASS_TO_PASS): the tests marked `fail_to_pass`, and every other test this session ran."""
        return [n for n in self.outcomes if n in self.marked], [n for n in self.outcomes if n not in self.marked]

    def of(self, nodeid: str) -> Outcome:
        return self.outcomes.get(nodeid, Outcome.MISSING)

    def collection_errors(self) -> list[str]:
        """Each collection error with the last `E` line pytest printed (e.g. the ImportError)."""
        reason = (re.findall(r"^E\s+(.+)$", self.log, re.M) or ["collection error"])[-1]
        return [f"{nodeid}: {reason}" for nodeid, o in self.outcomes.items() if o == Outcome.COLLECTION_ERROR]


PYTEST = ("-p", "mtp_mask_fix.recorder", "-p", "no:cacheprovider", "-q")
# What every session under test imports before megatron.bridge, whatever the tree: imported once, before the fork.
WARM = ("megatron.core", "megatron.training", "modelopt.torch.distill", "transformers")


def run_many(jobs: list[Job], python: str = sys.executable) -> list[Run]:
    """Run the jobs from one warm `python` process that forks a child per job (warm_pytest.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / str(index) for index in range(len(jobs))]
        specs = [
            {"args": [*PYTEST, "-o", f"pythonpath={job.tree}", *job.args], "cwd": str(job.cwd), "out": str(out)}
            for job, out in zip(jobs, outs)
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        warm = [python, "-m", "mtp_mask_fix.warm_pytest"]
        stdin = json.dumps({"warm": WARM, "jobs": specs})
        runner = subprocess.run(warm, input=stdin, capture_output=True, text=True, env=env)
        if runner.returncode != 0:
            raise ToolError(
                f"the pytest runner failed: {(runner.stderr.strip().splitlines() or ['?'])[-1]}", Exit.FAILED
            )
        runs = [_read(out) for out in outs]
    for job, run in zip(jobs, runs):
        stray = {f for f in run.gpt_step_files if not is_gpt_step_of(f, job.tree)}
        if stray:  # the one guarantee every red/green verdict rests on
            raise ToolError(f"a session meant to test {job.tree} imported {sorted(stray)}", Exit.FAILED)
    return runs


def _read(out: Path) -> Run:
    recorded = out.with_suffix(".jsonl")
    entries = [json.loads(line) for line in recorded.read_text().splitlines()] if recorded.exists() else []
    log = out.with_suffix(".log").read_text(errors="replace")
    return Run(
        {e["nodeid"]: Outcome(e["outcome"]) for e in entries},
        {e["nodeid"] for e in entries if e["fail_to_pass"]},
        {e["gpt_step"] for e in entries if e["gpt_step"]},
        log,
    )


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
