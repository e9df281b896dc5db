"""The carried patch, a git format-patch mailbox read by `git mailinfo` and unidiff."""

import re
from dataclasses import dataclass, field
from pathlib import Path

from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.git import git
from mtp_mask_fix.journal import scratch
from mtp_mask_fix.paths import is_source


@dataclass(frozen=True)
class Patch:
    """One mailbox, with git's reading of its headers and message, its DEP-3 block and its diff."""

    path: Path
    text: str
    headers: dict[str, str]  # git mailinfo's Author, Email, Subject, Date
    body: str
    metadata: dict[str, str]
    files: PatchSet = field(repr=False, compare=False)

    @classmethod
    def load(cls, path: Path, text: str | None = None) -> "Patch":
        """Read a mailbox (`text`, else its file's) as format-patch writes it; maintain's load refuses one damaged."""
        text = path.read_bytes().decode(errors="replace") if text is None else text
        with scratch() as tmp:
            msg, rest = tmp / "msg", tmp / "rest"
            info = git("mailinfo", str(msg), str(rest), input=text)
            headers = dict(line.split(": ", 1) for line in info.stdout.splitlines() if ": " in line)
            body, after = msg.read_text().strip(), rest.read_text()
        start = after.find("diff --git ")
        ends = [end for end in (after.find(mark, start) for mark in ("\n-- \n", "\n\nbase-commit: ")) if end >= 0]
        diff = after[start : min(ends, default=len(after)) + 1] if start >= 0 else ""
        block = after.removeprefix("---\n").split("\n\n", 1)[0]
        metadata = dict(line.split(": ", 1) for line in block.splitlines() if re.match(r"^[A-Z][\w-]+: ", line))
        try:
            return cls(path, text, headers, body, metadata, PatchSet(diff))
        except UnidiffParseError as exc:  # a mailbox cut short: the package's copy is damaged
            raise ToolError(f"{path}: its diff is cut short ({exc}); reinstall mtp-mask-fix") from exc

    def part(self, *, src: bool | None = None) -> str:
        """The diff of the sources (`src` True), the rest (False) or all (None)."""
        return "".join(str(f) for f in self.files if src is None or is_source(f.path) == src)

    def paths(self, *, src: bool | None = None) -> list[str]:
        """The paths of the files the patch changes (`src` as in part), as an upstream checkout names them."""
        return [f.path for f in self.files if src is None or is_source(f.path) == src]


def failed_hunk(error: str) -> int | None:
    """The first source line of the hunk that git's error from `git apply` names, None if it names none."""
    failed = re.search(r"patch failed: \S+:(\d+)", error)
    return int(failed[1]) if failed else None
