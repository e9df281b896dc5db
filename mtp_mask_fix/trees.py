"""Trees of Megatron-Bridge to import: a base tree with a diff applied, and the generated view.

A tree is a directory whose `megatron/bridge` is what Python imports when the directory comes first on the
import path: the one way this repo chooses the code under test (tests, gate, wrong-fix runs, probe).
Trees are symlink farms of their base: only the files a diff touches are real copies, and only the directories above
them are real; every other directory is a link to the base's, so its bytecode cache is the base's too (a farm of real
directories would recompile all of Megatron-Bridge in every tree).
"""

import shutil
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PACKAGE, VIEW
from mtp_mask_fix.targets import pins, release


def materialise(
    base: Path,
    dest: Path,
    patch: Patch | None = None,
    *,
    src: bool | None = None,
    leave_out: tuple[str, int] | None = None,
    strip: int = 2,
    rewrite: dict[str, str] | None = None,
) -> Path:
    """dest = base (the directory holding megatron/bridge) + the patch's part (`Patch.part`: src True sources, False
    tests, None all, less `leave_out`), applied with git apply -p`strip`, + `rewrite` (path: text)."""
    if dest.exists():
        shutil.rmtree(dest)
    diff = patch.part(src=src, leave_out=leave_out) if patch else ""
    touched = [Path(p.split("/", strip - 1)[-1]) for p in (patch.paths(src=src) if diff else [])]
    touched += map(Path, rewrite or {})
    _farm(base, dest, Path(), {parent for path in touched for parent in path.parents}, set(touched))
    if diff and (error := apply_diff(diff, dest, strip=strip)):
        raise ToolError(f"the patch does not apply to {base}: {first_error_line(error)}", Exit.DRIFTED)
    for path, text in (rewrite or {}).items():
        (dest / path).write_text(text)
    return dest


def _farm(base: Path, dest: Path, rel: Path, real_dirs: set[Path], copies: set[Path]) -> None:
    dest.joinpath(rel).mkdir(parents=True)
    for entry in base.joinpath(rel).iterdir():
        path = rel / entry.name
        if path in real_dirs:
            _farm(base, dest, path, real_dirs, copies)
        elif path in copies:
            shutil.copyfile(entry, dest / path)
        elif entry.name != "__pycache__":
            (dest / path).symlink_to(entry.resolve())


def write_view(patch: Patch | None = None) -> str:
    """src/ = the pinned release + the patch's source hunks; returns a one-line summary."""
    pinned = release(pins()["megatron-bridge"])
    materialise(pinned.root, VIEW, patch or Patch.load(), src=True)
    return f"view: src/{PACKAGE} = {pinned.label} + patch (unpatched: {pinned.root.relative_to(VIEW.parent)})"
