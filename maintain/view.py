"""`./run view`: src/ is the pinned release + the patch, importable as megatron.bridge (also run by setup and test)."""

import os
import shutil

from maintain import printed
from maintain.repo import VIEW, pins, release
from maintain.upstreams import load
from mtp_mask_fix import cli
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line
from mtp_mask_fix.paths import PACKAGE


def view(args) -> tuple[str, Exit]:
    """Write src/, a copy of the pinned release with the patch applied; what `./run view` prints, and its exit code."""
    pinned = release(pins()["megatron-bridge"])
    shutil.rmtree(VIEW, ignore_errors=True)
    # A copy, not links: an edit in src/ must never reach the cached release red/green runs as shipped. copy2 keeps
    # each file's time, so the bytecode written for one copy stays valid for the next (only gpt_step.py recompiles).
    shutil.copytree(pinned.root / "megatron", VIEW / "megatron", copy_function=shutil.copy2)
    if error := apply_diff(load().part(src=True), VIEW, strip=2):
        raise ToolError(f"the patch does not apply to {pinned.label}: {first_error_line(error)}", Exit.DRIFTED)
    unpatched = os.path.relpath(pinned.root, VIEW.parent)
    return f"view: src/{PACKAGE} = {pinned.label} + patch (unpatched: {unpatched})", Exit.OK


def parser() -> cli.Parser:
    """The command line of `./run view`; its refusals are the tool's (one line, the same exit codes)."""
    parser = cli.Parser(prog="./run view", description="write src/: the pinned release + the patch (never edited)")
    parser.set_defaults(func=printed(view))
    return parser


if __name__ == "__main__":
    cli.main(parser=parser())
