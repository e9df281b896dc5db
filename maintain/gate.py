"""`./run gate`: each target's state, then red/green on its base, patched and leave-one-source-hunk-out trees; a verdict
table, non-zero unless the patch holds. A release runs this repo's tests/unit_tests; an upstream checkout, SWE-bench style,
upstream's test files that the patch changes (its base tree gets the patch's test part, its patched tree all); so too
each Megatron-LM patch on its base-commit and each megatron-core release in lines.toml (--megatron-lm)."""

import ast
import copy
import dataclasses
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from maintain import printed
from maintain.envs.make import stage_core, uv
from maintain.redgreen.client import Job, run_many
from maintain.redgreen.contract import Outcome, Run, problems
from maintain.repo import LINES_TOML, REPO, WORK, checkout, megatron_lm_checkout, pins, release
from maintain.trees import materialise
from maintain.upstreams import (
    BRIDGE,
    MEGATRON_LM,
    MEGATRON_LM_PATCHES,
    Upstream,
    base_commit,
    load,
    patched_tests,
    upstream_of,
)
from mtp_mask_fix import cli
from mtp_mask_fix.check import State, candidates, check
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.git import git
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import SRC, is_source
from mtp_mask_fix.targets import Kind, Target


class Standing(Enum):
    """A target's line in the table, and the exit code it asks for."""

    PASS = ("PASS", Exit.OK)  # needed, applies, red on the base by assertion, green patched, every hunk needed
    OTHER_ENVIRONMENT = ("applies; its tests need another environment: nothing was tested", Exit.FAILED)
    RETIRE = ("upstream has the fix: retire the patch", Exit.ALREADY_APPLIED)
    DRIFTED = ("DRIFTED", Exit.DRIFTED)
    FAIL = ("FAIL", Exit.FAILED)


NOT_APPLYING = {Exit.ALREADY_APPLIED: Standing.RETIRE, Exit.DRIFTED: Standing.DRIFTED}  # by `check`'s exit; else FAIL


@dataclass
class Row:
    """One target, the patch that fits it, its sessions, what they showed, and the verdict."""

    target: Target
    patch: Patch
    base: Job | None = None  # None: the patch does not apply, nothing runs
    patched: Job | None = None
    without: list[Job] = field(default_factory=list)  # the patch with source hunk i + 1 left out
    touched: set[str] = field(default_factory=set)  # the upstream tests that the patch adds or changes
    verdict: Standing = Standing.PASS
    notes: list[str] = field(default_factory=list)
    red: str = "-"
    green: str = "-"
    unjudged: int = 0  # tests that do not pass on the base here either, where the upstream allows it
    every_test: bool = False  # each test it runs is judged, whatever its upstream allows


def _row(target: Target, patch: Patch, root: Path, work: Path, tests: tuple[str, ...]) -> Row:
    """Sessions of `tests` on base, patched, and each source hunk left out (a tree left with none is the base)."""
    checkout = target.kind == Kind.CHECKOUT
    src = None if checkout else True  # a checkout takes upstream's tests with the sources
    strip = target.strip
    trees = [materialise(root, work / "base", patch, src=False, strip=strip) if checkout else root]
    hunks = [(f.path, i) for f in patch.files if is_source(f.path) for i in range(len(f))]
    for name, kept in [("patched", patch)] + [(f"without-{i}", without(patch, h)) for i, h in enumerate(hunks, 1)]:
        left = kept.part(src=True)  # no source hunk left: the base tree
        trees.append(materialise(root, work / name, kept, src=src, strip=strip) if left else trees[0])
    up = upstream_of(patch)
    jobs = [
        Job((*tests, *up.options), tree / SRC, tree, up.module) if checkout else Job(tests, tree) for tree in trees
    ]
    return Row(target, patch, *jobs[:2], jobs[2:])


def without(patch: Patch, hunk: tuple[str, int]) -> Patch:
    """The patch less one hunk (its file's path and index there), a file left with none left out."""
    files = copy.deepcopy(patch.files)
    for changed in files:
        if changed.path == hunk[0]:
            del changed[hunk[1]]
    files[:] = [changed for changed in files if changed]
    return dataclasses.replace(patch, files=files)


def at(target: Target, rev: str = "HEAD", upstream: Upstream = BRIDGE, source: Path | None = None) -> Target:
    """A checkout at `rev` as a tree of its own (src, tests, their configs; the code of a release's sdist `source`)."""
    # Folder names may be shared; two patches on one commit may need different trees.
    key = hashlib.sha1(f"{target.root} {rev} {source} {upstream.sources}".encode()).hexdigest()[:8]
    work = WORK / "gate" / f"checkout-{target.root.name}-{key}"
    shutil.rmtree(work / "upstream", ignore_errors=True)
    (work / "upstream" / "src").mkdir(parents=True)
    listed = git("ls-tree", "-r", "--name-only", rev, *upstream.top, cwd=target.root).stdout.split()
    paths = [path for path in upstream.top if any(f"{name}/".startswith(f"{path}/") for name in listed)]
    git("archive", "-o", str(work / "upstream.tar"), rev, *paths, cwd=target.root)
    shutil.unpack_archive(work / "upstream.tar", work / "upstream")
    if source:  # an sdist: its one folder holds upstream.sources
        shutil.unpack_archive(source, work / "upstream" / "src")
        (sdist,) = (work / "upstream" / "src").iterdir()
        (sdist / upstream.sources).rename(sdist.parent / upstream.sources)
    elif upstream.sources:
        git("archive", "-o", str(work / "src.tar"), rev, *upstream.sources.split(), cwd=target.root)
        shutil.unpack_archive(work / "src.tar", work / "upstream" / "src")
    for name in upstream.linked:  # relative: a tree made from this one links to its own copy (trees.materialise)
        (work / "upstream" / name).symlink_to(Path("src") / name)
    return Target(target.label, work / "upstream", Kind.TREE)


def checkout_row(target: Target, patch: Patch, rev: str = "HEAD", upstream: Path | None = None) -> Row:
    """Upstream at `rev` (`at`'s tree, or `upstream`) with the patch's test part, all of it, each source hunk out."""
    upstream = upstream or at(target, rev, upstream_of(patch)).root
    row = _row(target, patch, upstream, upstream.parent, tuple(patched_tests(patch)))
    row.touched = touched_tests(patched_tests(patch), upstream, row.patched.cwd)
    row.notes = _lint(patch, row.patched.cwd)
    return row


def _lint(patch: Patch, tree: Path) -> list[str]:
    return (lint if upstream_of(patch) == BRIDGE else autoformat)(tree, patch.paths())


def megatron_lm_rows(checkout: Target) -> list[Row]:
    """Each Megatron-LM patch on its base-commit, and each megatron-core release in lines.toml: its sdist's source with
    the tests of its patch's base-commit, the patch's context read from there as `git apply -C1` does."""
    found = sorted([*MEGATRON_LM_PATCHES.glob("*.patch"), *MEGATRON_LM_PATCHES.glob("callers/*.patch")])
    patches = {str(path.relative_to(MEGATRON_LM_PATCHES).with_suffix("")): load(path) for path in found}
    releases = tomllib.loads(LINES_TOML.read_text())["megatron-core"]
    trees, rows = [(p, None) for p in patches] + [(r["patch"], v) for v, r in releases.items()], []
    for name, version in trees:
        patch = patches[name]
        sdist, base = version and stage_core(version), base_commit(patch)[:10]
        root = at(checkout, base_commit(patch), upstream_of(patch), sdist).root
        label = f"megatron-core {version} + tests {base}" if version else f"Megatron-LM {name} {base}"
        patch = _fitted(patch, root) if version else patch
        rows.append(checkout_row(Target(label, root, Kind.CHECKOUT), patch, upstream=root))
        rows += [nccl_row(rows[-1])] if upstream_of(patch) == MEGATRON_LM and not version else []  # core's own tests
    return rows


def nccl_row(row: Row) -> Row:
    """The tests `row`'s patch adds or changes, on its base and patched, on two ranks whose collectives refuse CPU tensors
    as NCCL does on upstream's CI (gloo takes them); tinymodel/site/core_unit_tests_cpu.py starts the second."""
    args = (*sorted(row.touched), *MEGATRON_LM.options, "--nccl-ranks=2")
    jobs = [Job(args, job.tree, job.cwd, job.module) for job in (row.base, row.patched)]
    target = Target(f"{row.target.label} on 2 ranks as NCCL", row.target.root, row.target.kind)
    return Row(target, row.patch, *jobs, touched=row.touched, every_test=True)


def _fitted(patch: Patch, tree: Path) -> Patch:
    """The patch with the context `tree` has (git apply -C1), less the hunks `tree` holds already; as is if that fails."""
    with tempfile.TemporaryDirectory() as repo:  # an index of the tree's files, in a repository of its own
        index, apply = ["--git-dir", repo, "--work-tree", str(tree)], ["apply", "--cached", "-C1"]
        git("init", "--quiet", "--bare", repo)
        git(*index, "add", *patch.paths())
        base = git(*index, "write-tree").stdout.strip()
        for hunk in [str(file).split("\n@@", 1)[0] + "\n" + str(hunk) for file in patch.files for hunk in file]:
            held = git(*index, *apply, "-R", "--check", "-", input=hunk, check=False).returncode == 0
            if not held and git(*index, *apply, "-", input=hunk, check=False).returncode:
                return patch
        fitted = git(*index, "diff-index", "--cached", "-p", base).stdout
    return Patch.load(patch.path, patch.text.split("\n---\n", 1)[0] + "\n---\n" + fitted)  # no diffstat to match


# tools/autoformat.sh's checks, CHECK_ONLY=true as Megatron-LM's CI runs them; each tool reads the tree's settings.
AUTOFORMAT = "black --check --quiet; isort --check; pylint --score=n; ruff check --no-fix"


def autoformat(tree: Path, files: list[str]) -> list[str]:
    """Megatron-LM's lint on the files the patch changes that autoformat.sh reads (megatron/core, tests), each tool at
    the version the tree's uv.lock pins."""
    files = [file for file in files if file.startswith(("src/megatron/core/", "tests/"))]
    lock = tomllib.loads((tree / "uv.lock").read_text())["package"]
    locked = {entry["name"]: entry.get("version") for entry in lock}
    # On the Python its CI lints with: black refuses to check on 3.11 code it reads as written for a later one.
    python = (tree / ".python-version").read_text().strip() if (tree / ".python-version").exists() else sys.executable
    found = []
    for tool, *args in map(str.split, AUTOFORMAT.split("; ")):
        uvx = [uv(), "tool", "run", "--python", python, "--from", f"{tool}=={locked[tool]}"]
        if (done := subprocess.run([*uvx, tool, *args, *files], cwd=tree, capture_output=True, text=True)).returncode:
            said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
            found.append(f"{tool} {locked[tool]}: {said[0] if said else f'exit {done.returncode}'}")
    return found


def lint(tree: Path, files: list[str]) -> list[str]:
    """upstream's pre-commit hooks on the files the patch changes, a note per finding: end-of-file-fixer and
    trailing-whitespace on Python files, ruff check and ruff format with the tree's own config (its ruff.toml, whose
    rules include the import order that the second ruff hook selects)."""
    config = ["--config", "ruff.toml"] if (tree / "ruff.toml").exists() else []
    found = []
    for file in (f for f in files if f.endswith(".py") and (tree / f).is_file()):
        text = (tree / file).read_text()
        if not text.endswith("\n") or text.endswith("\n\n"):
            found.append(f"end-of-file: {file} does not end in exactly one newline")
        spaced = [n for n, line in enumerate(text.splitlines(), 1) if line != line.rstrip()]
        found += [f"trailing-whitespace: {file}:{n}" for n in spaced]
    for command in (["check", "--output-format", "concise"], ["format", "--check"]):
        ruff = [sys.executable, "-m", "ruff", *command, *config, "--no-cache", *files]
        done = subprocess.run(ruff, cwd=tree, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.strip() and not line.startswith(("Found", "Would"))]
        found += [f"ruff {command[0]}: {line}" for line in lines] if done.returncode else []
    return found


def touched_tests(files: list[str], base: Path, patched: Path) -> set[str]:
    """Upstream tests (`file::Class::test`) that the patch adds or changes: their source differs between the trees."""
    return {name for file in files for name, _ in _tests(patched, file) - _tests(base, file)}


def _tests(root: Path, file: str) -> set[tuple[str, str]]:
    text = (root / file).read_text() if (root / file).exists() else ""
    try:
        classes = [node for node in ast.parse(text).body if isinstance(node, ast.ClassDef)]
    except SyntaxError:  # pytest reports it as a collection error
        return set()
    tests = [(c, f) for c in classes for f in c.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
    return {(f"{file}::{c.name}::{f.name}", ast.get_source_segment(text, f)) for c, f in tests}


def judge(row: Row, runs: dict[Job, Run]) -> None:
    """The row's verdict. FAIL_TO_PASS: the tests marked `fail_to_pass` (this repo's), or that the patch adds or
    changes and that fail by assertion on the base (upstream's); every other test is PASS_TO_PASS (where the upstream's
    tests need more than this machine, those that pass on the base here)."""
    base, patched = runs[row.base], runs[row.patched]
    if errors := base.collection_errors():
        row.verdict, row.notes = Standing.OTHER_ENVIRONMENT, errors[:1]
        return
    red = [n for n in patched.outcomes if base.of(n) == Outcome.ASSERTION]
    touched = [n for n in red if n.split("[")[0] in row.touched]
    fail_to_pass = [n for n in patched.outcomes if n in patched.marked or n in touched]
    every = upstream_of(row.patch).every_test or row.every_test
    others = [n for n in patched.outcomes if n not in fail_to_pass and (every or base.of(n) == Outcome.PASSED)]
    row.unjudged = len(patched.outcomes) - len(fail_to_pass) - len(others)
    row.notes += problems(base, patched, fail_to_pass, others)
    if not fail_to_pass:  # never a pass when nothing could go red
        row.notes.append(f"no FAIL_TO_PASS test of {', '.join(patched_tests(row.patch) or row.base.args)} ran")
    for hunk, job in enumerate(row.without, 1):  # needed: left out, a FAIL_TO_PASS test does not pass or lint finds
        lints = row.target.kind == Kind.CHECKOUT and _lint(row.patch, job.cwd)  # a release has no lint config
        if all(runs[job].of(n) == Outcome.PASSED for n in fail_to_pass) and not lints:
            row.notes.append(f"without source hunk {hunk} no FAIL_TO_PASS test goes red nor lint: it is not needed")
    row.red = f"{len(set(red) & set(fail_to_pass))}/{len(fail_to_pass)}"
    row.green = f"{sum(patched.of(n) == Outcome.PASSED for n in patched.outcomes)}/{len(patched.outcomes)}"
    row.verdict = Standing.FAIL if row.notes else Standing.PASS


def sessions(rows: list[Row]) -> list[Job]:
    """Every distinct session the rows need (a tree equal to its base shares the base's session)."""
    return list(dict.fromkeys(job for row in rows if row.base for job in [row.base, row.patched, *row.without]))


def evaluate(rows: list[Row], python: str) -> None:
    """Run every session once and judge each row."""
    runs = dict(zip(sessions(rows), run_many(sessions(rows), python)))
    for row in [row for row in rows if row.base]:
        judge(row, runs)


def checked(targets: list[Target], patches: list[Patch]) -> list[Row]:
    """A row per target, its state printed on stderr: its sessions where the patch applies, else its standing."""
    rows = []
    for target in targets:
        judged = at(target) if target.kind == Kind.CHECKOUT else target  # a checkout at HEAD, never its work tree
        verdict = check(judged, patches)
        print(f"[gate] {verdict}", file=sys.stderr)
        if verdict.state != State.APPLIES:
            standing = NOT_APPLYING.get(verdict.state.code, Standing.FAIL)
            rows.append(Row(target, verdict.patch, verdict=standing, notes=[str(verdict)]))
        elif judged is target:  # the release as shipped, with the patch's source hunks, and with each left out
            rows.append(
                _row(target, verdict.patch, target.root, WORK / "gate" / target.root.name, ("tests/unit_tests",))
            )
        else:
            rows.append(checkout_row(target, verdict.patch, upstream=judged.root))  # the tree just judged
    return rows


def table(rows: list[Row], *, seconds: float) -> str:
    """The verdict table: a line per target, its notes below it, then how many and how long."""
    width = max(len(row.target.label) for row in rows)
    lines = [f"\n{'target':<{width}}  base: F2P red  patched: green  verdict"]
    for row in rows:
        lines += [f"{row.target.label:<{width}}  {row.red:>13}  {row.green:>14}  {row.verdict.value[0]}"]
        lines += [f"    {note}" for note in row.notes]
        if row.unjudged:
            lines.append(f"    not judged: {row.unjudged} other tests, which do not pass here unpatched")
    return "\n".join([*lines, f"\ngate: {len(rows)} targets, {seconds:.1f} s"])


def gate(rows: list[Row], *, python: str, start: float) -> tuple[str, Exit]:
    """Run and judge the rows' sessions in `python`; the table (timed from `start`), the worst verdict's exit code."""
    if sessions(rows):
        print(f"[gate] running {len(sessions(rows))} pytest sessions, forked from one warm process", file=sys.stderr)
        evaluate(rows, python)
    return table(rows, seconds=time.monotonic() - start), max(row.verdict.value[1] for row in rows)


def environment(target: Target) -> str:
    """The interpreter of a release's own environment: the megatron-core and transformers it declares (`./run python
    VERSION`, which builds it on first use)."""
    done = subprocess.run([REPO / "run", "python", target.root.name], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        failed = f"`./run python {target.root.name}` failed above"
        raise ToolError(f"no environment for {target.label} ({failed})", done.returncode)
    return done.stdout.strip()


def run(args) -> tuple[str, Exit]:
    """What `./run gate ARGS` prints, and its exit code: each release in its own environment unless --python names
    one for all, upstream checkouts with --python (by default this interpreter)."""
    if args.checkouts_only and not (args.checkout or args.megatron_lm):
        raise ToolError("--checkouts-only needs at least one --checkout DIR or --megatron-lm DIR")
    python = cli.interpreter(args.python) if args.python else None
    checkouts = [checkout(path) for path in args.checkout]  # refuse a bad checkout before any download
    megatron_lm = args.megatron_lm and megatron_lm_checkout(args.megatron_lm)
    versions = [] if args.checkouts_only else args.release or [pins()["megatron-bridge"], "latest"]
    releases = {target.root: target for target in map(release, versions)}.values()  # `latest` may be the pin
    groups: dict[str, list[Target]] = {}
    for target in releases:
        groups.setdefault(python or environment(target), []).append(target)
    if checkouts:
        groups.setdefault(python or sys.executable, []).extend(checkouts)
    for where in dict.fromkeys([sys.executable, *groups]):  # this process imports it too
        if subprocess.run([where, "-c", "import pytest"], capture_output=True).returncode != 0:
            raise ToolError(f"gate runs pytest, which {where} cannot import: pip install pytest")
    done = []
    for where, targets in groups.items():
        start = time.monotonic()
        done.append(
            gate(checked(targets, [load(args.patch)] if args.patch else candidates()), python=where, start=start)
        )
    if megatron_lm:
        rows = megatron_lm_rows(megatron_lm)
        done.append(gate(rows, python=python or sys.executable, start=time.monotonic()))
    return "\n".join(text for text, _ in done), max(code for _, code in done)  # exit codes grow with severity


def parser() -> cli.Parser:
    """`./run gate`'s command line: its refusals are the tool's (one line, the same exit codes)."""
    said = "red/green of the patch on each release and upstream checkout; non-zero unless it holds"
    parser = cli.Parser(prog="./run gate", description=said)
    release_help = "a release version or `latest`; repeatable (default: the pin and `latest`)"
    parser.add_argument("--release", metavar="VERSION", action="append", help=release_help)
    checkout_help = "also gate an upstream checkout (HEAD)"
    parser.add_argument("--checkout", metavar="DIR", action="append", type=Path, default=[], help=checkout_help)
    parser.add_argument("--megatron-lm", metavar="DIR", help="also gate the Megatron-LM patches from this repository")
    parser.add_argument("--checkouts-only", action="store_true", help="gate only the --checkout trees, no release")
    python_help = "one interpreter for every target (default: each release's own environment; this one for checkouts)"
    parser.add_argument("--python", metavar="PY", help=python_help)
    parser.add_argument("--patch", type=Path, help="the patch to gate (default: the first in patches/series)")
    parser.set_defaults(func=printed(run))
    return parser


if __name__ == "__main__":
    cli.main(parser=parser())
