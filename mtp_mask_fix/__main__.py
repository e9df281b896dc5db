"""`mtp-mask-fix` and `python -m mtp_mask_fix`: the signal handlers come first, and the rest of the tool loads under
them, so that a Ctrl-C at start-up is one line too."""

import sys

from mtp_mask_fix.signals import Interrupted, guard


def main() -> None:
    """The console script: the rest of the tool imported under the handlers."""
    try:
        with guard():
            from mtp_mask_fix import cli

            cli.main()
    except Interrupted as exc:  # before cli.main took over: nothing was read or written
        print(f"mtp-mask-fix: error: interrupted by {exc.name}: nothing changed", file=sys.stderr)
        sys.exit(exc.code)


if __name__ == "__main__":
    main()
