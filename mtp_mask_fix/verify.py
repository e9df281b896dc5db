"""`verify`: whether a target hands a model with MTP on the batch's loss_mask, by its behaviour (probe.py)."""

import ctypes
import json
import os
import re
import signal
import subprocess
from functools import partial
from pathlib import Path

from mtp_mask_fix import probe
from mtp_mask_fix.errors import doing
from mtp_mask_fix.paths import is_gpt_step_of
from mtp_mask_fix.targets import Target


def verify(target: Target, python: str) -> tuple[bool, str]:
    """Whether the mask reaches the model under `python`, and why."""
    # probe.py's source through -c: nothing of the tool need be installed there, and no module of its folder shadows
    # the target's. The probe ends with this process, however it ends.
    path = os.pathsep.join(filter(None, [str(target.import_root), os.environ.get("PYTHONPATH")]))
    run, env = [python, "-c", Path(probe.__file__).read_text()], dict(os.environ, PYTHONPATH=path)
    ends = partial(_ends_with, os.getpid())
    with doing("running", python):
        result = subprocess.run(run, capture_output=True, text=True, env=env, cwd=target.import_root, preexec_fn=ends)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:  # in the user's terms: the interpreter lacks what trains, or a probe bug
        error = (result.stderr.strip().splitlines() or ["no output"])[-1]
        if re.search(r"ModuleNotFoundError|ImportError|No module named", error):
            needs = f"it cannot import what {target.label} needs ({error})"
            return False, f"{needs}; give --python the interpreter that trains"
        return False, f"the probe of {target.label}'s forward_step failed ({error}); please report it"
    try:
        found = json.loads(lines[-1])
    except ValueError:
        return False, f"it printed no probe result ({lines[-1][:200]!r})"
    if not is_gpt_step_of(found["file"], target.import_root):
        return False, f"it imported gpt_step from {found['file']}, not from {target.label}"
    return found["delivered"], found["reason"]


def _ends_with(parent: int) -> None:
    """Have the probe killed when the tool dies, kill -9 included (Linux's parent-death signal), or end it now."""
    # Elsewhere a Ctrl-C still reaches its process group.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)
