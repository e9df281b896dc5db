"""`./run python VERSION|DIR`: a test environment synced (one `uv sync`), its interpreter printed; .venv without one.

How they are made: CONTRIBUTING.md, "One source of truth"."""

import argparse
import sys
from pathlib import Path

from maintain.envs.make import checkout_environment, line_environment
from maintain.envs.spec import checkout_spec, spec
from maintain.repo import REPO
from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.signals import Interrupted, guard


class Parser(argparse.ArgumentParser):
    """Its refusals are one line, as the tool's are (whose parser needs more than the standard library)."""

    def error(self, message):
        raise ToolError(f"{message} (see {self.prog} --help)")


def interpreter(line: str | None) -> Path:
    """Sync the environment of `line` (a release or a checkout; None: .venv) and return its interpreter."""
    if line is None:
        return checkout_environment()
    if Path(line).is_dir():
        return line_environment(checkout_spec(Path(line).resolve()))
    if "/" in line:  # a path, not a version: a typo must not read as "not on the package index"
        raise ToolError(f"{line}: no such directory")
    found = spec(line)
    return line_environment(found) if found.key else REPO / ".venv" / "bin" / "python"


def main() -> int:
    """Print the interpreter; a refusal or a signal is one line on stderr and its exit code."""
    parser = Parser(prog="./run python", description=__doc__.split("\n\n")[0])
    parser.add_argument("line", metavar="VERSION|DIR", nargs="?", help="a release, or an upstream checkout's top")
    try:
        with guard():
            print(interpreter(parser.parse_args().line))
    except (ToolError, Interrupted) as exc:
        again = ": run it again to finish" if isinstance(exc, Interrupted) else ""  # a half-made environment
        print(f"mtp-mask-fix: error: {exc}{again}", file=sys.stderr)
        return exc.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
