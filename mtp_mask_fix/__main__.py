"""The console script `mtp-mask-fix`, and `python -m mtp_mask_fix`."""

import os
import signal
import sys

from mtp_mask_fix.signals import SIGNALS, Interrupted


def _before_anything(signum, frame):
    interrupted = Interrupted(signum)
    print(f"mtp-mask-fix: error: {interrupted}: nothing changed", file=sys.stderr)
    os._exit(interrupted.code)


# Before the rest of the tool loads, a signal ends it at once with one line; cli.main's handlers take over from here.
for _signum in SIGNALS:
    signal.signal(_signum, _before_anything)


def main() -> None:
    """Run the tool's command line."""
    from mtp_mask_fix import cli

    cli.main()


if __name__ == "__main__":
    main()
