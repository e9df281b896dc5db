"""`mtp-mask-fix` and `python -m mtp_mask_fix`. A signal before the tool has read anything ends it at once with one line
(the handlers below come first, before the rest of the tool loads); then cli.main's take over."""

import os
import signal
import sys


def _before_anything(signum, frame):
    print(f"mtp-mask-fix: error: interrupted by {signal.Signals(signum).name}: nothing changed", file=sys.stderr)
    os._exit(128 + signum)


for _signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signum, _before_anything)


def main() -> None:
    """The console script."""
    from mtp_mask_fix import cli

    cli.main()


if __name__ == "__main__":
    main()
