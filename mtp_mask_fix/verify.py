"""`verify`: whether a target hands a model with MTP on the batch's loss_mask, by its behaviour (probe.py)."""

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.journal import scratch
from mtp_mask_fix.paths import PROBE, is_gpt_step_of
from mtp_mask_fix.targets import Target


def proven(target: Target, python: str | None, after: dict[str, bytes], failed: str) -> str:
    """`; verified with PY: why` of the target (or links to it, with `after`), "" without `python`; else exit 5."""
    if not python:
        return ""
    with scratch() if after else contextlib.nullcontext(target.import_root) as root:
        for rel, data in after.items():  # upstream's tests, outside the import root, are never imported
            if (path := target.root / rel).is_relative_to(target.import_root):
                (root / path.relative_to(target.import_root)).parent.mkdir(parents=True, exist_ok=True)
                (root / path.relative_to(target.import_root)).write_bytes(data)
        for folder in {path.relative_to(root) for path in root.rglob("*") if path.is_dir()} if after else []:
            for entry in (target.import_root / folder).iterdir():  # links to the rest on the new files' way
                if entry.name != "__pycache__" and not os.path.lexists(root / folder / entry.name):
                    (root / folder / entry.name).symlink_to(entry)
        delivered, reason = _probe(root, target.label, python)
    if not delivered:
        raise ToolError(f"{failed}not verified with {python}: {reason}", Exit.FAILED)
    return f"; verified with {python}: {reason}"


def _probe(root: Path, label: str, python: str) -> tuple[bool, str]:
    """What the probe says of the Megatron-Bridge in `root` under `python`."""
    # probe.py's source on stdin: nothing of the tool need be installed there, and no module of its folder shadows
    # the target's (what is not Python says so of `-`, not of the source). A signal to the tool ends it (run kills it).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    try:
        result = subprocess.run(
            [python, "-"], input=PROBE.read_text(), capture_output=True, text=True, env=env, cwd=root
        )
    except OSError as exc:  # no system runs it (ENOEXEC): the user's input; anything else is the OS's
        raise (ToolError if exc.errno == errno.ENOEXEC else OSError)(f"running {python}: {exc.strerror}") from None
    out = result.stdout.strip().splitlines()
    said = (result.stderr.strip() or result.stdout.strip()).splitlines() or [f"exit {result.returncode}"]
    found = None
    with contextlib.suppress(ValueError):
        found = json.loads(out[-1]) if result.returncode == 0 and out else None
    if isinstance(found, dict) and {"file", "delivered", "reason"} <= found.keys():
        if not is_gpt_step_of(found["file"], root):
            return False, f"it imported gpt_step from {found['file']}, not from {label}"
        return found["delivered"], found["reason"]
    if re.search(r"ModuleNotFoundError|ImportError|No module named", said[-1]):  # in the user's terms: what trains
        return False, f"it cannot import what {label} needs ({said[-1]}); give --python the interpreter that trains"
    if result.returncode < 0:
        return False, f"the probe ended by {signal.Signals(-result.returncode).name}"
    if "Traceback (most recent call last)" in result.stderr:  # Python ran it: the target's code failed there
        return False, f"the probe of {label}'s forward_step failed ({said[-1]})"
    raise ToolError(f"--python {python} is not a Python: it did not run the probe (it said: {said[0][:40]})")
