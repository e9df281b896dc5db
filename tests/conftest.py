"""Every session records each test's outcome (mtp_mask_fix.recorder), so that the red/green check can hold the
outcomes this session measured on the view against a session on the release as shipped, without running the view
twice. The red/green and wrong-fix checks run last, after the tests whose outcomes they read."""

import os

from mtp_mask_fix.paths import WORK


pytest_plugins = ["mtp_mask_fix.recorder"]
LAST = ("tests/test_red_green.py", "tests/test_wrong_fixes.py")


def pytest_configure(config):
    if "MTP_FIX_OUTCOMES" not in os.environ:  # a session of its own (a forked red/green session has its file already)
        path = WORK / "sessions" / f"{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        os.environ["MTP_FIX_OUTCOMES"] = str(path)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid.startswith(LAST))  # stable: the order within each group is kept
