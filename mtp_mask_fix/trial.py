"""git and the wheel's RECORD on a copy of a target's files (never the target): whether a diff applies or fits."""

import base64
import csv
import hashlib

from mtp_mask_fix.git import apply_diff, git, stripped
from mtp_mask_fix.journal import doing, scratch
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.targets import Kind, Target


def applied(target: Target, patch: Patch, *, src: bool, reverse=False) -> tuple[dict[str, bytes], str]:
    """Each file the patch's part (`src`) changes, its bytes once `git apply` (-R) on a copy; else {}, git's error."""
    if not (diff := patch.part(src=src)):
        return {}, ""
    files = [stripped(path, target.strip) for path in patch.paths(src=src)]
    with scratch() as tmp:
        for rel in files:
            with doing(f"copying {target.root / rel} into", tmp):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes((target.root / rel).read_bytes())
        error = apply_diff(diff, tmp, strip=target.strip, reverse=reverse)
        return ({}, error) if error else ({rel: (tmp / rel).read_bytes() for rel in files}, "")


def edited(target: Target, diff: str, files: list[str]) -> bool:
    """Whether local edits alone keep the diff from applying: it fits HEAD, or `files` are not as RECORD states."""
    if target.kind is Kind.CHECKOUT:
        with scratch() as tmp:
            env = {"GIT_INDEX_FILE": str(tmp / "index")}
            git("read-tree", "HEAD", cwd=target.root, env=env)
            return not apply_diff(diff, target.root, check=True, cached=True, env=env)
    wheel = target.root.glob("*.dist-info/RECORD") if target.kind is Kind.INSTALLED else []
    rows = [row for path in wheel for row in csv.reader(path.read_text().splitlines())]
    recorded = {row[0]: row[1] for row in rows if len(row) == 3 and row[0] in files}
    sha = {rel: hashlib.sha256((target.root / rel).read_bytes()).digest() for rel in recorded}
    return any(recorded[rel] != f"sha256={base64.urlsafe_b64encode(sha[rel]).decode().rstrip('=')}" for rel in sha)
