"""The test environments, each one `uv sync`: .venv, and one per release line or upstream checkout in .work/envs.

    python -m maintain.envs [VERSION|CHECKOUT]    # syncs it (.venv without an argument) and prints its interpreter

A line's environment is a project generated from pyproject.toml's dev group with the line's megatron-core (lines.toml,
or the commit a checkout pins for its submodule), transformers and datasets, starting from uv.lock's versions, so that
it differs from .venv only where its pins make it. CONTRIBUTING.md says where torch and megatron-core's sdist come from.
"""

import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import urllib.request
from email.parser import Parser
from pathlib import Path
from typing import NamedTuple

from maintain.repo import REPO, WORK, pins, release, release_lines
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import git
from mtp_mask_fix.signals import SIGNALS


DISTS = WORK / "dists"  # pyproject.toml's flat index: the files uv.lock names that no index serves as they are
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # where the CPU torch comes from when the machine has none
CORE_INDEX = "https://pypi.org/simple/megatron-core/"
SUBMODULE = "3rdparty/Megatron-LM"


class Spec(NamedTuple):
    """A test environment: its folder under .work/envs ("" for .venv), its requirements, and core's source tree."""

    key: str
    requirements: list[str]
    tree: Path | None = None


def project() -> dict:
    """This checkout's pyproject.toml."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def metadata_file(root: Path) -> Path | None:
    """A downloaded release's wheel METADATA (its Requires-Dist and Requires-Python)."""
    return next(iter(root.glob("*.dist-info/METADATA")), None)


def requirement(version: str, name: str) -> str:
    """The release wheel's own requirement on `name` (its version specifier, "" when unpinned)."""
    root = release(version).root
    fields = Parser().parsestr(metadata_file(root).read_text())
    return declared(fields.get_all("Requires-Dist") or [], name) or ""


def declared(requirements: list[str], name: str) -> str | None:
    """The version specifier of the first of `requirements` (PEP 508) on `name`, "" when unpinned, None when absent."""
    for line in requirements:
        req, _, marker = line.partition(";")
        found = re.match(rf"^\s*{re.escape(name)}\s*(\[[^\]]*\])?\s*\(?\s*([<>=!~][^)]*)?\)?\s*$", req, re.I)
        if found and "extra" not in marker:
            return (found.group(2) or "").replace(" ", "")
    return None


def core(version: str) -> str:
    """megatron-core for a release: lines.toml's row, the pin for the pinned release, else the newest allowed."""
    name = release(version).root.name
    if core := release_lines().get(name, {}).get("megatron-core"):
        return f"=={core}"
    if name == pins()["megatron-bridge"]:
        return f"=={pins()['megatron-core']}"
    return f"=={newest('megatron-core', requirement(name, 'megatron-core'))}"


def newest(package: str, allowed: str) -> str:
    """The newest release of `package` for Python 3.12 that `allowed` admits, so that a key names what it holds."""
    from packaging.specifiers import SpecifierSet

    index = [sys.executable, "-m", "pip", "index", "versions", package, "--python-version", "3.12"]
    listed = subprocess.run([*index, "--disable-pip-version-check"], capture_output=True, text=True).stdout
    found = re.search(r"^Available versions: (.+)$", listed, re.M)
    versions = list(SpecifierSet(allowed).filter(found.group(1).split(", "))) if found else []
    if not versions:
        raise ToolError(f"{package}{allowed}: nothing on the package index")
    return versions[0]


def spec(version: str) -> Spec:
    """A release's environment: "" (.venv) when it is the pinned one's, else a folder naming the two pins."""
    name = release(version).root.name
    # datasets too: resolved with transformers, so that both agree on huggingface-hub (transformers < 5 needs < 1.0).
    wanted = [f"megatron-core{core(name)}", *(f"{p}{requirement(name, p)}" for p in ("transformers", "datasets"))]
    pinned = f"megatron-core=={pins()['megatron-core']}"
    if wanted[0] == pinned and _allows(wanted[1], locked_version("transformers")):
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
    declared_deps = upstream.get("dependencies")
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
    wanted = [f"megatron-core=={version}"]
    for package in ("transformers", "datasets"):
        wanted.append(package + (declared(declared_deps, package) or ""))
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
    """A requirement as part of a folder name (megatron-core==0.18.2 -> core0.18.2, transformers<5 -> transformers-lt5)."""
    ops = {"==": "", "<=": "le", ">=": "ge", "<": "lt", ">": "gt", "~=": "compat", "!=": "ne", ",": "-"}
    name, rest = re.match(r"^([\w.-]+?)([<>=!~].*)?$", requirement).groups()
    text = re.sub("|".join(map(re.escape, sorted(ops, key=len, reverse=True))), lambda m: ops[m.group()], rest or "")
    return name.removeprefix("megatron-") + ("" if (rest or "").startswith("==") else "-") + text


def _allows(requirement: str, version: str) -> bool:
    from packaging.requirements import Requirement

    return Requirement(requirement).specifier.contains(version, prereleases=True)


def _project_name(requirement: str) -> str:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return canonicalize_name(Requirement(requirement).name)


def locked_version(package: str) -> str:
    """The version uv.lock pins for `package`."""
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    return next(entry["version"] for entry in lock["package"] if entry["name"] == package)


# --- Making them ----------------------------------------------------------------------------------------------------


def say(text: str) -> None:
    """A line of ./run's own, on stderr (stdout carries only the interpreter)."""
    print(f"[run] {text}", file=sys.stderr, flush=True)


@functools.cache
def uv() -> str:
    """The uv pyproject.toml requires: on PATH if it is that one, else installed by pip into .work/uv, once."""
    wanted = project()["tool"]["uv"]["required-version"].removeprefix("==")
    mine = WORK / "uv" / "bin" / "uv"
    for candidate in filter(None, (shutil.which("uv"), mine.is_file() and str(mine))):
        if subprocess.run([candidate, "--version"], capture_output=True, text=True).stdout.split()[1:2] == [wanted]:
            return candidate
    say(f"installing uv {wanted} into {mine.parent.parent} (pip, once)")
    WORK.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WORK, prefix=".uv.") as tmp:
        _pip("install", "--no-deps", "--target", f"{tmp}/uv", f"uv=={wanted}", failure=f"uv {wanted} not installed")
        shutil.rmtree(mine.parent.parent, ignore_errors=True)
        Path(tmp, "uv").rename(mine.parent.parent)
    return str(mine)


def _pip(*args: str, failure: str | None) -> bool:
    """pip with the machine's configuration, quiet unless it fails; with `failure`, a failure is that ToolError."""
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True)
    if done.returncode != 0 and failure:
        sys.stderr.buffer.write(done.stdout + done.stderr)
        raise ToolError(f"{failure} (pip's output above)")
    return done.returncode == 0


def stage_torch() -> None:
    """The CPU torch wheel pyproject.toml names, into .work/dists: from pip's own sources, else PyTorch's CPU index."""
    wheel = REPO / project()["tool"]["uv"]["sources"]["torch"]["path"]
    if wheel.is_file():
        return
    torch = "torch==" + wheel.name.split("-")[1]  # 2.13.0+cpu: only a CPU build matches, never PyPI's CUDA one
    get = ["download", "--no-deps", "--only-binary", ":all:", "-d", str(wheel.parent), torch]
    if not _pip(*get, failure=None):
        say(f"{torch} is not among this machine's package sources: downloading it from {TORCH_INDEX}")
        _pip(*get, "--index-url", TORCH_INDEX, failure=f"{torch}: not downloadable")


def stage_core(version: str) -> Path:
    """megatron-core's sdist `version` into .work/dists from PyPI, its sha256 checked, written whole or not at all."""
    sdist = DISTS / f"megatron_core-{version}.tar.gz"
    if sdist.is_file():
        return sdist
    request = urllib.request.Request(CORE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as page:
            files = {file["filename"]: file for file in json.load(page)["files"]}
        if sdist.name not in files:
            raise ToolError(f"megatron-core {version}: no sdist on {CORE_INDEX}")
        with urllib.request.urlopen(files[sdist.name]["url"], timeout=300) as got:
            data = got.read()
    except OSError as exc:
        raise ToolError(f"megatron-core {version}: {CORE_INDEX} not reachable ({exc})") from None
    if hashlib.sha256(data).hexdigest() != files[sdist.name]["hashes"]["sha256"]:
        raise ToolError(f"{sdist.name}: the download does not match the sha256 {CORE_INDEX} gives")
    DISTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=DISTS, prefix=f".{sdist.name}.") as tmp:
        Path(tmp, sdist.name).write_bytes(data)
        Path(tmp, sdist.name).rename(sdist)
    return sdist


def sync(folder: Path, *flags: str) -> Path:
    """`uv sync` of the project in `folder` with this Python (a quick check when in sync); returns its interpreter."""
    # NO_VCS_VERSION=1: a megatron-core built here is X.Y.Z, not X.Y.Z+<the commit of the enclosing repository>.
    command = [uv(), "sync", "--project", str(folder), "--python", sys._base_executable, *flags]
    env = os.environ | {"NO_VCS_VERSION": "1"}
    if subprocess.run([*command, "--check", "--quiet"], env=env, capture_output=True).returncode != 0:
        start = time.monotonic()
        say(f"syncing {folder / '.venv'} (uv; the first time about a minute)")
        if subprocess.run(command, env=env).returncode != 0:
            raise ToolError(f"{folder / '.venv'}: uv sync failed (above)", Exit.FAILED)
        say(f"environment ready in {time.monotonic() - start:.0f} s")
    venv = folder / ".venv"
    site = sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)})  # its Python is this one
    # tinymodel/site's sitecustomize (CPU shims) loads in every Python process of the environment: pytest, its
    # forked sessions, verify's probe, every worker rank; and this checkout's packages import from anywhere, as
    # .venv's editable install of the tool gives it. Rewritten each time: cheap, and they follow the checkout.
    Path(site, "mtp-mask-fix-cpu-shims.pth").write_text(f"{REPO / 'tinymodel' / 'site'}\n")
    Path(site, "mtp-mask-fix-checkout.pth").write_text(f"{REPO}\n")
    # Bytecode, PYTHONDONTWRITEBYTECODE or not, written by the first interpreter that imports a module, into
    # .work/pycache: only what the suite imports is compiled, once, and no tree under test gains a __pycache__.
    prefix = f"import sys; sys.pycache_prefix = {str(WORK / 'pycache')!r}; sys.dont_write_bytecode = False\n"
    Path(site, "mtp-mask-fix-bytecode.pth").write_text(prefix)
    return venv / "bin" / "python"


def checkout_environment() -> Path:
    """Sync .venv and, meanwhile, fetch every release line's wheel, so that the suite downloads nothing."""
    stage_torch()
    stage_core(pins()["megatron-core"])
    versions = dict.fromkeys([pins()["megatron-bridge"], *release_lines()])
    missing = [version for version in versions if not (WORK / "pypi" / version).is_dir()]
    fetch = "import sys\nfrom maintain.repo import release\nfor version in sys.argv[1:]: release(version)"
    fetching = missing and subprocess.Popen(
        [sys.executable, "-c", fetch, *missing], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        python = sync(REPO, "--locked")
    finally:
        said = fetching.communicate()[1].decode().strip().splitlines() if fetching else []
    if fetching and fetching.returncode != 0:  # its last line: the ToolError's, or the traceback's end
        reason = said[-1] if said else f"exit {fetching.returncode}"
        say(f"warning: release wheels not fetched; the tests that read them will download them ({reason})")
    return python


def line_environment(line: Spec) -> Path:
    """Sync a release line's or checkout's environment in .work/envs/<key>; returns its interpreter."""
    folder = WORK / "envs" / line.key
    folder.mkdir(parents=True, exist_ok=True)
    stage_torch()
    if line.tree is None:
        stage_core(line.requirements[0].partition("==")[2])
    text = _line_project(line)
    if not (folder / "pyproject.toml").is_file() or (folder / "pyproject.toml").read_text() != text:
        (folder / "pyproject.toml").write_text(text)
    base = (REPO / "uv.lock").read_bytes()
    digest = hashlib.sha256(base).hexdigest()
    if not (folder / "uv.lock.base").is_file() or (folder / "uv.lock.base").read_text() != digest:
        (folder / "uv.lock").write_bytes(base)  # uv keeps every version it can from this lock
        (folder / "uv.lock.base").write_text(digest)
    return sync(folder)


def _line_project(line: Spec) -> str:
    """The pyproject.toml of a line's environment: the dev group with the line's requirements, paths made absolute."""
    import tomli_w

    root = project()
    replaced = {_project_name(req) for req in line.requirements}
    dev = [req for req in root["dependency-groups"]["dev"] if _project_name(req) not in replaced]
    own = ("config-settings-package", "cache-keys")  # of the tool's editable install, which a line has not
    settings = {key: value for key, value in root["tool"]["uv"].items() if key not in own}
    settings["package"] = False
    transformers = next(req for req in line.requirements if _project_name(req) == "transformers")
    # A transformers 4 line: transformers 4 needs huggingface-hub < 1.0. Unsaid, uv keeps the dev lock's newer hub and
    # datasets and goes back to a transformers 4.1x that does not bound the hub (and builds tokenizers from source).
    if _allows(transformers, "4.99") and not _allows(transformers, "5.0.0"):
        settings["constraint-dependencies"] = [*settings.get("constraint-dependencies", []), "huggingface-hub<1.0"]
    settings["index"] = [index | {"url": str(REPO / index["url"])} for index in settings["index"]]
    settings["sources"] = {name: {"path": str(REPO / where["path"])} for name, where in settings["sources"].items()}
    if line.tree is not None:  # built from that tree, whose version uv must be told (it reads no metadata there)
        settings["sources"]["megatron-core"] = {"path": str(line.tree)}
        version = line.requirements[0].partition("==")[2]
        metadata = [m for m in settings["dependency-metadata"] if m["name"] == "megatron-core"]
        settings["dependency-metadata"] = [m | {"version": version} for m in metadata]
    document = {
        "project": {
            "name": "mtp-mask-fix-line",
            "version": "0",
            "requires-python": root["project"]["requires-python"],
        },
        "dependency-groups": {"dev": dev + line.requirements},
        "tool": {"uv": settings},
    }
    return "# Generated by maintain/envs.py from the checkout's pyproject.toml; never edited.\n" + tomli_w.dumps(
        document
    )


def _interrupted(signum, _frame):
    raise ToolError(f"interrupted by {signal.Signals(signum).name}: run it again to finish", 128 + signum)


if __name__ == "__main__":
    for _signum in SIGNALS:
        signal.signal(_signum, _interrupted)
    try:
        if len(sys.argv) == 1:
            print(checkout_environment())
            sys.exit(0)
        where = Path(sys.argv[1])
        if where.is_dir():
            line = checkout_spec(where.resolve())
        elif "/" in sys.argv[1]:  # a path, not a version: a typo must not read as "not on the package index"
            raise ToolError(f"{sys.argv[1]}: no such directory")
        else:
            line = spec(sys.argv[1])
        print(line_environment(line) if line.key else REPO / ".venv" / "bin" / "python")
    except ToolError as exc:
        print(f"mtp-mask-fix: error: {exc}", file=sys.stderr)
        sys.exit(int(exc.code))
