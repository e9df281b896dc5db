"""What each test environment holds: its key (its folder under .work/envs) and its requirements, .venv's dev group but
for the line's megatron-core (lines.toml, or a checkout's submodule commit), transformers and datasets."""

import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from email.parser import Parser
from pathlib import Path
from typing import NamedTuple

from maintain.repo import REPO, WORK, pins, release, release_lines
from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.git import git


SUBMODULE = "3rdparty/Megatron-LM"
INDEX_PYTHON = "3.12"  # the Python the releases of Megatron-Bridge and megatron-core declare (they run on 3.11 here)


class Spec(NamedTuple):
    """A test environment: its folder under .work/envs ("" for .venv), its requirements, and core's source tree."""

    key: str
    requirements: list[str]
    tree: Path | None = None


def requirement(version: str, name: str) -> str:
    """The release wheel's own requirement on `name` (its version specifier, "" when unpinned)."""
    (metadata,) = release(version).root.glob("*.dist-info/METADATA")  # what repo.release unpacks of the wheel
    return declared(Parser().parsestr(metadata.read_text()).get_all("Requires-Dist") or [], name) or ""


def declared(requirements: list[str], name: str) -> str | None:
    """The version specifier of the first of `requirements` (PEP 508) on `name`, "" when unpinned, None when absent."""
    for line in requirements:
        req, _, marker = line.partition(";")
        found = re.match(rf"^\s*{re.escape(name)}\s*(\[[^\]]*\])?\s*\(?\s*([<>=!~][^)]*)?\)?\s*$", req, re.I)
        if found and "extra" not in marker:
            return (found.group(2) or "").replace(" ", "")
    return None


def newest(package: str, allowed: str) -> str:
    """The newest release of `package` for INDEX_PYTHON that `allowed` admits, so that a key names what it holds."""
    from packaging.specifiers import SpecifierSet

    index = [sys.executable, "-m", "pip", "index", "versions", package, "--python-version", INDEX_PYTHON]
    listed = subprocess.run([*index, "--disable-pip-version-check"], capture_output=True, text=True).stdout
    found = re.search(r"^Available versions: (.+)$", listed, re.M)
    versions = list(SpecifierSet(allowed).filter(found.group(1).split(", "))) if found else []
    if not versions:
        raise ToolError(f"{package}{allowed}: nothing on the package index")
    return versions[0]


def spec(version: str) -> Spec:
    """A release's environment: "" (.venv) when it is the pinned one's, else a folder naming the two pins."""
    name = release(version).root.name
    core = release_lines().get(name, {}).get("megatron-core")  # lines.toml's row, else the pin's or the newest allowed
    if not core:
        pinned = name == pins()["megatron-bridge"]
        core = pins()["megatron-core"] if pinned else newest("megatron-core", requirement(name, "megatron-core"))
    # datasets too: resolved with transformers, so that both agree on huggingface-hub (transformers < 5 needs < 1.0).
    wanted = [f"megatron-core=={core}", *(f"{p}{requirement(name, p)}" for p in ("transformers", "datasets"))]
    if core == pins()["megatron-core"] and allows(wanted[1], locked_version("transformers")):
        return Spec("", wanted)
    return Spec("-".join(_name(req) for req in wanted[:2]), wanted)


def checkout_spec(root: Path) -> Spec:
    """An upstream checkout's environment: megatron-core from the commit its HEAD pins, transformers as it declares."""
    # Built from that commit's content, never the submodule's working tree, whose edits or stale build/ would go into
    # an environment whose key names a clean commit.
    update = f"`git -C {root} submodule update --init {SUBMODULE}`"
    try:
        upstream = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ToolError(f"{root}: no readable pyproject.toml ({exc}); is it a Megatron-Bridge checkout?") from None
    deps = upstream.get("dependencies")
    if not isinstance(deps, list):
        raise ToolError(f"{root}/pyproject.toml: no static [project].dependencies to read transformers' pin from")
    pinned = git("rev-parse", "--verify", "-q", f"HEAD:{SUBMODULE}", cwd=root, check=False).stdout.strip()
    if not pinned:
        raise ToolError(f"{root}: its HEAD pins no {SUBMODULE}; is it a Megatron-Bridge checkout?")
    lm = root / SUBMODULE
    # Without its own .git, `git -C` would answer for the enclosing checkout.
    held = git("-C", str(lm), "rev-parse", "HEAD", check=False).stdout.strip() if (lm / ".git").exists() else ""
    if held != pinned:
        state = f"holds {held[:12]}" if held else "is not checked out"
        raise ToolError(f"{root}: {SUBMODULE} {state}, its HEAD pins {pinned[:12]}; run {update}")
    info = git("-C", str(lm), "show", f"{pinned}:megatron/core/package_info.py", check=False).stdout
    parts = [re.search(rf"^{part} = (\d+)", info, re.M) for part in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        where = f"{SUBMODULE}/megatron/core/package_info.py at {pinned[:12]}"
        raise ToolError(f"{root}: no MAJOR/MINOR/PATCH version in {where}" if info else f"{root}: no {where}")
    version = ".".join(part.group(1) for part in parts)
    wanted = [f"megatron-core=={version}", *(p + (declared(deps, p) or "") for p in ("transformers", "datasets"))]
    return Spec(f"core{version}-{pinned[:12]}-{_name(wanted[1])}", wanted, _unpacked(lm, pinned))


def _unpacked(repo: Path, commit: str) -> Path:
    """`commit`'s tree from `repo`, unpacked once into .work/src (renamed into place: a killed run leaves no half)."""
    tree = WORK / "src" / f"megatron-lm-{commit[:12]}"
    if tree.is_dir():
        return tree
    tree.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tree.parent, prefix=f".{tree.name}.") as tmp:
        if git("archive", "-o", f"{tmp}/tree.tar", commit, cwd=repo, check=False).returncode != 0:
            raise ToolError(f"{repo}: `git archive {commit}` failed")
        shutil.unpack_archive(f"{tmp}/tree.tar", f"{tmp}/tree")
        try:
            Path(tmp, "tree").rename(tree)
        except OSError:
            if not tree.is_dir():  # else another run unpacked it first
                raise
    return tree


def _name(requirement: str) -> str:
    """A requirement in a folder name (megatron-core==0.18.2 -> core0.18.2, transformers<5 -> transformers-lt5)."""
    ops = {"==": "", "<=": "le", ">=": "ge", "<": "lt", ">": "gt", "~=": "compat", "!=": "ne", ",": "-"}
    name, rest = re.match(r"^([\w.-]+?)([<>=!~].*)?$", requirement).groups()
    text = re.sub("|".join(map(re.escape, sorted(ops, key=len, reverse=True))), lambda m: ops[m.group()], rest or "")
    return name.removeprefix("megatron-") + ("" if (rest or "").startswith("==") else "-") + text


def allows(requirement: str, version: str) -> bool:
    """Whether `requirement` admits `version` (pre-releases too)."""
    from packaging.requirements import Requirement

    return Requirement(requirement).specifier.contains(version, prereleases=True)


def locked_version(package: str) -> str:
    """The version uv.lock pins for `package`."""
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    return next(entry["version"] for entry in lock["package"] if entry["name"] == package)
