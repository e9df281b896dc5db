"""What a TARGET names: a git checkout, a source tree, an installed package directory, or a PyPI release."""

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.patch import FIXED_FILE, REPO, WORK, git


PACKAGE = "megatron/bridge"
VERSION = re.compile(r"^\d+(\.\d+)+\S*$")


class Kind(Enum):
    """The shapes a TARGET can take."""

    CHECKOUT = "git checkout"
    TREE = "source tree"
    INSTALLED = "installed package"
    RELEASE = "PyPI release"


@dataclass(frozen=True)
class Target:
    """Where the patch goes; `import_root` is the directory that, first on the import path, gives its
    `megatron.bridge` (src/ of a tree, the directory itself for an installed package or a release)."""

    label: str
    root: Path
    kind: Kind

    @property
    def strip(self) -> int:
        """git apply's -p: 1 for trees with src/, 2 for installed packages (a/src/megatron/... -> megatron/...)."""
        return 1 if self.kind in (Kind.CHECKOUT, Kind.TREE) else 2

    @property
    def import_root(self) -> Path:
        return self.root / "src" if self.strip == 1 else self.root

    @property
    def fixed_file(self) -> Path:
        return self.import_root / FIXED_FILE.removeprefix("src/")

    def has(self, path: str) -> bool:
        """Whether the target holds this file of upstream's tree (installed packages ship no tests/)."""
        return self.strip == 1 and (self.root / path).is_file()


def pins() -> dict[str, str]:
    """requirements/megatron.txt, e.g. {"megatron-core": "0.19.0", "megatron-bridge": "0.6.2"}: the pinned
    release every default refers to, and the megatron-core of this environment."""
    lines = (REPO / "requirements/megatron.txt").read_text().splitlines()
    return dict(line.replace(" ", "").split("==") for line in lines if line.strip() and not line.startswith("#"))


def resolve(spec: str | None) -> Target:
    """TARGET as the user wrote it: a directory, a version, `latest`; None means the pinned release."""
    spec = spec or pins()["megatron-bridge"]
    path = Path(spec).expanduser()
    if not path.exists() and (spec == "latest" or VERSION.match(spec)):
        return release(spec)
    if not path.exists():
        raise ToolError(f"{spec}: no such file or directory (a TARGET is a directory, a version or `latest`)")
    if not path.is_dir():
        raise ToolError(f"{spec}: not a directory (a TARGET is a directory, a version or `latest`)")
    root = path.resolve()
    if (root / "src" / PACKAGE).is_dir():
        target = Target(spec, root, Kind.CHECKOUT if is_git_top(root) else Kind.TREE)
    elif (root / PACKAGE).is_dir():
        target = Target(spec, root, Kind.INSTALLED)
    else:
        raise ToolError(f"{spec}: not a Megatron-Bridge tree (neither src/{PACKAGE} nor {PACKAGE} is inside)")
    if not target.fixed_file.is_file():
        raise ToolError(f"{spec}: Megatron-Bridge without {FIXED_FILE.removeprefix('src/')}; too old or too new")
    return target


def checkout(path: Path | str) -> Target:
    """A Megatron-Bridge git checkout (its top), or a ToolError."""
    target = resolve(str(path))
    if target.kind != Kind.CHECKOUT:
        raise ToolError(f"{path}: not the top of a Megatron-Bridge git checkout")
    return target


def is_git_top(root: Path) -> bool:
    """Whether root is the top of a git work tree (not just somewhere inside one)."""
    if not (root / ".git").exists():
        return False
    top = git("rev-parse", "--show-toplevel", cwd=root, check=False)
    return top.returncode == 0 and Path(top.stdout.strip()).resolve() == root


def _pip(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--ignore-requires-python"]
    return subprocess.run(cmd, capture_output=True, text=True)


def latest_version() -> str:
    """The newest Megatron-Bridge release on the package index (not yanked, not a pre-release)."""
    found = _pip("index", "versions", "megatron-bridge")
    match = re.search(r"^megatron-bridge \(([^)]+)\)", found.stdout, re.M)
    if found.returncode != 0 or not match:
        reason = (found.stderr.strip().splitlines() or ["no answer"])[-1]
        raise ToolError(f"cannot list megatron-bridge releases on the package index: {reason}")
    return match.group(1)


def release(version: str) -> Target:
    """Any release's wheel (`latest`: the newest), unpacked once into .work/pypi/<version>/."""
    newest = version == "latest"
    version = latest_version() if newest else version
    root = WORK / "pypi" / version
    if not (root / PACKAGE).is_dir():
        _download(version, root)
    return Target(f"megatron-bridge=={version} (PyPI{', latest' if newest else ''})", root, Kind.RELEASE)


def _download(version: str, root: Path) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        got = _pip(
            "download", "--quiet", "--no-deps", "--only-binary", ":all:", f"megatron-bridge=={version}", "-d", tmp
        )
        wheels = list(Path(tmp).glob("megatron_bridge-*.whl"))
        if got.returncode != 0 or not wheels:
            reason = (got.stderr.strip().splitlines() or ["no wheel"])[-1].removeprefix("ERROR: ")
            raise ToolError(f"megatron-bridge {version}: not on the package index or not downloadable ({reason})")
        unpacked = Path(tmp) / "site"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(unpacked, [name for name in wheel.namelist() if name.startswith("megatron/")])
        shutil.move(str(unpacked), root)  # one rename: a half-unpacked release is never left behind
