"""Trees of Megatron-Bridge to import: a base tree with a diff applied, and the generated view.

A tree is a directory whose `megatron/bridge` is what Python imports when the directory comes first on the
import path: the one way this repo chooses the code under test (tests, gate, wrong-fix runs, probe).
Trees are symlink farms of their base; only the files a diff touches are real copies.
"""

import os
import shutil
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.patch import VIEW, Patch, apply_diff, first_error_line
from mtp_mask_fix.targets import PACKAGE, pins, release


def materialise(base: Path, dest: Path, diff: str = "", *, strip: int = 2, rewrite: dict[str, str] | None = None):
    """dest = base (the directory holding megatron/bridge) + diff (git apply -p`strip`) + `rewrite` (path: text)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest, copy_function=os.symlink, ignore=shutil.ignore_patterns("__pycache__"))
    touched = [line.split(" b/", 1)[1] for line in diff.splitlines() if line.startswith("diff --git ")]
    for path in [p.split("/", strip - 1)[-1] for p in touched] + list(rewrite or {}):
        real = dest / path
        if real.is_symlink():
            real.unlink()
            shutil.copyfile(base / path, real)
    if diff and (error := apply_diff(diff, dest, strip=strip)):
        raise ToolError(f"the patch does not apply to {base}: {first_error_line(error)}", Exit.DRIFTED)
    for path, text in (rewrite or {}).items():
        (dest / path).write_text(text)
    return dest


def write_view(patch: Patch | None = None) -> str:
    """src/ = the pinned release + the patch's source hunks; returns a one-line summary."""
    pinned = release(pins()["megatron-bridge"])
    materialise(pinned.root, VIEW, (patch or Patch.load()).part(src=True))
    return f"view: src/{PACKAGE} = {pinned.label} + patch (unpatched: {pinned.root.relative_to(VIEW.parent)})"
