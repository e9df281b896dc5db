"""This checkout's places, its release lines, and any release's wheel, downloaded once into .work/pypi/."""

import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.git import git
from mtp_mask_fix.paths import GPT_STEP, PACKAGE, PATCHES, SRC
from mtp_mask_fix.targets import Kind, Target, resolve


REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".work"  # downloads, environments and outputs (git-ignored)
VIEW = REPO / "src"  # the generated view: the pinned release + the patch, importable as `megatron.bridge`
LINES_TOML = Path(__file__).with_name("lines.toml")
FIXED_FILE = f"{SRC}/{GPT_STEP}"  # the one upstream source file the patch changes, in an upstream checkout
UPSTREAM_TEST = "tests/unit_tests/training/test_gpt_step.py"  # upstream's test file the patch extends


def release_lines() -> dict[str, dict]:
    """Every release with MTP, oldest first, and its row of lines.toml (its megatron-core and backport)."""
    return tomllib.loads(LINES_TOML.read_text())["releases"]


def series() -> list[Path]:
    """The patches patches/series lists, in order (quilt's format)."""
    names = [line.split("#")[0].strip() for line in (PATCHES / "series").read_text().splitlines()]
    return [PATCHES / name for name in names if name]


def patch_file(version: str) -> str:
    """The patch that fixes a release, as `check` names it (patches/...)."""
    carried = Path("patches") / series()[0].name
    backport = release_lines()[version].get("backport")
    return str(carried.parent / backport / carried.name if backport else carried)


def pins() -> dict[str, str]:
    """The pinned release (pyproject.toml's [tool.mtp-mask-fix]) and the megatron-core of its dev group."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    core = next(r for r in project["dependency-groups"]["dev"] if re.match(r"megatron-core\s*==", r))
    bridge = project["tool"]["mtp-mask-fix"]["megatron-bridge"]
    return {"megatron-bridge": bridge, "megatron-core": core.partition("==")[2].strip()}


def release(version: str) -> Target:
    """Any release's wheel (`latest`: the newest, not yanked, not a pre-release), unpacked once into .work/pypi/."""
    root = WORK / "pypi" / version
    if version == "latest" or not (root / PACKAGE).is_dir():
        root = _download(version)
    latest = ", latest" if version == "latest" else ""
    return Target(f"megatron-bridge=={root.name} (PyPI{latest})", root, Kind.INSTALLED)


def _download(version: str) -> Path:
    """Download the wheel and unpack its package and METADATA into .work/pypi/<version>/ in one rename."""
    (WORK / "pypi").mkdir(parents=True, exist_ok=True)
    spec = "megatron-bridge" + ("" if version == "latest" else f"=={version}")
    with tempfile.TemporaryDirectory(dir=WORK / "pypi") as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", spec, "-d", tmp]
        quiet = ["--disable-pip-version-check", "--ignore-requires-python"]
        got = subprocess.run([*pip, *quiet], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("megatron_bridge-*.whl"))
        if got.returncode != 0 or not wheels:
            reason = (got.stderr.strip().splitlines() or ["no wheel"])[-1].removeprefix("ERROR: ")
            raise ToolError(f"megatron-bridge {version}: not on the package index or not downloadable ({reason})")
        root = WORK / "pypi" / wheels[0].name.split("-")[1]
        if not (root / PACKAGE).is_dir():
            with zipfile.ZipFile(wheels[0]) as wheel:
                names = [n for n in wheel.namelist() if n.startswith("megatron/") or n.endswith(".dist-info/METADATA")]
                wheel.extractall(Path(tmp) / "site", names)
            shutil.move(str(Path(tmp) / "site"), root)
    return root


def checkout(path: Path | str) -> Target:
    """A Megatron-Bridge git checkout (its top), or a ToolError."""
    target = resolve(str(path))
    if target.kind != Kind.CHECKOUT:
        raise ToolError(f"{path}: not the top of a Megatron-Bridge git checkout with a commit")
    return target


def megatron_lm_checkout(path: Path) -> Target:
    """A Megatron-LM git repository, a clone or bare: gate and refresh read its commits, never a work tree."""
    found = Path(path).is_dir() and git("rev-parse", "-q", "--verify", "HEAD:megatron/core", cwd=path, check=False)
    if not found or found.returncode:
        raise ToolError(f"{path}: not a Megatron-LM git repository (no megatron/core at its HEAD)")
    return Target(str(path), Path(path).resolve(), Kind.CHECKOUT)
