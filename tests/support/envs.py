"""The test environment of each release line: the megatron-core its 3rdparty/Megatron-LM submodule pins
(requirements/lines.toml, or the newest its wheel allows) and the transformers its wheel declares; and of an upstream
checkout: the megatron-core of its checked-out submodule (PyPI has no core for upstream main) and the transformers its
pyproject.toml declares.

`python -m tests.support.envs VERSION|CHECKOUT` prints one line, tab-separated, for ./run: the environment's key (empty
for the pinned release, whose environment is .venv itself), then the pip requirements that make it from
requirements/cpu.lock. Releases that share a megatron-core and a transformers requirement share one environment
(.work/envs/<key>); a checkout's key names its submodule's commit.
"""

import re
import subprocess
import sys
import tomllib
from email.parser import Parser
from pathlib import Path

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.git import git
from mtp_mask_fix.paths import REPO
from mtp_mask_fix.targets import metadata_file, pins, release


def requirement(version: str, name: str) -> str:
    """The release wheel's own requirement on `name` (its version specifier, "" when unpinned)."""
    root = release(version).root
    fields = Parser().parsestr(metadata_file(root).read_text())
    for line in fields.get_all("Requires-Dist") or []:
        req, _, marker = line.partition(";")
        found = re.match(rf"^\s*{re.escape(name)}\s*(\[[^\]]*\])?\s*\(?([^)]*)\)?\s*$", req, re.I)
        if found and "extra" not in marker:
            return found.group(2).replace(" ", "")
    return ""


def core(version: str) -> str:
    """megatron-core for a release: lines.toml's row, the pin for the pinned release, else the newest allowed."""
    table = tomllib.loads((REPO / "requirements" / "lines.toml").read_text())["megatron-core"]
    name = release(version).root.name
    if name in table:
        return f"=={table[name]}"
    if name == pins()["megatron-bridge"]:
        return f"=={pins()['megatron-core']}"
    return f"=={newest('megatron-core', requirement(name, 'megatron-core'))}"


def newest(package: str, allowed: str) -> str:
    """The newest release of `package` on the package index that `allowed` admits (for Python 3.12, as the releases
    of Megatron-Bridge and megatron-core declare), so that an environment's key names what it holds."""
    from packaging.specifiers import SpecifierSet

    index = [sys.executable, "-m", "pip", "index", "versions", package, "--python-version", "3.12"]
    listed = subprocess.run([*index, "--disable-pip-version-check"], capture_output=True, text=True).stdout
    found = re.search(r"^Available versions: (.+)$", listed, re.M)
    versions = list(SpecifierSet(allowed).filter(found.group(1).split(", "))) if found else []
    if not versions:
        raise ToolError(f"{package}{allowed}: nothing on the package index")
    return versions[0]


def spec(version: str) -> tuple[str, list[str]]:
    """(key, requirements): "" for the pinned environment (.venv), else a folder name naming the two pins."""
    name = release(version).root.name
    # datasets too: resolved with transformers, so that both agree on huggingface-hub (transformers < 5 needs < 1.0).
    wanted = [f"megatron-core{core(name)}", *(f"{p}{requirement(name, p)}" for p in ("transformers", "datasets"))]
    pinned = f"megatron-core=={pins()['megatron-core']}"
    lock = (REPO / "requirements" / "cpu.lock").read_text()
    locked = re.search(r"^transformers==(\S+)$", lock, re.M).group(1)
    if wanted[0] == pinned and _allows(wanted[1], locked):
        return "", wanted
    return "-".join(_name(req) for req in wanted[:2]), wanted


SUBMODULE = "3rdparty/Megatron-LM"


def checkout_spec(root: Path) -> tuple[str, list[str]]:
    """(key, requirements) of an upstream checkout: megatron-core built from its 3rdparty/Megatron-LM, which must be
    checked out at the commit the checkout pins (the tests run the checkout's HEAD), then transformers and datasets as
    its pyproject.toml declares them."""
    status = git("submodule", "status", SUBMODULE, cwd=root, check=False).stdout
    if not status.startswith(" "):
        raise ToolError(
            f"{root}: no {SUBMODULE} checked out at the commit its HEAD pins (in a Megatron-Bridge checkout: "
            f"`git -C {root} submodule update --init {SUBMODULE}`)",
        )
    commit, source = status.split()[0], (root / SUBMODULE).resolve()
    info = (source / "megatron" / "core" / "package_info.py").read_text()
    version = ".".join(re.search(rf"^{part} = (\d+)", info, re.M).group(1) for part in ("MAJOR", "MINOR", "PATCH"))
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = [f"megatron-core@{source.as_uri()}"]
    for package in ("transformers", "datasets"):
        found = [d for d in declared if re.match(rf"{package}\s*([<>=!~;]|$)", d)]
        wanted.append(re.sub(r"\s", "", found[0].split(";")[0]) if found else package)
    return f"core{version}-{commit[:12]}-{_name(wanted[1])}", wanted


def _name(requirement: str) -> str:
    """A requirement as part of a folder name: megatron-core==0.18.2 -> core0.18.2, transformers<5 -> transformers-lt5."""
    ops = {"==": "", "<=": "le", ">=": "ge", "<": "lt", ">": "gt", "~=": "compat", "!=": "ne", ",": "-"}
    name, rest = re.match(r"^([\w.-]+?)([<>=!~].*)?$", requirement).groups()
    text = re.sub("|".join(map(re.escape, sorted(ops, key=len, reverse=True))), lambda m: ops[m.group()], rest or "")
    return name.removeprefix("megatron-") + ("" if (rest or "").startswith("==") else "-") + text


def _allows(requirement: str, version: str) -> bool:
    from packaging.requirements import Requirement

    return Requirement(requirement).specifier.contains(version, prereleases=True)


if __name__ == "__main__":
    try:
        key, wanted = checkout_spec(Path(sys.argv[1]).resolve()) if Path(sys.argv[1]).is_dir() else spec(sys.argv[1])
    except ToolError as exc:
        print(f"mtp-mask-fix: error: {exc}", file=sys.stderr)
        sys.exit(int(exc.code))
    print("\t".join([key, *wanted]))
