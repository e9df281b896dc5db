"""verify judges by behaviour: the probe runs each release line's own forward_step in that line's environment, as a
training job imports it; apply verifies the same way, and revert gives the release's bytes back."""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from maintain.repo import REPO, WORK, patch_file, release_lines
from maintain.repo import release as release_target
from maintain.trees import materialise
from mtp_mask_fix.paths import GPT_STEP
from tests.support.targets import (
    EQUIVALENT_FIX,
    LABELS,
    PINNED,
    digests,
    fake_python,
    verdict,
)


# Every line in --all (a probe imports the line's Megatron-Bridge, about 20 CPU-s), and upstream main with
# --upstream-checkout.
ROUTES = [*release_lines(), "main"]
DELIVERED = "the model receives the batch's loss_mask with MTP on"


def interpreter(version: str) -> str:
    """The interpreter of the line's own environment (`./run python VERSION`, built on first use; main's is given)."""
    if version == "main":
        return UPSTREAM["python"]
    if version == PINNED:
        return sys.executable
    done = subprocess.run([REPO / "run", "python", version], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def as_shipped(version: str) -> Path:
    """A copy of the line's Megatron-Bridge whose only file of its own is gpt_step.py: the release's site-packages
    (the rest links to it), or main's src/ at HEAD."""
    if version == "main":
        root = WORK / "verify-lines" / "main"
        root.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", UPSTREAM["checkout"], "archive", "HEAD", "src"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", root], input=archive.stdout, check=True)
        return root
    release = release_target(version).root
    return materialise(release, WORK / "verify-lines" / version, rewrite={GPT_STEP: (release / GPT_STEP).read_text()})


def _route(version: str) -> tuple:
    """verify, apply (which verifies the same way) and revert, as a training job runs them, on a copy of the line as
    shipped. Returns the interpreter, the copy, the three results, and its digests before and after."""
    python, root = interpreter(version), as_shipped(version)
    before = digests(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    steps = [["verify", "--python", python], ["apply", "--python", python], ["revert"]]
    tool = [sys.executable, "-m", "mtp_mask_fix"]
    runs = [subprocess.run([*tool, *step, str(root)], env=env, capture_output=True, text=True) for step in steps]
    return python, root, runs, before, digests(root)


EARLY = {}
UPSTREAM = {}  # --upstream-checkout and --upstream-python, for "main"


def start_early(session) -> None:
    """Start the routes of the lines this session runs: they need nothing else of it."""
    shutil.rmtree(WORK / "verify-lines", ignore_errors=True)
    UPSTREAM.update(checkout=session.config.getoption("upstream_checkout"))
    versions = {item.callspec.params["version"] for item in session.items if item.cls is TestReleaseLineRoute}
    versions -= set() if UPSTREAM["checkout"] else {"main"}
    UPSTREAM.update(python=session.config.getoption("upstream_python") or sys.executable)
    EARLY["routes"] = ThreadPoolExecutor(1).submit(lambda: {version: _route(version) for version in versions})


DONE = {}


@pytest.fixture
def routes(version):
    """Every line's route run so far, this one's included."""
    if version == "main" and not UPSTREAM.get("checkout"):
        pytest.skip("needs --upstream-checkout DIR: a Megatron-Bridge clone (and --upstream-python its interpreter)")
    if "routes" in EARLY:
        DONE.update(EARLY.pop("routes").result())
    if version not in DONE:
        DONE[version] = _route(version)
    return DONE


@pytest.mark.slow
@pytest.mark.parametrize("version", ROUTES)
class TestReleaseLineRoute:
    """Red on the release as shipped, by what the probe found; green once applied; the release's bytes again."""

    def test_the_release_as_shipped_is_not_verified(self, routes, refused, version):
        python, _, (verified, *_), _, _ = routes[version]
        refused(verified, 5, f"not verified with {python}", "received no loss_mask with MTP on")

    def test_apply_writes_the_lines_patch_and_verifies_it(self, routes, version):
        python, root, (_, applied, _), _, _ = routes[version]
        patch = patch_file(version)
        assert (applied.returncode, applied.stderr) == (0, "")
        assert applied.stdout == f"{root}: applied (source hunks only, {patch}); verified with {python}: {DELIVERED}\n"

    def test_revert_gives_the_release_its_bytes_back(self, routes, version):
        _, root, (*_, reverted), before, after = routes[version]
        assert (reverted.returncode, reverted.stderr) == (0, "")
        assert after == before  # gpt_step.py, and nothing left beside it (no journal, no temporary file)
        if version != "main":
            assert (root / GPT_STEP).read_bytes() == release_target(version).fixed_file.read_bytes()


class TestVerdicts:
    def test_an_equivalent_fix_that_is_not_this_patch_is_already_fixed(self, cli, tmp_path):
        """#6105's unconditional entry on the release: `check` (no probe) says already fixed; that `verify` passes
        it, and fails labels as the mask, is pinned in tests/test_wrong_fixes.py (TestVerifyProbeVerdict)."""
        release = release_target(PINNED)
        text = (release.root / GPT_STEP).read_text()
        assert LABELS in text
        root = materialise(
            release.root, tmp_path / "site-packages", rewrite={GPT_STEP: text.replace(LABELS, EQUIVALENT_FIX)}
        )
        assert verdict(cli("check", root), 3).endswith(
            "fixed another way: gpt_step passes loss_mask to the model; nothing to apply"
        )

    @pytest.mark.parametrize(
        ("stderr", "said"),
        [
            ("ModuleNotFoundError: No module named 'torch'", "give --python the interpreter that trains"),
            ("ValueError: not enough values to unpack (expected 10, got 6)", "forward_step failed"),
        ],
        ids=["no-torch", "a-forward-step-it-cannot-drive"],
    )
    def test_a_probe_that_cannot_run_says_why(self, cli, refused, tmp_path, site_packages, stderr, said):
        """As Python says it: a traceback, its last line the error."""
        trace = "Traceback (most recent call last):"
        python = fake_python(tmp_path, "python", f'echo "{trace}" >&2; echo "{stderr}" >&2; exit 1')
        line = refused(cli("verify", "--python", python, site_packages.root), 5, stderr, said)
        assert f"not verified with {python}: " in line


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["v0.2.0", "v0.2.2"])
def test_a_v0_2_checkout_is_applied_verified_and_reverted(cli, git, tmp_path, tag, upstream_checkout):
    """The oldest lines' get_batch asks megatron-core's parallel_state which pipeline stage it runs: the probe sets
    that state up, so apply (verified), verify and revert all exit 0 with 0.3.1's interpreter (megatron-core 0.16),
    and revert gives the commit's bytes back."""
    archive = subprocess.run(["git", "-C", upstream_checkout, "archive", tag, "src", "tests"], capture_output=True)
    assert archive.returncode == 0, f"{upstream_checkout} has no tag {tag} (git fetch --tags): {archive.stderr}"
    root = tmp_path / tag
    root.mkdir()
    subprocess.run(["tar", "-x", "-C", root], input=archive.stdout, check=True)
    git(root, "init", "--quiet")
    git(root, "add", "-A")
    git(root, "commit", "--quiet", "-m", tag)
    python, before = interpreter("0.3.1"), digests(root / "src")
    runs = [cli(*step, "--python", python, root, cwd="/") for step in (["apply"], ["verify"], ["revert"])]
    assert [(run.returncode, run.stderr) for run in runs] == [(0, "")] * 3
    assert (
        runs[0].stdout
        == f"{root}: applied (source hunks only, {patch_file('0.3.1')}); verified with {python}: {DELIVERED}\n"
    )
    assert runs[1].stdout == f"{root}: verified with {python}: {DELIVERED}\n"
    assert digests(root / "src") == before
