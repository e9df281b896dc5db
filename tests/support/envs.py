"""The test environment of each release line: the megatron-core its 3rdparty/Megatron-LM submodule pins
(requirements/lines.toml, or the newest its wheel allows) and the transformers its wheel declares.

`python -m tests.support.envs VERSION` prints one line, tab-separated, for ./run: the environment's key (empty for the
pinned release, whose environment is .venv itself), then the pip requirements that make it from requirements/cpu.lock.
Releases that share a megatron-core and a transformers requirement share one environment (.work/envs/<key>).
"""

import re
import subprocess
import sys
import tomllib
from email.parser import Parser

from mtp_mask_fix.errors import ToolError
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
        key, wanted = spec(sys.argv[1])
    except ToolError as exc:
        print(f"mtp-mask-fix: error: {exc}", file=sys.stderr)
        sys.exit(int(exc.code))
    print("\t".join([key, *wanted]))
