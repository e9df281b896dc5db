"""`mtp-mask-fix watch` on megatron-core 0.16, whose MTP loss is inline in GPTModel._postprocess: loops of
tests/watch/loops.py on the tiny model in the environment of Megatron-Bridge 0.3.1 (`./run python 0.3.1` builds it
once), each one watched job, all started at once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from maintain.repo import REPO
from mtp_mask_fix.errors import Exit


pytestmark = pytest.mark.slow

LOOPS = {  # loop: watch's exit code, what its line says
    "sft": (Exit.OK, "MTP loss calls trained 1, evaluated 0: 0 without loss_mask"),
    "input-aligned mask": (Exit.UNMASKED, "1 with a mask that counts padding (2 positions)"),
    "double-shifted labels": (Exit.UNMASKED, "1 with labels the inputs shifted by 2, not 1"),
    "eval-mode training": (Exit.UNMASKED, "1 without a loss_mask"),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every loop's job started now: loop -> Popen, its stdout and stderr piped."""
    built = subprocess.run([REPO / "run", "python", "0.3.1"], capture_output=True, text=True, cwd=REPO)
    assert built.returncode == 0, built.stderr[-3000:]
    started = {}
    for loop in LOOPS:
        folder = tmp_path_factory.mktemp("loop")
        job = [built.stdout.strip(), str(Path(__file__).with_name("loops.py")), loop]
        started[loop] = subprocess.Popen(
            [sys.executable, "-m", "mtp_mask_fix", "watch", "--", *job],
            cwd=folder,
            env=dict(os.environ, TMPDIR=str(folder)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    yield started
    for job in started.values():
        job.kill()
        job.communicate()


@pytest.mark.parametrize("loop", LOOPS)
def test_the_inline_loss_is_judged_as_process_mtp_loss(jobs, loop):
    out, err = jobs[loop].communicate(timeout=600)
    code, words = LOOPS[loop]
    lines = [line for line in out.splitlines() if line.startswith("mtp-mask-fix watch:")]
    assert (jobs[loop].returncode, len(lines)) == (code, 1), err[-3000:]
    assert words in lines[0]
    assert ("against the contract" in lines[0]) == (code == Exit.UNMASKED)
