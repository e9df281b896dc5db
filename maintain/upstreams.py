"""The two upstreams this repo carries patches for, told apart by what `Upstream` says, and their patches read one way."""

import dataclasses
import re
import subprocess
from pathlib import Path

from unidiff.errors import UnidiffParseError

from maintain.redgreen.contract import GPT_STEP_MODULE
from maintain.repo import REPO, series
from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import SRC, is_source


DIFFSTAT = re.compile(r"^ (\d+) files? changed(?:, (\d+) insertions?\(\+\))?(?:, (\d+) deletions?\(-\))?$", re.M)
MEGATRON_LM_PATCHES = REPO / "patches" / "megatron-lm"  # one mailbox per Megatron-LM branch, <branch>.patch


@dataclasses.dataclass(frozen=True)
class Upstream:
    """What gate needs of an upstream: the module its patch changes, what its tree of a commit takes (and puts under
    src/), its test sessions' options here, and whether every test the patch leaves alone must pass on the base."""

    module: str
    top: tuple[str, ...]
    sources: str = ""
    options: tuple[str, ...] = ()
    every_test: bool = True
    linked: tuple[str, ...] = ()  # folders of src/ that upstream's tests find from the tree's root, as links there


BRIDGE = Upstream(GPT_STEP_MODULE, ("src", "tests", "pyproject.toml", "ruff.toml"))
# Most of Megatron-LM's test_multi_token_prediction.py needs CUDA, Transformer Engine or several ranks: those that pass
# on the base here must pass patched, the rest are counted. --noconftest: its conftest downloads test data at start;
# core_unit_tests_cpu (tinymodel/site) runs its test utilities on gloo and the CPU. Its lint reads the last four.
MEGATRON_LM = Upstream(
    "megatron.core.transformer.multi_token_prediction",
    ("tests/__init__.py", "tests/unit_tests", "pyproject.toml", ".pylintrc", "uv.lock", ".python-version"),
    "megatron",
    ("--noconftest", "-p", "core_unit_tests_cpu"),
    every_test=False,
)


# Megatron-LM's own callers of the model (patches/megatron-lm/callers): examples/ is source too, which a test file reads
# by its path from the tree's root; the module is the one whose import from the session's own tree gate checks.
CALLERS = dataclasses.replace(
    MEGATRON_LM,
    module="megatron.elastification.flextron_utils",
    top=(*MEGATRON_LM.top, "model_provider.py"),  # the examples import it from the root
    sources="megatron examples",
    linked=("examples",),
)


def upstream_of(patch: Patch) -> Upstream:
    """The upstream a patch is for: Megatron-LM's live in patches/megatron-lm, its callers' in callers/ there."""
    folder = patch.path.resolve().parent
    if MEGATRON_LM_PATCHES in (folder, folder.parent):
        return MEGATRON_LM if folder == MEGATRON_LM_PATCHES else CALLERS
    return BRIDGE


def base_commit(patch: Patch) -> str | None:
    """The commit its mailbox names as its base (format-patch --base), None if it names none."""
    base = re.search(r"^base-commit: ([0-9a-f]{40})$", patch.text, re.M)
    return base and base.group(1)


def patched_tests(patch: Patch) -> list[str]:
    """The upstream test files the patch changes, as an upstream checkout names them."""
    return [path for path in patch.paths(src=False) if path.startswith("tests/")]


def load(path: Path | None = None, text: str | None = None) -> Patch:
    """A patch of either upstream that maintain is given (the carried one by default), refused in one line where it
    is damaged; a Megatron-LM mailbox's megatron/ and examples/ read as under src/, where gate puts it, so that Patch's
    split of source and tests holds for both (its `text` stays the file's)."""
    path = Path(path or series()[0])
    if text is None:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ToolError(f"cannot read patch {path}: {exc.strerror}") from exc
        if b"\r\n" in raw:
            raise ToolError(f"patch {path} has CRLF line endings; restore it with `git checkout -- {path}`")
        text = raw.decode("utf-8", errors="replace")
    moved = text
    if MEGATRON_LM_PATCHES in path.resolve().parents:
        moved = re.sub(r"(?m)^(diff --git a/|--- a/|\+\+\+ b/)(megatron|examples)/", r"\1src/\2/", text)
        moved = re.sub(r" b/(megatron|examples)/", r" b/src/\1/", moved)
    try:
        patch = dataclasses.replace(Patch.load(path, moved), text=text)
    except subprocess.CalledProcessError as exc:
        raise ToolError(f"patch {path} is corrupted: git mailinfo cannot read it") from exc
    except ToolError as exc:  # the tool's own words tell an installed tool's user to reinstall it
        if not isinstance(exc.__cause__, UnidiffParseError):
            raise
        raise ToolError(f"patch {path} is corrupted: {exc.__cause__}") from exc
    _refuse_damaged(patch)
    return patch


def _refuse_damaged(patch: Patch) -> None:
    """Refuse in one line a mailbox that is not a whole patch the tool can carry."""
    files = patch.files
    stat = DIFFSTAT.search(patch.text)  # a patch cut at a file boundary still parses: its own diffstat tells
    said = stat and tuple(int(n or 0) for n in stat.groups())
    found = (len(files), files.added, files.removed)
    for failed, why in [
        (not patch.headers.get("Subject"), "no Subject line"),
        (not files, "it holds no file changes"),
        (stat and said != found, f"its diffstat says {said} (files, +, -) but its diff holds {found}"),
    ]:
        if failed:
            raise ToolError(f"patch {patch.path} is corrupted: {why}")
    made = [f.path for f in [*files.added_files, *files.removed_files]]
    if made or not any(is_source(f.path) for f in files):
        why = f"it creates or deletes {made[0]}" if made else f"it changes nothing under {SRC}/"
        raise ToolError(
            f"patch {patch.path}: {why}; the tool carries changes to existing files, one at least under {SRC}/"
        )
