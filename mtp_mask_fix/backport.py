"""Backports: the carried patch for release lines whose gpt_step.py differs next to the fix, derived, never edited.

Every release line since MTP arrived builds the same `forward_args = {...}` literal in `_forward_step_common` with
`use_mtp` in scope; only the lines after it differ: `if packed_seq_metadata is not None:` from 0.6 on (the carried
patch applies there), `if cu_seqlens is not None:` before (v0.2.0 to 0.5.1), and upstream's test file is another
one there. A backport is the carried patch's source hunks applied with two lines of trailing context to the newest
release of such a line and diffed again with git's usual three: the same added lines, that line's context, the
same mailbox headers and DEP-3 block. `python -m mtp_mask_fix.backport` rewrites them; a tool test checks that each
committed file equals its derivation (a drift guard).
"""

import sys
import tempfile
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, git
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import FIXED_FILE, PATCHES


# Each backport's folder under patches/ and the release its context is taken from (the line's newest release).
LINES = {"0.2-0.5": "0.5.1"}


def path(line: str, main: Patch) -> Path:
    """Where the backport of `main` for `line` lives: patches/<line>/<main's file name>."""
    return PATCHES / line / main.path.name


def backports(main: Patch) -> list[Path]:
    """The committed backports of `main`, oldest line last."""
    return [p for p in (path(line, main) for line in LINES) if p.is_file()]


def derive(main: Patch, base_source: str) -> str:
    """The mailbox of `main`'s source hunks on `base_source` (a gpt_step.py its hunks do not fit as they are)."""
    author = {
        f"GIT_{who}_{what}": main.headers[key]
        for who in ("AUTHOR", "COMMITTER")
        for what, key in (("NAME", "Author"), ("EMAIL", "Email"), ("DATE", "Date"))
    }
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        git("init", "--quiet", cwd=repo)
        (repo / FIXED_FILE).parent.mkdir(parents=True)
        (repo / FIXED_FILE).write_text(base_source)
        git("add", "-A", cwd=repo)
        git("commit", "--quiet", "--no-verify", "-m", "base", cwd=repo, env=author)
        diff = main.part(src=True)
        if not apply_diff(diff, repo, check=True):
            raise ToolError("the carried patch applies to this base as it is: no backport needed", Exit.FAILED)
        done = git("apply", "-C2", "--whitespace=nowarn", "-", cwd=repo, input=diff, check=False)
        if done.returncode != 0:
            raise ToolError(f"the carried patch does not fit this base: {first_error_line(done.stderr)}", Exit.DRIFTED)
        git(
            "commit",
            "--quiet",
            "--no-verify",
            "-a",
            "-F",
            "-",
            cwd=repo,
            env=author,
            input=f"{main.subject}\n\n{main.body}\n",
        )
        text = git("format-patch", "-1", "--stdout", "--zero-commit", "--no-signature", "HEAD", cwd=repo).stdout
    head, sep, rest = text.partition("\n---\n")
    return f"{head}{sep}" + "".join(f"{key}: {value}\n" for key, value in main.metadata.items()) + f"\n{rest}"


def derive_for(line: str, main: Patch) -> str:
    """The backport for `line`, from its base release (downloaded once, like any release TARGET)."""
    from mtp_mask_fix.targets import release

    return derive(main, release(LINES[line]).fixed_file.read_text())


def write_all(main: Patch | None = None) -> str:
    """Rewrite every backport; one line per file saying whether it changed."""
    main = main or Patch.load()
    out = []
    for line in LINES:
        text, dest = derive_for(line, main), path(line, main)
        changed = not dest.is_file() or dest.read_text() != text
        if changed:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        out.append(f"{dest.relative_to(PATCHES.parent)}: {'rewritten' if changed else 'unchanged'}")
    return "\n".join(out)


if __name__ == "__main__":
    try:
        print(write_all())
    except ToolError as exc:
        print(f"mtp-mask-fix: error: {exc}", file=sys.stderr)
        sys.exit(int(exc.code))
