"""What a TARGET names: a git checkout, a source tree, or an installed package directory."""

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.git import git
from mtp_mask_fix.paths import GPT_STEP, PACKAGE


Kind = Enum("Kind", "CHECKOUT TREE INSTALLED")  # the shapes a TARGET can take


@dataclass(frozen=True)
class Target:
    """Where the patch goes; its `import_root` (a tree's src/), first on the path, gives its `megatron.bridge`."""

    label: str
    root: Path
    kind: Kind

    @property
    def strip(self) -> int:
        """git apply's -p, 1 for trees with src/ and 2 for installed packages."""
        return 1 if self.kind in (Kind.CHECKOUT, Kind.TREE) else 2

    @property
    def import_root(self) -> Path:
        return self.root / "src" if self.strip == 1 else self.root

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
    if (root / "src" / PACKAGE).is_dir():
        target = Target(spec, root, Kind.CHECKOUT if is_git_top(root) else Kind.TREE)
    elif (root / PACKAGE).is_dir():
        target = Target(spec, root, Kind.INSTALLED)
    else:
        raise ToolError(f"{spec}: not a Megatron-Bridge tree (neither src/{PACKAGE} nor {PACKAGE} is inside)")
    if not target.fixed_file.is_file():
        raise ToolError(f"{spec}: Megatron-Bridge without {GPT_STEP}; too old or too new")
    return target


def is_git_top(root: Path) -> bool:
    """Whether root is the top of a git work tree (not just somewhere inside one) with a commit at HEAD."""
    found = ["rev-parse", "--show-toplevel", "--verify", "--quiet", "HEAD^{commit}"]
    top = git(*found, cwd=root, check=False) if (root / ".git").exists() else None
    return bool(top) and top.returncode == 0 and Path(top.stdout.splitlines()[0]).resolve() == root
