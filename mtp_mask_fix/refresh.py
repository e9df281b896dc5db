"""refresh: regenerate the patch from its commit in an upstream checkout.

The patch is edited as a commit (gbp-pq style): `apply CHECKOUT --branch wip` makes one, you amend it there (or
rebase it), and `refresh --upstream CHECKOUT` turns the commit at --from (default HEAD) back into the mailbox.
Byte-stable: author and date come from the current patch, the message from the commit (sign-offs dropped: the
submitter adds theirs), `--zero-commit --no-signature --base=<parent>`, and Last-Update moves only when the diff
changes. Before writing, the new patch must hold red/green on that checkout (see gate.checkout_row). The checkout
itself is never modified: the commit is rebuilt in a temporary `--shared` clone.
"""

import datetime
import sys
import tempfile
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.gate import Verdict, checkout_row, evaluate
from mtp_mask_fix.git import git
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.targets import Target


IDENTITY = (("NAME", "Author"), ("EMAIL", "Email"), ("DATE", "Date"))  # git's variables, git mailinfo's headers


def build(upstream: Target, rev: str, old: Patch) -> str:
    """The mailbox for the single commit `rev` on its parent, with the old patch's author, date and DEP-3 block."""
    verify = ["rev-parse", "--verify", "--quiet"]
    found = [git(*verify, f"{r}^{{commit}}", cwd=upstream.root, check=False) for r in (rev, f"{rev}^1")]
    if any(done.returncode for done in found):
        raise ToolError(f"{rev} is not a commit with a parent in {upstream.label}")
    commit, parent = (done.stdout.strip() for done in found)
    lines = git("log", "-1", "--format=%B", commit, cwd=upstream.root).stdout.strip().splitlines()
    message = "\n".join(line for line in lines if not line.startswith("Signed-off-by: ")).strip() + "\n"
    identity = {f"GIT_{who}_{what}": old.headers[key] for who in ("AUTHOR", "COMMITTER") for what, key in IDENTITY}
    stable = ["-1", "--stdout", "--zero-commit", "--no-signature", f"--base={parent}"]
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "upstream"
        git("clone", "--quiet", "--shared", "--no-checkout", str(upstream.root), str(clone))
        made = git(
            "commit-tree", f"{commit}^{{tree}}", "-p", parent, "-F", "-", cwd=clone, env=identity, input=message
        )
        text = git("format-patch", *stable, made.stdout.strip(), cwd=clone).stdout
    moved = Patch.parse(old.path, text).diff != old.diff
    metadata = old.metadata | ({"Last-Update": datetime.date.today().isoformat()} if moved else {})
    head, sep, rest = text.partition("\n---\n")
    return f"{head}{sep}" + "".join(f"{key}: {value}\n" for key, value in metadata.items()) + f"\n{rest}"


def refresh(upstream: Target, rev: str, *, python: str | None = sys.executable) -> str:
    """Rewrite the first patch in the series from `rev`; with `python`, only once its tests hold red/green there."""
    old = Patch.load()
    text = build(upstream, rev, old)
    held = "red/green not run (--no-verify)"
    if python:
        row = checkout_row(upstream, Patch.parse(old.path, text), rev=f"{rev}^1")
        evaluate([row], python)
        if row.verdict != Verdict.PASS:
            notes = row.notes[:3] + [f"{len(row.notes) - 3} more"] * (len(row.notes) > 3)
            raise ToolError(f"not written: the patch from {rev} does not hold: {'; '.join(notes)}", Exit.FAILED)
        held = f"red/green held on {upstream.label} ({row.red} red on the base, {row.green} green patched)"
    if text != old.text:
        old.path.write_text(text)
    return f"{old.path.name}: {'rewritten' if text != old.text else 'unchanged (byte-identical)'}; {held}"
