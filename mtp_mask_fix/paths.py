"""Every path and name of Megatron-Bridge and of the patch that the tool and its tests share, stated once."""

import importlib.resources
import os
from pathlib import Path


# The patch files travel as package data: mtp_mask_fix/patches is a link to patches/ in a checkout and a copy of it
# in an installed tool (pyproject's package-data), so both read them from the package.
PATCHES = Path(str(importlib.resources.files("mtp_mask_fix") / "patches"))

PACKAGE = "megatron/bridge"
GPT_STEP = f"{PACKAGE}/training/gpt_step.py"  # the one upstream source file the patch changes, in a package tree
GPT_STEP_MODULE = "megatron.bridge.training.gpt_step"
FIXED_FILE = f"src/{GPT_STEP}"  # the same file in an upstream checkout
UPSTREAM_TEST = "tests/unit_tests/training/test_gpt_step.py"  # upstream's test file the patch extends


def is_gpt_step_of(file: str | Path, tree: str | Path) -> bool:
    """Whether `file`, the gpt_step.py a process imported, is the one of `tree` (which holds megatron/bridge)."""
    # By absolute path, not resolved: a tree's other files may be symlinks into its base, its gpt_step.py never.
    return os.path.abspath(file) == os.path.abspath(Path(tree) / GPT_STEP)
