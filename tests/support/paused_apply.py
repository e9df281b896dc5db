"""`python -m tests.support.paused_apply PHASE MARKER ARGS...`: the tool's CLI (apply or revert), paused once it reaches
PHASE, so that a test can signal or kill it there. At that moment it writes MARKER and sleeps.

The tool carries no test hook. This module wraps the functions `apply` calls, and a phase is a state of the target.
It is read only outside a held (signal-blocked) write, as a signal at that moment would find it:
- checked: the verdict holds the new bytes, nothing is written;
- journaled: the journal is written, the file is as before;
- replaced: the journal is written, the file is patched;
- verified: the probe has shown the mask arrives (it verifies the new bytes aside, before the journal);
- done: the journal is gone, the file is patched;
"""

import contextlib
import os
import sys
import time
from pathlib import Path

from mtp_mask_fix import apply, cli, journal
from mtp_mask_fix.journal import JOURNAL


PHASE, MARKER, *ARGV = sys.argv[1:]
FILES = {}  # the target's root and each file's bytes as patched, once the new bytes are made


def pause(phase: str) -> None:
    """Once: the rollback after a signal may find the target in the same state again."""
    if phase == PHASE and not Path(MARKER).exists():
        Path(MARKER).write_text(f"{os.getpid()}\n")
        time.sleep(3600)  # until the test's signal or kill


def check(target, patches, _real=apply.check):
    verdict = _real(target, patches)
    if after := verdict.rewrite:
        FILES.update(root=target.root, after=after)
        pause("checked")
    return verdict


@contextlib.contextmanager
def held(_real=journal.held):
    with _real():
        yield
    if FILES:
        journaled = (FILES["root"] / JOURNAL).exists()
        patched = all((FILES["root"] / rel).read_bytes() == data for rel, data in FILES["after"].items())
        pause({(True, False): "journaled", (True, True): "replaced", (False, True): "done"}.get((journaled, patched)))


def proven(target, python, after, failed, _real=apply.proven):
    shown = _real(target, python, after, failed)
    if python:  # the probe has answered
        pause("verified")
    return shown


apply.check, apply.proven, journal.held = check, proven, held
cli.main(ARGV)
