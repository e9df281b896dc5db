"""The files the environments need that uv does not fetch itself: uv, the CPU torch wheel, megatron-core's sdist."""

import functools
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from pathlib import Path

from maintain.repo import REPO, WORK
from mtp_mask_fix.errors import ToolError


DISTS = WORK / "dists"  # pyproject.toml's flat index: the files uv.lock names that no index serves as they are
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # where the CPU torch comes from when the machine has none
CORE_INDEX = "https://pypi.org/simple/megatron-core/"
PAGE_SECONDS = 60  # for CORE_INDEX's page of files
DOWNLOAD_SECONDS = 300  # for the sdist itself


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
