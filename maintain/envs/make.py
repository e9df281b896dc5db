"""Making an environment: the files uv does not fetch itself (uv, the CPU torch wheel, megatron-core's sdist), a
line's project, and `uv sync` of it or of .venv with this checkout's .pth files."""

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path

from maintain.envs.spec import Spec, allows
from maintain.repo import REPO, WORK, pins, release_lines
from mtp_mask_fix.errors import Exit, ToolError


DISTS = WORK / "dists"  # pyproject.toml's flat index: the files uv.lock names that no index serves as they are
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # where the CPU torch comes from when the machine has none
CORE_INDEX = "https://pypi.org/simple/megatron-core/"
PAGE_SECONDS = 60  # for CORE_INDEX's page of files
DOWNLOAD_SECONDS = 300  # for the sdist itself
LAST_TRANSFORMERS_4 = "4.99"  # a line that admits it and not FIRST_TRANSFORMERS_5 is a transformers 4 line
FIRST_TRANSFORMERS_5 = "5.0.0"


def project() -> dict:
    """This checkout's pyproject.toml."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())


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
        with urllib.request.urlopen(request, timeout=PAGE_SECONDS) as page:
            files = {file["filename"]: file for file in json.load(page)["files"]}
        if sdist.name not in files:
            raise ToolError(f"megatron-core {version}: no sdist on {CORE_INDEX}")
        with urllib.request.urlopen(files[sdist.name]["url"], timeout=DOWNLOAD_SECONDS) as got:
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
    if allows(transformers, LAST_TRANSFORMERS_4) and not allows(transformers, FIRST_TRANSFORMERS_5):
        settings["constraint-dependencies"] = [*settings.get("constraint-dependencies", []), "huggingface-hub<1.0"]
    settings["index"] = [index | {"url": str(REPO / index["url"])} for index in settings["index"]]
    settings["sources"] = {name: {"path": str(REPO / where["path"])} for name, where in settings["sources"].items()}
    if line.tree is not None:  # built from that tree, whose version uv must be told (it reads no metadata there)
        settings["sources"]["megatron-core"] = {"path": str(line.tree)}
        version = line.requirements[0].partition("==")[2]
        metadata = [m for m in settings["dependency-metadata"] if m["name"] == "megatron-core"]
        settings["dependency-metadata"] = [m | {"version": version} for m in metadata]
    about = {"name": "mtp-mask-fix-line", "version": "0", "requires-python": root["project"]["requires-python"]}
    document = {"project": about, "dependency-groups": {"dev": dev + line.requirements}, "tool": {"uv": settings}}
    generated = "# Generated by maintain/envs/make.py from the checkout's pyproject.toml; never edited.\n"
    return generated + tomli_w.dumps(document)


def _project_name(requirement: str) -> str:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return canonicalize_name(Requirement(requirement).name)
