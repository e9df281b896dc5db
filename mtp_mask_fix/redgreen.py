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
from dataclasses import dataclass, field
from pathlib import Path

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


def run_pytest(args: list[str], *, cwd: Path = REPO, env: dict[str, str] | None = None) -> Run:
    """Run pytest in a fresh process (each selects its gpt_step.py before importing Bridge)."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as handle:
        outcomes_file = handle.name
    full_env = dict(os.environ, **(env or {}), MTP_FIX_OUTCOMES=outcomes_file)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (full_env.get("PYTHONPATH"), str(REPO)) if p)
    cmd = [sys.executable, "-m", "pytest", "-p", "mtp_mask_fix.harness.pytest_plugin", "-q", "-p", "no:cacheprovider"]
    start = time.monotonic()
    result = subprocess.run([*cmd, *args], cwd=cwd, env=full_env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    outcomes, files = {}, set()
    for line in Path(outcomes_file).read_text().splitlines():
        entry = json.loads(line)
        outcomes[entry["nodeid"]] = entry["outcome"]
        if entry["gpt_step"]:
            files.add(entry["gpt_step"])
    os.unlink(outcomes_file)
    return Run(outcomes, files, seconds, result.stdout + result.stderr)


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
