"""gate: each target's state, then FAIL_TO_PASS / PASS_TO_PASS on its base and patched trees, and every source hunk
needed; a verdict table. Non-zero while the patch drifts, is no longer needed, or does not hold.

Releases run this repo's tests/unit_tests (FAIL_TO_PASS: the tests marked `fail_to_pass`) against the release's own
files. Upstream checkouts run upstream's own test files that the patch changes, inside the trees
(SWE-bench style: the base tree gets the patch's test part, the patched tree the whole patch): the tests the
patch adds or changes must pass patched and, on the base, pass or fail by assertion (at least one must), and every
other test must pass on both.
"""

import ast
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from mtp_mask_fix import pr
from mtp_mask_fix.check import State, check
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.git import git
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import WORK
from mtp_mask_fix.redgreen import Job, Outcome, Run, problems, run_many
from mtp_mask_fix.targets import Kind, Target
from mtp_mask_fix.trees import materialise


class Verdict(Enum):
    """A target's line in the table, and the exit code it asks for."""

    PASS = ("PASS", Exit.OK)  # needed, applies, red on the base by assertion, green patched, every hunk needed
    OTHER_ENVIRONMENT = ("applies; its tests need another environment: nothing was tested", Exit.FAILED)
    RETIRE = ("upstream has the fix: retire the patch", Exit.ALREADY_APPLIED)
    DRIFTED = ("DRIFTED", Exit.DRIFTED)
    FAIL = ("FAIL", Exit.FAILED)


@dataclass
class Row:
    """One target: its trees (name -> jobs), what they showed, and the verdict."""

    target: Target
    base: Job | None = None
    patched: Job | None = None
    without: list[Job] = field(default_factory=list)  # the patch with source hunk i + 1 left out
    upstream_files: list[str] = field(default_factory=list)  # upstream's test files the patch changes (checkouts)
    touched: set[str] = field(default_factory=set)  # their tests that the patch adds or changes
    verdict: Verdict = Verdict.PASS
    notes: list[str] = field(default_factory=list)
    red: str = "-"
    green: str = "-"
    name: str = ""  # a checkout's tag or branch and commit, as upstream knows it
    commit: str = ""  # a checkout's gated commit (40 hex)
    falcon_h1_forward: list[int] | None = None  # pr's permalink: FalconH1Model.forward's lines at that commit


def release_row(target: Target, patch: Patch) -> Row:
    """The release as shipped (base), with the source hunks (patched), and with each source hunk left out."""
    row = Row(target)
    work = WORK / "gate" / target.root.name
    patched = [materialise(target.root, work / "patched", patch, src=True)]
    without = [  # a patch with one source hunk left out is the release itself when it had only that one
        materialise(target.root, work / f"without-{i}", patch, src=True, leave_out=hunk)
        if patch.part(src=True, leave_out=hunk)
        else target.root
        for i, hunk in enumerate(patch.source_hunks(), 1)
    ]
    row.base, row.patched, *row.without = [Job(("tests/unit_tests",), t) for t in [target.root, *patched, *without]]
    return row


def checkout_row(target: Target, patch: Patch, rev: str = "HEAD") -> Row:
    """Upstream at `rev` plus the patch's test part (base), plus the whole patch (patched), and leave-one-out."""
    row = Row(target, upstream_files=patch.test_files())
    row.name = git("describe", "--all", "--long", "--always", rev, cwd=target.root).stdout.strip()
    row.commit = git("rev-parse", "--verify", f"{rev}^{{commit}}", cwd=target.root).stdout.strip()
    work = WORK / "gate" / f"checkout-{target.root.name}"
    upstream = work / "upstream"
    shutil.rmtree(upstream, ignore_errors=True)
    upstream.mkdir(parents=True)
    present = set(git("ls-tree", "--name-only", rev, cwd=target.root).stdout.split())
    paths = [path for path in ("src", "tests", "pyproject.toml", "ruff.toml") if path in present]
    git("archive", "-o", str(work / "upstream.tar"), rev, *paths, cwd=target.root)
    shutil.unpack_archive(work / "upstream.tar", upstream)
    args = ("-o", "addopts=", "--strict-markers", *row.upstream_files)
    trees = [
        materialise(upstream, work / "base", patch, src=False, strip=1),  # upstream's test part only
        materialise(upstream, work / "patched", patch, strip=1),
    ]
    trees += [  # a leave-one-out tree equal to the base (the only source hunk left out) is the base tree
        materialise(upstream, work / f"without-{i}", patch, leave_out=hunk, strip=1)
        if patch.part(leave_out=hunk) != patch.part(src=False)
        else trees[0]
        for i, hunk in enumerate(patch.source_hunks(), 1)
    ]
    row.base, row.patched, *row.without = [Job(args, tree / "src", cwd=tree) for tree in trees]
    row.touched = touched_tests(row.upstream_files, upstream, work / "patched")
    if (upstream / pr.FALCON_H1).exists():
        row.falcon_h1_forward = pr.falcon_h1_forward_lines((upstream / pr.FALCON_H1).read_text())
    row.notes = lint(work / "patched", patch.paths())
    return row


def lint(tree: Path, files: list[str]) -> list[str]:
    """ruff with the tree's own config (upstream's ruff.toml) on the files the patch changes: a note per finding."""
    config = ["--config", "ruff.toml"] if (tree / "ruff.toml").exists() else []
    found = []
    for command in (["check", "--output-format", "concise"], ["format", "--check"]):
        ruff = [sys.executable, "-m", "ruff", *command, *config, "--no-cache", *files]
        done = subprocess.run(ruff, cwd=tree, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.strip() and not line.startswith(("Found", "Would"))]
        found += [f"ruff {command[0]}: {line}" for line in lines] if done.returncode else []
    return found


def touched_tests(files: list[str], base_root: Path, patched_root: Path) -> set[str]:
    """Upstream tests (`file::Class::test`) that the patch adds or changes: their source differs between the trees."""

    def tests(path: Path) -> dict[str, str]:
        text = path.read_text() if path.exists() else ""
        try:
            module = ast.parse(text)
        except SyntaxError:  # pytest reports it as a collection error
            return {}
        classes = [node for node in module.body if isinstance(node, ast.ClassDef)]
        functions = [(c, f) for c in classes for f in c.body if isinstance(f, ast.FunctionDef)]
        return {
            f"{c.name}::{f.name}": ast.get_source_segment(text, f) for c, f in functions if f.name.startswith("test")
        }

    found = set()
    for path in files:
        before = tests(base_root / path)
        found |= {f"{path}::{name}" for name, code in tests(patched_root / path).items() if before.get(name) != code}
    return found


def judge(row: Row, runs: dict[Job, Run]) -> None:
    """Fill the row's verdict from the runs of its sessions."""
    base, patched = runs[row.base], runs[row.patched]
    if base.collection_errors():
        row.verdict, row.notes = Verdict.OTHER_ENVIRONMENT, base.collection_errors()[:1]
        return
    if (
        row.upstream_files
    ):  # upstream's own tests: those the patch adds or changes and that fail on the base by assertion
        upstream = [n for n in patched.outcomes if n.split("::")[0] in row.upstream_files]
        fail_to_pass = [n for n in upstream if n.split("[")[0] in row.touched and base.of(n) == Outcome.ASSERTION]
        pass_to_pass = [n for n in upstream if n not in fail_to_pass]
    else:
        fail_to_pass, pass_to_pass = patched.split()
    row.notes += problems(base, patched, fail_to_pass, pass_to_pass)
    if not fail_to_pass:  # never a pass when nothing could go red
        where = ", ".join(row.upstream_files) or "tests/unit_tests"
        row.notes.append(f"no FAIL_TO_PASS test of {where} ran: nothing was tested")
    for hunk, job in enumerate(row.without, 1):
        if not any(runs[job].of(n) == Outcome.ASSERTION for n in fail_to_pass):
            row.notes.append(f"without source hunk {hunk} no FAIL_TO_PASS test goes red: that hunk is not needed")
    row.red = f"{sum(base.of(n) == Outcome.ASSERTION for n in fail_to_pass)}/{len(fail_to_pass)}"
    row.green = f"{sum(patched.of(n) == Outcome.PASSED for n in patched.outcomes)}/{len(patched.outcomes)}"
    row.verdict = Verdict.FAIL if row.notes else Verdict.PASS


def sessions(rows: list[Row]) -> list[Job]:
    """Every distinct pytest session the rows need (a tree equal to its base shares the base's session)."""
    return list(dict.fromkeys(job for row in rows if row.base for job in [row.base, row.patched, *row.without]))


def evaluate(rows: list[Row], python: str, patch: Patch) -> None:
    """Run every session once and judge each row; record the checkouts that hold for `pr`, keyed by the patch."""
    runs = dict(zip(sessions(rows), run_many(sessions(rows), python)))
    for row in [row for row in rows if row.base]:
        judge(row, runs)
    version = "import importlib.metadata as m; print(m.version('megatron-core'))"
    core = subprocess.run([python, "-c", version], capture_output=True, text=True).stdout.strip()
    held = [
        {"commit": r.commit, "megatron_core": core, "red": r.red, "green": r.green}
        | {"falcon_h1_forward": r.falcon_h1_forward}
        for r in rows
        if r.commit and r.verdict == Verdict.PASS
    ]
    if held:  # this patch's file only: another patch's or an older diff's results never reach `pr`
        path = pr.results_file(patch)
        old = json.loads(path.read_text())["checkouts"] if path.exists() else []
        kept = [c for c in old if (c["commit"], c["megatron_core"]) not in {(h["commit"], core) for h in held}]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"patch": pr.patch_key(patch), "checkouts": kept + held}, indent=1) + "\n")


def gate(targets: list[Target], patches: list[Patch], python: str = sys.executable) -> tuple[str, Exit]:
    """Each target's state (on stderr), every tree's tests, then the table and the worst verdict's exit code. Each
    target is gated with the patch that fits it (the carried one, or its backport for an older line)."""
    start, rows = time.monotonic(), []
    for target in targets:
        verdict = check(target, patches)
        patch = verdict.patch
        print(f"[gate] {verdict}", file=sys.stderr)
        if verdict.state != State.APPLIES:
            standing = Verdict.RETIRE if verdict.state.code == Exit.ALREADY_APPLIED else Verdict.DRIFTED
            rows.append(Row(target, verdict=standing, notes=[str(verdict)]))
        else:
            rows.append(checkout_row(target, patch) if target.kind == Kind.CHECKOUT else release_row(target, patch))
    if sessions(rows):
        print(f"[gate] running {len(sessions(rows))} pytest sessions, forked from one warm process", file=sys.stderr)
        evaluate(rows, python, patch)
    width = max(len(row.target.label) for row in rows)
    lines = [f"\n{'target':<{width}}  base: F2P red  patched: green  verdict"]
    for row in rows:
        lines += [f"{row.target.label:<{width}}  {row.red:>13}  {row.green:>14}  {row.verdict.value[0]}"]
        lines += [f"    {note}" for note in row.notes]
    lines += [f"\ngate: {len(rows)} targets, {time.monotonic() - start:.1f} s"]
    return "\n".join(lines), max(row.verdict.value[1] for row in rows)  # exit codes grow with severity
