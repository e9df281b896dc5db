"""What a TARGET names: a git checkout, a source tree, an installed package directory, or a PyPI release."""

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.patch import FIXED_FILE, WORK, git, pinned_versions


SUPPORTED_RELEASES = ("0.6.0", "0.6.1", "0.6.2")
PACKAGE = "megatron/bridge"
VERSION_PATTERN = re.compile(r"^\d+\.\d+\.\d+\S*$")


@dataclass(frozen=True)
class Target:
    """Where the patch goes. `strip` is git apply's -p: 1 for trees with src/, 2 for installed packages."""

    label: str
    root: Path
    kind: str  # "git", "tree", "installed" or "pypi"

    @property
    def strip(self) -> int:
        return 1 if self.kind in ("git", "tree") else 2

    @property
    def import_root(self) -> Path:
        """The directory to put on sys.path so that `megatron.bridge` comes from this target."""
        return self.root / "src" if self.strip == 1 else self.root

    @property
    def fixed_file(self) -> Path:
        return self.import_root / FIXED_FILE.removeprefix("src/")

    @property
    def has_tests(self) -> bool:
        """Installed packages and PyPI releases ship no tests/: only the source hunks go there."""
        return (self.root / "tests/unit_tests/training/test_gpt_step.py").is_file()


def resolve(spec: str | None) -> Target:
    """TARGET as the user wrote it; None means the pinned PyPI release."""
    if spec is None:
        spec = pinned_versions()["megatron-bridge"]
    path = Path(spec).expanduser()
    if not path.exists() and VERSION_PATTERN.match(spec):
        return pypi_release(spec)
    if not path.exists():
        raise ToolError(f"{spec}: no such file or directory (a TARGET is a directory or a PyPI version)")
    if not path.is_dir():
        raise ToolError(f"{spec}: not a directory (a TARGET is a directory or a PyPI version)")
    root = path.resolve()
    if (root / "src" / PACKAGE).is_dir():
        kind = "git" if _is_git_top(root) else "tree"
        target = Target(spec, root, kind)
    elif (root / PACKAGE).is_dir():
        target = Target(spec, root, "installed")
    else:
        raise ToolError(f"{spec}: not a Megatron-Bridge tree (neither src/{PACKAGE} nor {PACKAGE} is inside)")
    if not target.fixed_file.is_file():
        raise ToolError(f"{spec}: Megatron-Bridge without {FIXED_FILE.removeprefix('src/')}; too old or too new")
    return target


def require_git_checkout(path: Path) -> Path:
    """path, if it is the top of a Megatron-Bridge git checkout; else a ToolError."""
    if not Path(path).is_dir():
        raise ToolError(f"{path}: no such directory")
    if not _is_git_top(Path(path).resolve()):
        raise ToolError(f"{path}: not the top of a git checkout")
    if not (Path(path) / "src" / PACKAGE).is_dir():
        raise ToolError(f"{path}: a git checkout, but not of Megatron-Bridge (no src/{PACKAGE})")
    return Path(path)


def _is_git_top(root: Path) -> bool:
    if not (root / ".git").exists():
        return False
    top = git("rev-parse", "--show-toplevel", cwd=root, check=False)
    return top.returncode == 0 and Path(top.stdout.strip()).resolve() == root


def pypi_release(version: str) -> Target:
    """The release's wheel, unpacked once into .work/pypi/<version>/ (a site-packages-shaped directory)."""
    if version not in SUPPORTED_RELEASES:
        raise ToolError(f"unsupported Megatron-Bridge release {version} (supported: {', '.join(SUPPORTED_RELEASES)})")
    root = WORK / "pypi" / version
    if not (root / PACKAGE).is_dir():
        _download_release(version, root)
    return Target(f"megatron-bridge=={version} (PyPI)", root, "pypi")


def _download_release(version: str, root: Path) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
        cmd += ["--ignore-requires-python", "--disable-pip-version-check", f"megatron-bridge=={version}", "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("megatron_bridge-*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ToolError(f"could not download megatron-bridge=={version} from the package index: {reason}")
        unpacked = Path(tmp) / "site"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(unpacked, [name for name in wheel.namelist() if name.startswith("megatron/")])
        shutil.move(str(unpacked), root)  # one rename: a half-unpacked release is never left behind
