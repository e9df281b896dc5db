"""The test environment of each release line: the megatron-core its 3rdparty/Megatron-LM submodule pins
(requirements/lines.toml, or the newest its wheel allows) and the transformers its wheel declares; and of an upstream
checkout: the megatron-core of the commit its HEAD pins for its submodule (PyPI has no core for upstream main), built
from that commit's content, and the transformers its pyproject.toml declares.

`python -m maintain.envs VERSION|CHECKOUT` prints one line, tab-separated, for ./run: the environment's key (empty
for the pinned release, whose environment is .venv itself), then the pip requirements that make it from
requirements/cpu.lock. Releases that share a megatron-core and a transformers requirement share one environment
(.work/envs/<key>); a checkout's key names its submodule's commit.
"""

import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from email.parser import Parser
from pathlib import Path

from maintain.repo import REPO, WORK, pins, release
from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.git import git


def metadata_file(root: Path) -> Path | None:
    """A downloaded release's wheel METADATA (its Requires-Dist and Requires-Python)."""
    return next(iter(root.glob("*.dist-info/METADATA")), None)


def requirement(version: str, name: str) -> str:
    """The release wheel's own requirement on `name` (its version specifier, "" when unpinned)."""
    root = release(version).root
    fields = Parser().parsestr(metadata_file(root).read_text())
    return declared(fields.get_all("Requires-Dist") or [], name) or ""


def declared(requirements: list[str], name: str) -> str | None:
    """The version specifier (spaces dropped, "" when unpinned) of the first of `requirements` (PEP 508 lines, as
    Requires-Dist or [project].dependencies hold them) on `name`, extras and all (`transformers[torch]>=5.8`), but
    not one only an extra asks for; None when none is."""
    for line in requirements:
        req, _, marker = line.partition(";")
        found = re.match(rf"^\s*{re.escape(name)}\s*(\[[^\]]*\])?\s*\(?\s*([<>=!~][^)]*)?\)?\s*$", req, re.I)
        if found and "extra" not in marker:
            return (found.group(2) or "").replace(" ", "")
    return None


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
    """(key, requirements) of an upstream checkout: megatron-core built from the commit its HEAD pins for
    3rdparty/Megatron-LM (the tests run the checkout's HEAD), which must be the one checked out there, then
    transformers and datasets as its pyproject.toml declares them. The build's source is that commit's content,
    unpacked once under .work/src, never the submodule's working tree: pip builds in place, and uncommitted edits or
    a stale build/ there would go into an environment whose key names a clean commit."""
    update = f"`git -C {root} submodule update --init {SUBMODULE}`"
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ToolError(f"{root}: no readable pyproject.toml ({exc}); is it a Megatron-Bridge checkout?") from None
    declared_deps = project.get("dependencies")
    if not isinstance(declared_deps, list):
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
    wanted = [f"megatron-core@{_unpacked(lm, pinned).as_uri()}"]
    for package in ("transformers", "datasets"):
        wanted.append(package + (declared(declared_deps, package) or ""))
    return f"core{version}-{pinned[:12]}-{_name(wanted[1])}", wanted


def _unpacked(repo: Path, commit: str) -> Path:
    """`commit`'s tree from `repo`, unpacked once into .work/src/megatron-lm-<commit12> as gate unpacks a checkout
    (`git archive`, then shutil): via a temporary directory renamed into place, so that a killed run leaves no half
    tree under that name."""
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
        where = Path(sys.argv[1])
        if where.is_dir():
            key, wanted = checkout_spec(where.resolve())
        elif "/" in sys.argv[1]:  # a path, not a version: a typo must not read as "not on the package index"
            raise ToolError(f"{sys.argv[1]}: no such directory")
        else:
            key, wanted = spec(sys.argv[1])
    except ToolError as exc:
        print(f"mtp-mask-fix: error: {exc}", file=sys.stderr)
        sys.exit(int(exc.code))
    print("\t".join([key, *wanted]))
