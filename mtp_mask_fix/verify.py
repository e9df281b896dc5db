"""verify: does a Megatron-Bridge hand the batch's loss_mask to a model with MTP on? Judged by behaviour.

The probe (probe.py, run as a script) runs under the interpreter that trains, with the target's import root first on
PYTHONPATH, so the answer is about the code that interpreter really imports, whatever form its fix takes.
"""

import json
import os
import subprocess
from pathlib import Path
from typing import NamedTuple

from mtp_mask_fix import probe
from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.paths import is_gpt_step_of
from mtp_mask_fix.targets import Target


class Found(NamedTuple):
    """What the probe found: whether the batch's mask reached the model, and why not."""

    delivered: bool
    reason: str


def verify(target: Target, python: str) -> Found:
    """Run the probe under `python` against the target's own files."""
    path = [str(target.import_root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    # The probe's source through -c: nothing of the tool needs to be installed in that interpreter, and no module of
    # the tool's folder can shadow one of the target's (as running the file would, its folder going first on the path).
    source = Path(probe.__file__).read_text()
    result = subprocess.run([python, "-c", source], capture_output=True, text=True, env=env, cwd=target.import_root)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        why = f"the probe could not run {target.label} under {python} ({tail}); pass --python an interpreter"
        return Found(False, f"{why} that imports this Megatron-Bridge (its megatron-core)")
    found = json.loads(lines[-1])
    if not is_gpt_step_of(found["file"], target.import_root):
        return Found(False, f"{python} imported gpt_step from {found['file']}, not from {target.label}")
    return Found(found["delivered"], found["reason"])


def imported_by(python: str) -> Path:
    """The directory holding the megatron/bridge that `python` imports (found without importing it)."""
    code = "import importlib.util as u; s = u.find_spec('megatron.bridge'); print(s.submodule_search_locations[0])"
    found = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if found.returncode != 0:
        raise ToolError(f"{python} imports no megatron.bridge; pass a TARGET")
    return Path(found.stdout.strip()).parents[1]
