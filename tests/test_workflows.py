"""The GitHub Actions files are valid and safe: each workflow against check-jsonschema's vendored GitHub workflow
schema and the composite action against its action schema, and zizmor's audit (offline: template injection,
credentials left in checkouts, unpinned actions, ...) over .github/ and action.yml, with no finding."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from maintain.repo import REPO


pytestmark = pytest.mark.slow


WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
ZIZMOR = Path(sys.executable).parent / "zizmor"


def schema(name: str, *files: Path) -> subprocess.CompletedProcess:
    check = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", f"vendor.{name}", *map(str, files)]
    return subprocess.run(check, capture_output=True, text=True)


def zizmor(*paths: Path) -> list[str]:
    """The audits zizmor finds failing in `paths` (its JSON report: plain text is coloured where CI is set)."""
    done = subprocess.run([ZIZMOR, "--offline", "--format", "json", *map(str, paths)], capture_output=True, text=True)
    assert done.stdout.strip(), done.stderr  # a report, [] when it finds nothing
    return [f"{finding['ident']}: {finding['desc']}" for finding in json.loads(done.stdout)]


def test_there_are_workflows():
    assert {path.name for path in WORKFLOWS} >= {"ci.yml", "nightly.yml"}


def test_workflows_match_the_schema():
    done = schema("github-workflows", *WORKFLOWS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_composite_action_matches_the_schema():
    done = schema("github-actions", REPO / "action.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_zizmor_finds_nothing():
    assert zizmor(REPO / ".github", REPO / "action.yml") == []


def test_the_readmes_workflow_block_passes_both_checks(tmp_path):
    """The job README.md offers to paste into another repo is a workflow too."""
    (block,) = [
        b for b in re.findall(r"^```yaml\n(.*?)^```$", (REPO / "README.md").read_text(), re.M | re.S) if "jobs:" in b
    ]
    (tmp_path / "readme.yml").write_text(block)
    done = schema("github-workflows", tmp_path / "readme.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert zizmor(tmp_path / "readme.yml") == []


@pytest.mark.parametrize(
    ("mistake", "caught_by"),
    [
        ("      - runs: echo\n", "schema"),  # a misspelt key
        ('      - run: echo "${{ github.event.pull_request.title }}"\n', "zizmor"),  # untrusted input in a script
    ],
)
def test_each_check_can_fail(tmp_path, mistake, caught_by):
    """Each check finds what it is there for, in a workflow otherwise clean by both."""
    steps = "    steps:\n      - uses: actions/checkout@11bd71901bbe5b1630ceea73d27597364c9af683 # v4.2.2\n"
    steps += "        with:\n          persist-credentials: false\n"
    head = "on: pull_request\npermissions: {}\njobs:\n  x:\n    runs-on: ubuntu-22.04\n"
    clean, broken = tmp_path / "clean.yml", tmp_path / "broken.yml"
    clean.write_text(head + steps)
    broken.write_text(head + steps + mistake)
    assert schema("github-workflows", clean).returncode == 0 and zizmor(clean) == []
    if caught_by == "schema":
        assert schema("github-workflows", broken).returncode != 0
    else:
        assert [finding.partition(":")[0] for finding in zizmor(broken)] == ["template-injection"]


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
