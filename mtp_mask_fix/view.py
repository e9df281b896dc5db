"""The generated view: src/megatron/bridge/training/gpt_step.py = pinned release + the patch's source hunks.

Also leaves the untouched base beside it in .work/base/, so tests can run red (base) and green (view).
Neither file is ever committed or edited by hand.
"""

import shutil
import tempfile
from pathlib import Path

from mtp_mask_fix.errors import DRIFTED, ToolError
from mtp_mask_fix.patch import BASE_FILE, FIXED_FILE, VIEW, Patch, apply_diff, first_error_line, pinned_versions
from mtp_mask_fix.targets import pypi_release


def render(base_file: Path, patch: Patch) -> str:
    """base_file with the patch's source hunks applied, as text."""
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / FIXED_FILE
        staged.parent.mkdir(parents=True)
        shutil.copyfile(base_file, staged)
        error = apply_diff(patch.part(src=True), Path(tmp))
        if error:
            raise ToolError(f"the patch does not apply to {base_file}: {first_error_line(error)}", DRIFTED)
        return staged.read_text()


def write_view() -> str:
    """Write the view and the base beside it; returns a one-line summary."""
    version = pinned_versions()["megatron-bridge"]
    base = pypi_release(version).fixed_file
    text = render(base, Patch.load())
    for path, content in ((BASE_FILE, base.read_text()), (VIEW, text)):
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != content:
            path.write_text(content)
    return f"view: {FIXED_FILE} = megatron-bridge {version} + patch (unpatched base: .work/base/gpt_step.py)"
