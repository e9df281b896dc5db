"""Every path and name of Megatron-Bridge and of the patch that the tool reads, stated once."""

import importlib.resources
import os
from pathlib import Path


# The patch files travel as package data: mtp_mask_fix/patches is a link to patches/ in a checkout and a copy of it
# in an installed tool (pyproject's package-data), so both read them from the package.
PATCHES = Path(str(importlib.resources.files("mtp_mask_fix") / "patches"))
PROBE = Path(__file__).with_name("probe.py")  # run by its source in the interpreter that trains

SRC = "src"  # the folder of an upstream checkout that holds its packages: the patch's source paths start with it
STRIP = 1  # git apply's -p for a tree holding src/ (a diff's a/ and b/); one more for a package, which has no src/
PACKAGE = "megatron/bridge"
GPT_STEP = f"{PACKAGE}/training/gpt_step.py"  # the one upstream source file the patch changes, in a package tree


def is_gpt_step_of(file: str | Path, tree: str | Path) -> bool:
    """Whether `file`, the gpt_step.py a process imported, is the one of `tree` (which holds megatron/bridge)."""
    # By absolute path, not resolved: a tree's other files may be symlinks into its base, its gpt_step.py never.
    return os.path.abspath(file) == os.path.abspath(Path(tree) / GPT_STEP)


def is_source(path: str) -> bool:
    """Whether a path of the patch's, as an upstream checkout names it, is of upstream's sources (not its tests)."""
    return path.startswith(f"{SRC}/")
