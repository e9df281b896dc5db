"""What a TARGET names: a git checkout, a source tree, or an installed package directory; and how one is found."""

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.git import git
from mtp_mask_fix.paths import GPT_STEP, PACKAGE, PROBE, SRC, STRIP


Kind = Enum("Kind", "CHECKOUT TREE INSTALLED")  # the shapes a TARGET can take


@dataclass(frozen=True)
class Target:
    """Where the patch goes; its `import_root` (a tree's src/), first on the path, gives its `megatron.bridge`."""

    label: str
    root: Path
    kind: Kind

    @property
    def strip(self) -> int:
        """git apply's -p: a package has no src/ to strip."""
        return STRIP + 1 if self.kind is Kind.INSTALLED else STRIP

    @property
    def import_root(self) -> Path:
        return self.root if self.kind is Kind.INSTALLED else self.root / SRC

    @property
    def fixed_file(self) -> Path:
        return self.import_root / GPT_STEP

    @property
    def release(self) -> str:
        """The Megatron-Bridge version its package_info.py states, "" without one."""
        info = self.import_root / PACKAGE / "package_info.py"
        text = info.read_text(errors="replace") if info.is_file() else ""
        found = [re.search(rf"^{part} = [\"']?([\w.]*)", text, re.M) for part in ("MAJOR", "MINOR", "PATCH")]
        pre = re.search(r"^PRE_RELEASE = [\"']([\w.]*)", text, re.M)
        return ".".join(m.group(1) for m in found) + (pre.group(1) if pre else "") if all(found) else ""


def interpreter(python: str) -> str:
    """The absolute path of --python, which every "verified" line names; refused where it cannot be run."""
    if (found := shutil.which(python)) is None:
        raise ToolError(f"--python {python}: no executable file of that name{'' if os.sep in python else ' on PATH'}")
    return os.path.abspath(found)


def find(spec: str | None, python: str) -> Target:
    """TARGET as given, else the Megatron-Bridge that --python imports where it runs (an editable one's checkout)."""
    if spec is not None:
        return resolve(spec)
    python = interpreter(python)
    try:  # the probe's own lookup: a fixed program, told what to do by argv
        found = subprocess.run([python, "-", "where"], input=PROBE.read_text(), capture_output=True, text=True)
    except OSError as exc:
        raise OSError(f"running --python {python}: {exc.strerror}") from None
    where = Path((found.stdout.strip().splitlines() or [""])[-1])
    if found.returncode != 0 or where.parts[-2:] != tuple(PACKAGE.split("/")):
        raise ToolError(f"{python} imports no megatron.bridge; give --python the interpreter that trains, or a TARGET")
    root = where.parent.parent  # an editable install's src/: its checkout is the TARGET
    return resolve(str(root.parent if root.name == SRC else root))


def resolve(spec: str) -> Target:
    """The target a TARGET argument names."""
    what = "(a TARGET is the directory of a Megatron-Bridge)"
    try:
        path = Path(spec).expanduser() if spec.strip() else None
    except RuntimeError as exc:  # ~user of no known user
        raise ToolError(f"{spec}: {exc}") from None
    if path is None:
        raise ToolError(f"an empty TARGET {what}")
    if not path.is_dir():
        raise ToolError(f"{spec}: {'not a directory' if path.exists() else 'no such file or directory'} {what}")
    root = path.resolve()
    if (root / SRC / PACKAGE).is_dir():  # a checkout: the top of a git work tree with a commit at HEAD
        asked = ["rev-parse", "--show-toplevel", "--verify", "--quiet", "HEAD^{commit}"]
        top = git(*asked, cwd=root, check=False) if (root / ".git").exists() else None
        checkout = bool(top) and top.returncode == 0 and Path(top.stdout.splitlines()[0]).resolve() == root
        target = Target(spec, root, Kind.CHECKOUT if checkout else Kind.TREE)
    elif (root / PACKAGE).is_dir():
        target = Target(spec, root, Kind.INSTALLED)
    else:
        raise ToolError(f"{spec}: not a Megatron-Bridge tree (neither {SRC}/{PACKAGE} nor {PACKAGE} is inside)")
    if not target.fixed_file.is_file():
        raise ToolError(f"{spec}: Megatron-Bridge without {GPT_STEP}; too old or too new")
    return target
