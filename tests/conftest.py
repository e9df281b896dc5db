"""Every session records each test's outcome (maintain.redgreen), so that the red/green check can hold the
outcomes this session measured on the view against a session on the release as shipped, without running the view
twice. The red/green and wrong-fix checks run last, after the tests whose outcomes they read; the sessions they need
of other trees (red/green's base, the wrong-fix variants) depend on nothing this session does, so they start as soon
as the suite is collected, on the core the rest of the suite leaves idle (`start_early` in their module)."""

import compileall
import os
from concurrent.futures import ThreadPoolExecutor

from maintain.repo import VIEW, WORK, pins, release


pytest_plugins = ["maintain.redgreen", "tests.support.targets"]
FIRST = "tests/tool/"
LAST = ("tests/test_red_green.py", "tests/test_wrong_fixes.py")


def pytest_configure(config):
    if "MTP_FIX_OUTCOMES" not in os.environ:  # a session of its own (a forked red/green session has its file already)
        path = WORK / "sessions" / f"{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        os.environ["MTP_FIX_OUTCOMES"] = str(path)
        _compile_the_trees()


def _compile_the_trees() -> None:
    """Bytecode for the pinned release and the view, written once (a second run only compares timestamps): the
    session, the red/green and wrong-fix sessions and verify's probes all import them, and with
    PYTHONDONTWRITEBYTECODE set (as on this machine) each import would otherwise compile Megatron-Bridge again."""
    for tree in (release(pins()["megatron-bridge"]).root, VIEW):
        if tree.is_dir():
            compileall.compile_dir(tree, quiet=2, workers=1)


def pytest_collection_modifyitems(items):
    """The tool's tests first: one CLI process at a time, they leave a core to the background sessions (and the
    functional tests, which keep both busy, run once those are done); the checks that read outcomes last. Stable:
    the order within each group is kept."""
    items.sort(key=lambda item: (not item.nodeid.startswith(FIRST), item.nodeid.startswith(LAST)))


def pytest_collection_finish(session):
    modules = sorted({item.module for item in session.items if hasattr(item, "module")}, key=lambda m: m.__name__)
    early = [module.start_early for module in modules if hasattr(module, "start_early")]
    if early:
        pool = ThreadPoolExecutor(len(early))  # each thread only waits on its sessions' process
        for start in early:  # red/green's base session first: the longest of the batch
            try:
                start(pool)
            except Exception:  # e.g. drift, no network: the module's fixture meets it again, as its tests' error
                continue
        from tests.support import sessions  # here: importing redgreen before pytest_plugins would warn

        sessions.BATCH.start(pool)
