"""Trees to put first on the import path: a base's symlink farm in which only what a diff touches is real, every other
entry a link to the base's, so that a session warm from the base keeps its modules (gate's trees, the wrong fixes')."""

import os
import shutil
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, stripped
from mtp_mask_fix.patch import Patch


def materialise(base: Path, dest: Path, patch: Patch | None = None, *, strip=2, rewrite: dict | None = None, **part):
    """Make dest (returned) the base (which holds megatron/bridge), `patch.part(**part)` applied, `rewrite` written."""
    shutil.rmtree(dest, ignore_errors=True)
    touched = [Path(stripped(path, strip)) for path in (patch.paths(src=part.get("src")) if patch else [])]
    touched += map(Path, rewrite or {})
    _farm(base, dest, Path(), {parent for path in touched for parent in path.parents}, set(touched))
    diff = patch.part(**part) if patch else ""
    if diff and (error := apply_diff(diff, dest, strip=strip)):
        raise ToolError(f"the patch does not apply to {base}: {first_error_line(error)}", Exit.DRIFTED)
    for path, text in (rewrite or {}).items():
        (dest / path).write_text(text)
    return dest


def _farm(base: Path, dest: Path, rel: Path, real_dirs: set[Path], copies: set[Path]) -> None:
    dest.joinpath(rel).mkdir(parents=True)
    for entry in base.joinpath(rel).iterdir():
        if (path := rel / entry.name) in real_dirs:
            _farm(base, dest, path, real_dirs, copies)
        elif path in copies:
            shutil.copyfile(entry, dest / path)
        elif entry.is_symlink() and not Path(os.readlink(entry)).is_absolute():  # within the tree: to dest's own
            (dest / path).symlink_to(os.readlink(entry))
        elif entry.name != "__pycache__":
            (dest / path).symlink_to(entry.resolve())
