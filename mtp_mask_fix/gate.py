"""gate: on each target, materialise the base and patched trees, run FAIL_TO_PASS and PASS_TO_PASS on both,
show every source hunk is needed, and print a verdict table. Fails while the bug would go unfixed.

PyPI releases: this repo's unit tests run against the release's own files (PYTHONPATH = the tree).
Upstream checkouts (HEAD): upstream's tests/unit_tests/training tests run inside the trees, SWE-bench
style: the base tree gets the patch's test part only, the patched tree the whole patch.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtp_mask_fix.errors import FAILED, ToolError
from mtp_mask_fix.patch import REPO, WORK, Patch, apply_diff, first_error_line, git
from mtp_mask_fix.redgreen import Job, Manifest, Run, problems, run_many, still_red
from mtp_mask_fix.targets import SUPPORTED_RELEASES, Target, pypi_release, require_git_checkout


UPSTREAM_TEST_FILES = ("tests/unit_tests/training/test_gpt_step.py",)


@dataclass
class Trees:
    """One target's trees: 'base', 'patched', and one per source hunk left out (keyed 'without <hunk>')."""

    target: Target
    roots: dict[str, Path] = field(default_factory=dict)
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    pytest_args: list[str] = field(default_factory=list)
    run_inside_tree: bool = False  # upstream trees: run pytest from the tree, under upstream's own config


def log(message: str) -> None:
    """One progress line per step."""
    print(f"[gate] {message}", flush=True)


def _tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _materialise(source: Path, dest: Path, diff: str, strip: int) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    if diff:
        error = apply_diff(diff, dest, strip=strip)
        if error:
            raise ToolError(f"{dest}: {first_error_line(error)}", FAILED)


def release_trees(version: str, patch: Patch, manifest: Manifest) -> Trees:
    """The release as shipped (base), with the source hunks (patched), and with each hunk left out."""
    release = pypi_release(version)
    work = WORK / "gate" / version
    trees = Trees(release, fail_to_pass=manifest.fail_to_pass["unit"], pass_to_pass=manifest.pass_to_pass["unit"])
    trees.roots["base"] = release.root
    _materialise(release.root, work / "patched", patch.part(src=True), release.strip)
    trees.roots["patched"] = work / "patched"
    for index, hunk in enumerate(patch.source_hunks()):
        name = f"without hunk {index + 1}"
        _materialise(release.root, work / f"without-{index + 1}", patch.part(src=True, hunks_left_out=(hunk,)), 2)
        trees.roots[name] = work / f"without-{index + 1}"
    trees.pytest_args = trees.fail_to_pass + trees.pass_to_pass
    return trees


def checkout_trees(path: Path, patch: Patch, manifest: Manifest, python: str) -> Trees:
    """HEAD of the checkout plus the test part (base), plus the whole patch (patched), and leave-one-out."""
    checkout = Target(str(path), require_git_checkout(path).resolve(), "git")
    head = git("rev-parse", "--short", "HEAD", cwd=checkout.root).stdout.strip()
    work = WORK / "gate" / f"checkout-{checkout.root.name}-{head}"
    pristine = work / "upstream"
    if pristine.exists():
        shutil.rmtree(pristine)
    pristine.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(checkout.root), "archive", "HEAD", "src", "tests", "pyproject.toml"], capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(pristine)], input=archive.stdout, check=True)
    trees = Trees(Target(f"{path} @ {head}", pristine, "tree"), run_inside_tree=True)
    _materialise(pristine, work / "base", patch.part(src=False), 1)
    _materialise(pristine, work / "patched", patch.part(), 1)
    trees.roots = {"base": work / "base", "patched": work / "patched"}
    for index, hunk in enumerate(patch.source_hunks()):
        name = f"without hunk {index + 1}"
        _materialise(pristine, work / f"without-{index + 1}", patch.part(hunks_left_out=(hunk,)), 1)
        trees.roots[name] = work / f"without-{index + 1}"
    ours = [nodeid for nodeid in manifest.fail_to_pass["unit"] if nodeid.startswith("tests/unit_tests/")]
    present = set(_collect(trees.roots["patched"], list(UPSTREAM_TEST_FILES), python))
    trees.fail_to_pass = ours + [nodeid for nodeid in manifest.fail_to_pass["upstream"] if nodeid in present]
    trees.pass_to_pass = [n for n in manifest.pass_to_pass["unit"] if n.startswith("tests/unit_tests/")]
    trees.pass_to_pass += sorted(present - set(trees.fail_to_pass))
    test_files = sorted({nodeid.split("::")[0] for nodeid in trees.fail_to_pass + trees.pass_to_pass})
    trees.pytest_args = ["-o", "addopts=", "--strict-markers", *test_files]
    return trees


def _collect(root: Path, files: list[str], python: str) -> list[str]:
    result = subprocess.run(
        [python, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
        + ["-p", "mtp_mask_fix.harness.pytest_plugin", *files],
        cwd=root,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{REPO}", MTP_FIX_GPT_STEP="installed"),
    )
    return [line for line in result.stdout.splitlines() if "::" in line]


def _job(trees: Trees, name: str) -> Job:
    root = trees.roots[name]
    import_root = root / "src" if (root / "src").is_dir() else root
    env = {"PYTHONPATH": str(import_root), "MTP_FIX_GPT_STEP": "installed"}
    return Job(trees.pytest_args, cwd=root if trees.run_inside_tree else REPO, env=env)


def _check_imported(trees: Trees, name: str, run: Run) -> None:
    import_root = _job(trees, name).env["PYTHONPATH"]
    stray = {f for f in run.gpt_step_files if not Path(f).resolve().is_relative_to(Path(import_root).resolve())}
    if stray:
        raise ToolError(f"{trees.target.label} {name}: tests imported {sorted(stray)}, not the tree's gpt_step.py")


def gate(releases: list[str], checkouts: list[Path], patch: Patch, python: str = sys.executable) -> int:
    """Run every tree's tests (two pytest processes at a time), print the table; 0 only if all hold."""
    manifest = Manifest.load()
    unknown = [v for v in releases if v not in SUPPORTED_RELEASES]
    if unknown:
        raise ToolError(f"unsupported release {unknown[0]} (supported: {', '.join(SUPPORTED_RELEASES)})")
    for path in checkouts:
        require_git_checkout(path)
    start = time.monotonic()
    all_trees = []
    for version in releases:
        log(f"{version}: materialising base, patched and leave-one-hunk-out trees")
        all_trees.append(release_trees(version, patch, manifest))
    for path in checkouts:
        log(f"{path}: materialising base (tests only), patched and leave-one-hunk-out trees")
        all_trees.append(checkout_trees(path, patch, manifest, python))

    # A leave-one-out tree identical to base (a single-hunk patch) reuses base's run instead of repeating it.
    jobs, same_as = [], {}
    for trees in all_trees:
        base_digest = _tree_digest(trees.roots["base"])
        for name, root in trees.roots.items():
            if name.startswith("without") and _tree_digest(root) == base_digest:
                same_as[(id(trees), name)] = "base"
            else:
                jobs.append((trees, name))

    def done(index: int, run: Run) -> None:
        trees, name = jobs[index]
        log(f"{trees.target.label} {name}: {len(run.outcomes)} tests in {run.seconds:.1f} s")

    log(f"running {len(jobs)} pytest sessions, forked from one warm process")
    results = run_many([_job(trees, name) for trees, name in jobs], done, python)
    runs: dict[tuple[int, str], Run] = {}
    for (trees, name), run in zip(jobs, results):
        _check_imported(trees, name, run)
        runs[(id(trees), name)] = run
    rows, failed = [], False
    for trees in all_trees:
        base, patched = runs[(id(trees), "base")], runs[(id(trees), "patched")]
        found = problems(base, patched, trees.fail_to_pass, trees.pass_to_pass)
        for name in trees.roots:
            if name.startswith("without"):
                run = runs.get((id(trees), name)) or runs[(id(trees), same_as[(id(trees), name)])]
                if not still_red(run, trees.fail_to_pass):
                    found.append(f"{name}: no FAIL_TO_PASS test goes red, so that hunk is not needed")
        red = sum(base.outcomes.get(n) == "assertion" for n in trees.fail_to_pass)
        green = sum(patched.outcomes.get(n) == "passed" for n in trees.fail_to_pass + trees.pass_to_pass)
        total = len(trees.fail_to_pass) + len(trees.pass_to_pass)
        seconds = sum(run.seconds for (key, _), run in runs.items() if key == id(trees))
        rows.append((trees.target.label, f"{red}/{len(trees.fail_to_pass)}", f"{green}/{total}", found, seconds))
        failed |= bool(found)
    _print_table(rows, time.monotonic() - start)
    return FAILED if failed else 0


def _print_table(rows, total_seconds: float) -> None:
    width = max(len(row[0]) for row in rows)
    print(f"\n{'target':<{width}}  base: F2P red  patched: green  hunks needed  test time  verdict")
    for label, red, green, found, test_seconds in rows:
        hunks = "no" if any("not needed" in p for p in found) else "yes"
        verdict = "FAIL" if found else "PASS"
        print(f"{label:<{width}}  {red:>13}  {green:>14}  {hunks:>12}  {test_seconds:>7.1f} s  {verdict}")
        for problem in found:
            print(f"    {problem}")
    verdict = "FAIL" if any(row[3] for row in rows) else "PASS"
    print(f"\ngate: {verdict} ({len(rows)} targets, {total_seconds:.1f} s)")
