"""pytest plugin the red/green runner loads (`-p mtp_mask_fix.recorder`): one JSON line per test into the file
MTP_FIX_OUTCOMES names, with its Outcome (an assertion failure told apart from any other error), whether it is marked
`fail_to_pass`, and the gpt_step.py the session really imported."""

import json
import os
import sys

import pytest

from mtp_mask_fix.paths import GPT_STEP_MODULE
from mtp_mask_fix.redgreen import Outcome


def _record(nodeid: str, outcome: Outcome, fail_to_pass: bool = False) -> None:
    with open(os.environ["MTP_FIX_OUTCOMES"], "a") as handle:
        module = sys.modules.get(GPT_STEP_MODULE)
        entry = {"nodeid": nodeid, "outcome": outcome.value, "gpt_step": getattr(module, "__file__", None)}
        handle.write(json.dumps(entry | {"fail_to_pass": fail_to_pass}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The outcome of each test body, or of its failed setup."""
    report = (yield).get_result()
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.passed:
            outcome = Outcome.PASSED
        elif report.skipped:
            outcome = Outcome.SKIPPED
        elif report.when == "setup":
            outcome = Outcome.SETUP_ERROR
        elif call.excinfo.errisinstance(AssertionError):
            outcome = Outcome.ASSERTION
        else:
            outcome = Outcome.OTHER_FAILURE
        _record(item.nodeid, outcome, item.get_closest_marker("fail_to_pass") is not None)


def pytest_collectreport(report):
    """A module that fails to import or collect."""
    if report.failed:
        _record(report.nodeid, Outcome.COLLECTION_ERROR)
