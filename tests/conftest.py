"""The suite's tiers, its options, and the order and background sessions it runs with.

`./run test` is the push tier; `./run test --all` adds the tests marked `slow`. Every session records each test's
outcome (maintain.redgreen.plugin), so that red/green holds what this session measured on the view against a session on
the release as shipped. The sessions red/green and the wrong fixes need of other trees depend on nothing this session
does, so they run on the core the tool's tests leave idle: their runner starts before a whole tier is collected and
imports the pinned release meanwhile, and they start once the suite is collected.
"""

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from maintain.repo import WORK, pins, release
from tests.support import sessions


pytest_plugins = ["maintain.redgreen.plugin", "tests.support.targets"]
FIRST = "tests/tool/"
LATER = "tests/tool/test_verify.py::TestReleaseLineRoute"  # each line's route, made in the background meanwhile
LAST = ("tests/test_red_green.py", "tests/test_wrong_fixes.py")


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="every tier: the push tier and the tests marked slow")
    parser.addoption(
        "--upstream-checkout", metavar="DIR", help="a Megatron-Bridge clone holding the patch's base-commit"
    )
    parser.addoption("--upstream-python", metavar="PY", help="an interpreter with that commit's megatron-core")
    parser.addoption("--upstream-rev", metavar="REV", help="the upstream commit to test (default: the base-commit)")


def pytest_configure(config):
    where = config.getoption("upstream_checkout")
    if where and not (Path(where) / ".git").exists():
        raise pytest.UsageError(f"--upstream-checkout {where}: not a git clone of Megatron-Bridge")
    if not config.getoption("outcomes"):  # a session of its own (a red/green session is given its file)
        path = WORK / "sessions" / f"{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        config.option.outcomes = str(path)
        if _whole_suite(config):  # its runner imports the pinned release while this session collects
            sessions.BATCH.warm(release(pins()["megatron-bridge"]).root)


def _whole_suite(config) -> bool:
    """Whether the session runs a whole tier: no paths, -k or -m given."""
    options = config.option
    chosen = options.keyword or options.markexpr or options.collectonly
    return config.args_source is pytest.Config.ArgsSource.TESTPATHS and not chosen


def pytest_sessionfinish(session):
    sessions.BATCH.close()


@pytest.fixture(scope="session")
def upstream_checkout(pytestconfig) -> Path:
    """--upstream-checkout: a Megatron-Bridge clone (its 3rdparty/Megatron-LM submodule too); without it, a skip."""
    if not (where := pytestconfig.getoption("upstream_checkout")):
        pytest.skip("needs --upstream-checkout DIR: a Megatron-Bridge clone holding the patch's base-commit")
    return Path(where).resolve()


@pytest.fixture(autouse=True)
def _signal_mask():
    """Give each test the session's signal mask back: a command's main() run in-process blocks signals as it exits."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def pytest_collection_modifyitems(config, items):
    """Leave out the slow tier unless --all; run the tool's tests first and the outcome checks last."""
    if not config.getoption("--all"):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    # The tool's tests run one CLI process at a time and leave a core to the background sessions.
    items.sort(
        key=lambda item: (
            item.nodeid.startswith(LAST),
            item.nodeid.startswith(LATER),
            not item.nodeid.startswith(FIRST),
        )
    )


def pytest_collection_finish(session):
    modules = sorted({item.module for item in session.items if hasattr(item, "module")}, key=lambda m: m.__name__)
    early = [module.start_early for module in modules if hasattr(module, "start_early")]
    if early:
        pool = ThreadPoolExecutor(1)  # the batch's one thread, which only waits on its runner
        for start in early:
            try:
                start(session)
            except Exception:  # e.g. drift, no network: the module's fixture meets it again, as its tests' error
                continue
        sessions.BATCH.start(pool)
