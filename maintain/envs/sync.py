"""Making an environment: the project of a line's, and `uv sync` of it or of .venv, with the checkout's .pth files."""

import hashlib
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from maintain.envs.spec import Spec, allows
from maintain.envs.stage import project, say, stage_core, stage_torch, uv
from maintain.repo import REPO, WORK, pins, release_lines
from mtp_mask_fix.errors import Exit, ToolError


LAST_TRANSFORMERS_4 = "4.99"  # a line that admits it and not FIRST_TRANSFORMERS_5 is a transformers 4 line
FIRST_TRANSFORMERS_5 = "5.0.0"


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
    generated = "# Generated by maintain/envs/sync.py from the checkout's pyproject.toml; never edited.\n"
    return generated + tomli_w.dumps(document)


def _project_name(requirement: str) -> str:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    return canonicalize_name(Requirement(requirement).name)
