"""`./run refresh`: rewrite the patches/ files, byte-stable, from the patch's commit in an upstream checkout.

As gbp-pq does: `./run branch CHECKOUT wip` makes the patch a commit; amend it there, and `--upstream CHECKOUT` writes it
back once it holds red/green there (`--patch patches/megatron-lm/BRANCH.patch`: from a Megatron-LM clone). `--backports`
derives each older line's patch: before 0.6 the `forward_args` literal is followed by `if cu_seqlens is not None:`, so
the source hunks apply with two lines of trailing context.
"""

import datetime
import re
import sys
import tempfile
from pathlib import Path

from maintain import printed
from maintain.repo import FIXED_FILE, checkout, megatron_lm_checkout, release, release_lines
from maintain.upstreams import BRIDGE, MEGATRON_LM_PATCHES, load, upstream_of
from mtp_mask_fix import cli
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import apply_diff, first_error_line, git
from mtp_mask_fix.journal import write_atomic
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import PATCHES
from mtp_mask_fix.targets import Target


IDENTITY = (("NAME", "Author"), ("EMAIL", "Email"), ("DATE", "Date"))  # git's variables, git mailinfo's headers


def backport_lines() -> dict[str, str]:
    """Each backport's folder under patches/ and the newest release it fixes, which it is derived on."""
    newest = {}
    for version, row in release_lines().items():  # oldest first
        if "backport" in row:
            newest[row["backport"]] = version
    return newest


def _author(patch: Patch) -> dict[str, str]:
    return {f"GIT_{who}_{what}": patch.headers[key] for who in ("AUTHOR", "COMMITTER") for what, key in IDENTITY}


def _mailbox(repo: Path, parent: str, tree: str, message: str, old: Patch, *, upstream: bool) -> str:
    """The mailbox of `tree` committed on `parent` with `old`'s author, date and DEP-3 block."""
    # An upstream commit's mailbox names its base, and moves Last-Update only when the diff does.
    made = git("commit-tree", tree, "-p", parent, "-F", "-", cwd=repo, env=_author(old), input=message).stdout.strip()
    stable = ["--zero-commit", "--no-signature", *[f"--base={parent}"] * upstream]
    text = git("format-patch", "-1", "--stdout", *stable, made, cwd=repo).stdout
    moved = upstream and str(load(old.path, text).files) != str(old.files)
    metadata = old.metadata | ({"Last-Update": datetime.date.today().isoformat()} if moved else {})
    head, sep, rest = text.partition("\n---\n")
    return f"{head}{sep}" + "".join(f"{key}: {value}\n" for key, value in metadata.items()) + f"\n{rest}"


def build(upstream: Target, rev: str, old: Patch) -> str:
    """The mailbox of the single commit `rev` on its parent, without sign-offs (the submitter adds theirs)."""
    verify = ["rev-parse", "--verify", "--quiet"]
    found = [git(*verify, f"{r}^{{commit}}", cwd=upstream.root, check=False).stdout.strip() for r in (rev, f"{rev}^")]
    if not all(found):
        raise ToolError(f"{rev} is not a commit with a parent in {upstream.label}")
    lines = git("log", "-1", "--format=%B", found[0], cwd=upstream.root).stdout.strip().splitlines()
    message = "\n".join(line for line in lines if not line.startswith("Signed-off-by: ")).strip() + "\n"
    with tempfile.TemporaryDirectory() as clone:
        git("clone", "--quiet", "--shared", "--no-checkout", str(upstream.root), clone)
        return _mailbox(Path(clone), found[1], f"{found[0]}^{{tree}}", message, old, upstream=True)


def refresh(upstream: Target, rev: str, *, python: str | None = sys.executable, patch: Path | None = None) -> str:
    """Rewrite `patch` (the carried one) from `rev`; with `python`, only once its tests hold red/green there."""
    old = load(patch)
    text = build(upstream, rev, old)
    held = "red/green not run (--no-verify)"
    if python:
        # Imported here, as cli imports gate: at module level its pytest import would widen the start-up window in
        # which a Ctrl-C, arriving before cli.main's signal handlers, prints a traceback.
        from maintain.gate import Standing, checkout_row, evaluate

        row = checkout_row(upstream, load(old.path, text), rev=f"{rev}^1")
        evaluate([row], python)
        if row.verdict != Standing.PASS:
            notes = row.notes[:3] + [f"{len(row.notes) - 3} more"] * (len(row.notes) > 3)
            raise ToolError(f"not written: the patch from {rev} does not hold: {'; '.join(notes)}", Exit.FAILED)
        held = f"red/green held on {upstream.label} ({row.red} red on the base, {row.green} green patched)"
    if text != old.text:
        write_atomic(old.path, text.encode())  # a signal cannot leave it half-written
    return f"{old.path.name}: {'rewritten' if text != old.text else 'unchanged (byte-identical)'}; {held}"


def path(line: str, main: Patch) -> Path:
    """Where the backport of `main` for `line` lives (check.candidates finds it there)."""
    return PATCHES / line / main.path.name


def derive_for(line: str, main: Patch) -> str:
    """The backport of `main`'s source hunks to `line`'s newest release (downloaded once, like any release TARGET)."""
    diff = main.part(src=True)
    with tempfile.TemporaryDirectory() as repo:
        (Path(repo) / FIXED_FILE).parent.mkdir(parents=True)
        (Path(repo) / FIXED_FILE).write_text(release(backport_lines()[line]).fixed_file.read_text())
        if not apply_diff(diff, Path(repo), check=True):
            raise ToolError("the carried patch applies to this base as it is: no backport needed", Exit.FAILED)
        git("init", "--quiet", cwd=repo)
        git("add", "-A", cwd=repo)
        git("commit", "--quiet", "--no-verify", "-m", "base", cwd=repo, env=_author(main))
        done = git("apply", "-C2", "--cached", "--whitespace=nowarn", "-", cwd=repo, input=diff, check=False)
        if done.returncode != 0:
            raise ToolError(f"the carried patch does not fit this base: {first_error_line(done.stderr)}", Exit.DRIFTED)
        tree = git("write-tree", cwd=repo).stdout.strip()
        return _mailbox(Path(repo), "HEAD", tree, f"{main.headers['Subject']}\n\n{main.body}\n", main, upstream=False)


def backports() -> str:
    """Rewrite every backport, saying which changed."""
    main, said = load(), []
    for line in backport_lines():
        text, dest = derive_for(line, main), path(line, main)
        same = dest.is_file() and dest.read_text() == text
        said.append(f"{dest.relative_to(PATCHES.parent)}: {'unchanged' if same else 'rewritten'}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(dest, text.encode())
    return "\n".join(said)


def applies(root: Path) -> tuple[str, Exit]:
    """A line per Megatron-LM mailbox: whether it applies to its branch's tip in `root` (origin/BRANCH, else BRANCH),
    and if not, each hunk that does not; DRIFTED if any does not."""
    said = []
    for path in sorted(MEGATRON_LM_PATCHES.rglob("*.patch")):  # callers/ holds the callers' change
        name = path.relative_to(MEGATRON_LM_PATCHES)
        ref = next((ref for ref in (f"origin/{path.stem}", path.stem) if _tip(root, ref)), None)
        if not ref:
            said.append(f"{name}: no origin/{path.stem} nor {path.stem} in {root}")
            continue
        failed = _hunks_refused(root, _tip(root, ref), load(path))
        verdict = f"does not apply: {'; '.join(failed)}" if failed else "applies"
        said.append(f"{name} on {ref} {_tip(root, ref)[:10]}: {verdict}")
    return "\n".join(said), Exit.OK if all(line.endswith(": applies") for line in said) else Exit.DRIFTED


def _tip(root: Path, ref: str) -> str:
    return git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", cwd=root, check=False).stdout.strip()


def _hunks_refused(root: Path, tip: str, patch: Patch) -> list[str]:
    """Each hunk of a Megatron-LM mailbox (read with its sources under src/) that `git apply` refuses on `tip`."""
    refused = []
    with tempfile.TemporaryDirectory() as index:  # the tip's tree in an index of its own: no work tree touched
        env = {"GIT_INDEX_FILE": f"{index}/index"}
        git("read-tree", tip, cwd=root, env=env)
        for file in patch.files:
            head = re.sub(r" ([ab])/src/(megatron|examples)/", r" \1/\2/", str(file).split("\n@@", 1)[0])
            for i, hunk in enumerate(file, 1):
                done = git(
                    "apply", "--cached", "--check", "-", cwd=root, env=env, input=f"{head}\n{hunk}", check=False
                )
                name = file.path.removeprefix("src/")
                refused += [f"hunk {i}/{len(file)} of {name} ({str(hunk).splitlines()[0]})"] * bool(done.returncode)
    return refused


def run(args) -> tuple[str, Exit]:
    """What `./run refresh ARGS` prints, and its exit code."""
    if args.backports:
        return backports(), Exit.OK
    if args.applies:
        return applies(megatron_lm_checkout(args.upstream).root)
    python = None if args.no_verify else cli.interpreter(args.python)
    where = (checkout if upstream_of(load(args.patch)) == BRIDGE else megatron_lm_checkout)(args.upstream)
    return refresh(where, args.rev, python=python, patch=args.patch), Exit.OK


def parser() -> cli.Parser:
    """`./run refresh`'s options; its refusals are the tool's (one line, the same exit codes)."""
    parser = cli.Parser(
        prog="./run refresh", description="rewrite patches/ from the patch's commit in an upstream checkout"
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--upstream", metavar="DIR", type=Path, help="the upstream git checkout holding the commit")
    which.add_argument("--backports", action="store_true", help="derive each older line's patch from the first")
    parser.add_argument("--from", dest="rev", default="HEAD", help="the commit, on top of its parent (default: HEAD)")
    parser.add_argument("--patch", type=Path, help="the mailbox to rewrite (default: the first in patches/series)")
    parser.add_argument("--no-verify", action="store_true", help="skip the red/green run and the lint on the checkout")
    parser.add_argument(
        "--applies", action="store_true", help="with --upstream (Megatron-LM): say whether each patch applies there"
    )
    parser.add_argument(
        "--python", metavar="PY", default=sys.executable, help="an interpreter with the checkout's megatron-core"
    )
    parser.set_defaults(func=printed(run))
    return parser


if __name__ == "__main__":
    cli.main(parser=parser())
