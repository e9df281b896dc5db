"""pytest plugin (loaded with `-p mtp_mask_fix.harness.pytest_plugin`; pyproject adds it here).

1. CPU shims, before any test module imports megatron.bridge.
2. MTP_FIX_GPT_STEP selects the gpt_step.py under test (see cpu_shims.gpt_step_under_test).
3. MTP_FIX_OUTCOMES=FILE records each test's outcome as JSON lines, telling an assertion failure from any
   other error, and which gpt_step.py file was really exercised.
"""

import json
import os
import sys

import pytest

from mtp_mask_fix.harness import cpu_shims


cpu_shims.install()
cpu_shims.select_gpt_step(cpu_shims.gpt_step_under_test())


def _record(entry: dict) -> None:
    path = os.environ.get("MTP_FIX_OUTCOMES")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(entry) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Record the outcome of each test body (or of its failed setup)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.passed:
            result = "passed"
        elif report.skipped:
            result = "skipped"
        elif report.when == "setup":
            result = f"error:{call.excinfo.typename}"
        elif call.excinfo.errisinstance(AssertionError):
            result = "assertion"
        else:
            result = f"failed:{call.excinfo.typename}"
        module = sys.modules.get(cpu_shims.GPT_STEP_MODULE)
        _record({"nodeid": item.nodeid, "outcome": result, "gpt_step": getattr(module, "__file__", None)})


def pytest_collectreport(report):
    """Record a collection error with its last `E` line (e.g. an ImportError)."""
    if report.failed:
        reason = [line for line in report.longreprtext.splitlines() if line.startswith("E ")][-1:] or ["?"]
        _record({"nodeid": report.nodeid, "outcome": f"error:collection: {reason[0][1:].strip()}", "gpt_step": None})
