"""`./run view` (also run by `./run setup`, `test`, `effect`, `repro`): src/ = the pinned release + the patch,
importable as megatron.bridge; a symlink farm of the release where only gpt_step.py and the directories above it are
real files."""

from maintain.repo import VIEW, pins, release
from maintain.trees import materialise
from mtp_mask_fix import cli
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PACKAGE


def view(args) -> tuple[str, Exit]:
    """What `./run view` prints, and its exit code."""
    pinned = release(pins()["megatron-bridge"])
    materialise(pinned.root, VIEW, Patch.load(), src=True)
    return f"view: src/{PACKAGE} = {pinned.label} + patch (unpatched: {pinned.root.relative_to(VIEW.parent)})", Exit.OK


def parser() -> cli.Parser:
    """The command line of `./run NAME` for this module: its refusals are the tool's (one line, the same exit codes)."""
    parser = cli.Parser(prog="./run view", description="write src/: the pinned release + the patch (never edited)")
    parser.set_defaults(func=view)
    return parser


if __name__ == "__main__":
    cli.main(parser=parser())
