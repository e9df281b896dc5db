"""`mtp-mask-fix watch` on megatron-core 0.16, whose MTP loss is inline in GPTModel._postprocess: loops of
tests/watch/loops.py on the tiny model in the environment of Megatron-Bridge 0.3.1 (`./run python 0.3.1` builds it
once), each one watched job, all started at once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maintain.repo import REPO
from mtp_mask_fix.errors import Exit
from tests.watch import loops


pytestmark = pytest.mark.slow

LOOPS = {  # loop: watch's exit code
    "left-padded sft": Exit.OK,
    "input-aligned mask": Exit.UNMASKED,
    "double-shifted labels": Exit.UNMASKED,
    "eval-mode training": Exit.UNMASKED,
}


def said(name: str) -> str:
    """What watch's line says of a loop whose loss applies its batch's mask: from the batch alone."""
    batch = loops.LOOPS[name].batch()
    mask, data = loops.LOOPS[name].mtp_mask(batch), batch["mask"][:, 1:] != 0
    counted = torch.ones_like(data) if mask is None else mask[:, 1:] != 0
    counts, leaves = int((counted & ~data).sum()), int((data & ~counted).sum())
    words = ["1 without a loss_mask (core's MTP loss counts every position)"] * (mask is None)
    words += [f"the MTP loss counts {counts} positions the loss's mask leaves out"] * bool(counts)
    words += [f"the MTP loss leaves out {leaves} positions the loss's mask counts"] * bool(leaves)
    words += ["1 with labels the inputs shifted by 2, not 1"] * (name == "double-shifted labels")
    return "; ".join(words) or "MTP loss calls trained 1 (0 without labels), evaluated 0, not reached by a backward 0"


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
    code, words = LOOPS[loop], said(loop)
    lines = [line for line in out.splitlines() if line.startswith("mtp-mask-fix watch:")]
    assert (jobs[loop].returncode, len(lines)) == (code, 1), err[-3000:]
    assert words in lines[0]
    assert ("against the contract" in lines[0]) == (code == Exit.UNMASKED)
