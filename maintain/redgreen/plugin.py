"""Red/green's pytest plugin: each test's outcome, recorded for the client in the file `--outcomes` names."""

import json
import re
import sys

import pytest

from maintain.redgreen.contract import GPT_STEP_MODULE, Outcome


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
