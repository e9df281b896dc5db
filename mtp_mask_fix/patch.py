"""The carried patch: reading patches/series, splitting the mailbox into its parts, and running git apply."""

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from mtp_mask_fix.errors import ToolError


REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches"
WORK = REPO / ".work"
FIXED_FILE = "src/megatron/bridge/training/gpt_step.py"
VIEW = REPO / FIXED_FILE
BASE_FILE = WORK / "base" / "gpt_step.py"


def pinned_versions() -> dict[str, str]:
    """The pins in requirements/megatron.txt, e.g. {"megatron-bridge": "0.6.2", "megatron-core": "0.19.0"}."""
    pins = {}
    for line in (REPO / "requirements/megatron.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def series() -> list[Path]:
    """Patches listed in patches/series, in order (quilt format: one name a line, # comments)."""
    names = [line.split("#")[0].strip() for line in (PATCHES / "series").read_text().splitlines()]
    return [PATCHES / name for name in names if name]


def git(*args: str, cwd: Path | str | None = None, check: bool = True, env_extra: dict | None = None, **kw):
    """Run the git CLI (the reference behaviour reviewers use); a missing git is a clear error."""
    if shutil.which("git") is None:
        raise ToolError("git is not on PATH; install git (it is what applies and checks the patch)")
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(["git", *args], cwd=cwd, check=check, capture_output=True, text=True, env=env, **kw)


@dataclass
class Patch:
    """One git format-patch mailbox: message, status metadata after `---`, and the diff."""

    path: Path
    text: str

    @classmethod
    def load(cls, path: Path | None = None) -> "Patch":
        path = path or series()[0]
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ToolError(f"cannot read patch {path}: {exc.strerror}") from exc
        if b"\r\n" in raw:
            raise ToolError(f"patch {path} has CRLF line endings; restore it with `git checkout -- {path}`")
        text = raw.decode("utf-8", errors="replace")
        patch = cls(path, text)
        patch.validate()
        return patch

    def validate(self) -> None:
        """The diff parses, and matches the mailbox's own diffstat (catches a patch cut at a file boundary)."""
        patch_set = self.files()
        stat = re.search(
            r"^ (\d+) files? changed(?:, (\d+) insertions?\(\+\))?(?:, (\d+) deletions?\(-\))?$", self.text, re.M
        )
        if stat:
            expected = tuple(int(n or 0) for n in stat.groups())
            found = (len(patch_set), patch_set.added, patch_set.removed)
            if expected != found:
                raise ToolError(
                    f"patch {self.path} is corrupted: its diffstat says {expected[0]} files, +{expected[1]} -{expected[2]}"
                    f" but its diff holds {found[0]} files, +{found[1]} -{found[2]}"
                )

    @property
    def diff(self) -> str:
        """The `diff --git` sections alone: no message, no signature, no `base-commit:` trailer."""
        start = self.text.find("\ndiff --git ")
        if start < 0:
            raise ToolError(f"patch {self.path} is corrupted: it holds no `diff --git` section")
        end = len(self.text)
        for trailer in ("\n-- \n", "\n\nbase-commit: "):  # format-patch signature; the --base trailer
            found = self.text.find(trailer, start)
            end = min(end, found) if found >= 0 else end
        return self.text[start + 1 : end + 1]

    def files(self) -> PatchSet:
        try:
            patch_set = PatchSet(self.diff)
        except UnidiffParseError as exc:
            raise ToolError(f"patch {self.path} is corrupted: {exc}") from exc
        if not patch_set:
            raise ToolError(f"patch {self.path} is corrupted: no file changes found")
        return patch_set

    @property
    def subject(self) -> str:
        match = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*)$", self.text, re.M)
        if not match:
            raise ToolError(f"patch {self.path} is corrupted: no Subject line")
        return match.group(1).strip()

    @property
    def body(self) -> str:
        """The commit message body (between the subject and `---`)."""
        head = self.text.split("\n\n", 1)[1]
        return head.split("\n---\n", 1)[0].strip()

    def metadata(self) -> dict[str, str]:
        """DEP-3 style `Key: value` lines between `---` and the diffstat (git am leaves them out)."""
        section = self.text.split("\n---\n", 1)[1].split("\n\n", 1)[0]
        return dict(line.split(": ", 1) for line in section.splitlines() if re.match(r"^[A-Z][\w-]+: ", line))

    def part(self, *, src: bool | None = None, hunks_left_out: tuple[tuple[str, int], ...] = ()) -> str:
        """A diff of some of the files: src=True upstream sources only, False tests only, None all.

        `hunks_left_out` names (path, hunk index) pairs to drop, to show each source hunk is needed.
        """
        out = []
        for patched_file in self.files():
            is_src = patched_file.path.startswith("src/")
            if src is not None and is_src != src:
                continue
            kept = [h for i, h in enumerate(patched_file) if (patched_file.path, i) not in hunks_left_out]
            if not kept:
                continue
            header = str(patched_file).split("\n@@", 1)[0]
            out.append(header + "\n" + "".join(str(h) for h in kept))
        return "".join(text if text.endswith("\n") else text + "\n" for text in out)

    def source_hunks(self) -> list[tuple[str, int]]:
        return [(f.path, i) for f in self.files() if f.path.startswith("src/") for i in range(len(f))]

    def new_files(self) -> dict[str, str]:
        """Files the patch adds, with their content (the upstream-bound tests it carries)."""
        return {
            f.path: "".join(line.value for hunk in f for line in hunk if line.is_added)
            for f in self.files()
            if f.is_added_file
        }


def apply_diff(diff: str, root: Path, *, strip: int = 1, reverse: bool = False, check: bool = False) -> str:
    """`git apply` a diff to the files under root; returns git's error text ("" on success).

    GIT_CEILING_DIRECTORIES keeps git from treating root as a subdirectory of an enclosing repository
    (it would then resolve paths from that repository's top and skip ours).
    """
    args = ["apply", f"-p{strip}", "--whitespace=nowarn"]
    if reverse:
        args.append("-R")
    if check:
        args.append("--check")
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as handle:
        handle.write(diff)
    try:
        result = git(
            *args,
            handle.name,
            cwd=root,
            check=False,
            env_extra={"GIT_CEILING_DIRECTORIES": str(Path(root).resolve().parent)},
        )
    finally:
        os.unlink(handle.name)
    return "" if result.returncode == 0 else (result.stderr.strip() or result.stdout.strip() or "git apply failed")


def first_error_line(git_stderr: str) -> str:
    """git apply's most telling line, e.g. `error: patch failed: src/.../gpt_step.py:571`."""
    lines = [line for line in git_stderr.splitlines() if line.startswith("error:")]
    return "; ".join(lines[:2]) if lines else (git_stderr.strip().splitlines() or ["git gave no reason"])[0]
