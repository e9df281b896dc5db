"""Writing a target: `apply` and `revert` on each kind, all or nothing, one writer at a time, under signals and kill -9,
and a journal that never writes into a tree that changed since.

The tests that signal or kill the tool as a process of its own are marked slow (`./run test --all`); the push tier keeps
the tool run in-process and the ranks that start at once."""

import errno
import fcntl
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from unidiff import PatchSet

from maintain.repo import release as release_target
from mtp_mask_fix.cli import main as tool_main
from mtp_mask_fix.journal import JOURNAL
from tests.support.targets import (
    BACKPORT_FILE,
    CONTEXT,
    EQUIVALENT_FIX,
    FAR_FROM_HUNK,
    FIXED,
    LABELS,
    PATCH_FILE,
    REGION_EDIT,
    UPSTREAM_TEST,
    changed_lines,
    fake_python,
    hunk_parts,
    probe_says,
    start_paused,
    verdict,
    wait_until,
)


class TestApplyGitCheckout:
    """apply on a git checkout changes the working tree only, by exactly the patch."""

    def test_working_tree_gets_exactly_the_patch(self, cli, git, checkout, patch):
        head = git(checkout.root, "rev-parse", "HEAD")
        result = cli("apply", "--no-verify", checkout.root)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"{checkout.root}: applied (source and tests, {PATCH_FILE})"
        assert git(checkout.root, "rev-parse", "HEAD") == head  # nothing committed
        assert git(checkout.root, "status", "--porcelain") == f" M {FIXED}\n M {UPSTREAM_TEST}\n"
        assert changed_lines(PatchSet(git(checkout.root, "diff"))) == hunk_parts(patch, src_only=False)

    def test_local_change_elsewhere_in_the_file_does_not_block(self, cli, edit, checkout, patched_gpt_step):
        edit(checkout, checkout.gpt_step, FAR_FROM_HUNK, "import logging  # local note\n", commit=False)
        result = cli("apply", "--no-verify", checkout.root)
        assert result.returncode == 0, result.stderr
        expected = patched_gpt_step.replace(FAR_FROM_HUNK, "import logging  # local note\n", 1)
        assert checkout.gpt_step.read_text() == expected

    def test_local_change_in_the_region_blocks(self, cli, edit, refused, snapshot, checkout):
        edit(checkout, checkout.gpt_step, CONTEXT, REGION_EDIT, commit=False)
        before = snapshot(checkout.root)
        line = refused(cli("apply", "--no-verify", checkout.root), 2, "local changes")
        assert "commit or stash" in line
        assert snapshot(checkout.root) == before
        # check says the same, as a verdict
        assert "local changes in the patch's region" in verdict(cli("check", checkout.root), 2)

    def test_again_when_already_fixed_changes_nothing_and_exits_0(self, cli, snapshot, checkout):
        assert cli("apply", "--no-verify", checkout.root).returncode == 0
        before = snapshot(checkout.root)
        result = cli("apply", "--no-verify", checkout.root)
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout == f"{checkout.root}: already fixed (source and tests, {PATCH_FILE}); nothing changed\n"
        assert snapshot(checkout.root) == before

    def test_again_when_already_fixed_still_verifies(self, cli, refused, snapshot, tmp_path, probe_ok, checkout):
        """`apply || exit 1` at start-up: exit 0 means verified, also when there was nothing to write."""
        assert cli("apply", "--no-verify", checkout.root).returncode == 0
        before = snapshot(checkout.root)
        python = fake_python(tmp_path, "python-without-torch", "echo 'No module named torch' >&2; exit 1")
        line = refused(
            cli("apply", "--python", python, checkout.root), 5, "nothing changed", f"not verified with {python}"
        )
        assert "already fixed" not in line  # a line that says fixed and not verified contradicts itself
        result = cli("apply", "--python", probe_ok(), checkout.root)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(
            f"{checkout.root}: already fixed (source and tests, {PATCH_FILE}); nothing changed; verified"
        )
        assert snapshot(checkout.root) == before

    def test_refuses_when_drifted(self, cli, edit, refused, snapshot, checkout):
        edit(checkout, checkout.gpt_step, CONTEXT, REGION_EDIT)  # committed: upstream moved on
        before = snapshot(checkout.root)
        line = refused(cli("apply", "--no-verify", checkout.root), 4, "drifted")
        assert "gpt_step.py" in line
        assert snapshot(checkout.root) == before


class TestApplySitePackages:
    """apply on an installed package: the source hunk only, verified by behaviour (the probe imports the tree)."""

    def test_failed_verification_writes_nothing(self, cli, tmp_path, refused, snapshot, site_packages):
        """An interpreter whose probe finds no loss_mask in the new bytes (verified aside): exit 5, nothing written."""
        fake_python = tmp_path / "fake-python"
        fake_python.write_text(
            '#!/bin/sh\necho \'{"file": "x", "delivered": false, "reason": "no loss_mask reached the model"}\'\n'
        )
        fake_python.chmod(0o755)
        before = snapshot(site_packages.root)
        refused(cli("apply", "--python", fake_python, site_packages.root), 5, "nothing changed; not verified with")
        assert snapshot(site_packages.root) == before

    def test_a_tree_that_changes_while_its_patch_is_verified(self, cli, tmp_path, refused, site_packages):
        """Another process edits gpt_step.py while the new bytes are verified aside: they are not written (exit 5)."""
        edits = f"echo '# edited meanwhile' >>{site_packages.gpt_step}; {probe_says()}"
        python = fake_python(tmp_path, "python-while-edited", edits)
        refused(cli("apply", "--python", python, site_packages.root), 5, "changed while the patch was verified")
        text = site_packages.gpt_step.read_text()
        assert text.endswith("# edited meanwhile\n") and 'forward_args["loss_mask"]' not in text

    def test_source_hunk_only(self, cli, site_packages, patched_gpt_step):
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        assert site_packages.gpt_step.read_text() == patched_gpt_step
        assert not (site_packages.root / "tests").exists()


ROLLED_BACK = {"checked": "nothing changed", "journaled": "rolled back", "replaced": "rolled back"}
ROLLED_BACK |= {"verifying": "nothing changed", "verified": "nothing changed"}  # the new bytes are verified aside
INT, TERM, HUP = signal.SIGINT, signal.SIGTERM, signal.SIGHUP
# Each phase once, each signal at several phases, all three where the files are patched but not yet verified.
SIGNAL_CASES = [("checked", INT), ("journaled", TERM), ("replaced", INT), ("replaced", TERM), ("replaced", HUP)]
SIGNAL_CASES += [("verifying", TERM), ("verified", HUP), ("done", INT), ("done", TERM)]


@pytest.mark.slow
class TestSignals:
    """SIGINT, SIGTERM, SIGHUP at each phase of apply (and of revert): bytes as before (or as the command left them
    once it had finished), one line saying which, exit 128+n, no journal left."""

    @pytest.mark.parametrize(("phase", "signum"), SIGNAL_CASES, ids=[f"{p}-{s.name}" for p, s in SIGNAL_CASES])
    def test_signal_at_each_phase(self, tool_env, tmp_path, snapshot, probe_ok, site_packages, phase, signum):
        before = snapshot(site_packages.root)
        if phase == "verifying":  # the probe is running: an interpreter that says so, then takes its time
            python = fake_python(tmp_path, "python-slow", f"touch {tmp_path}/paused-verifying; exec sleep 3600")
        else:
            python = probe_ok()
        proc = start_paused(tool_env, tmp_path, phase, "apply", "--python", python, site_packages.root)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 128 + signum, (out, err)
        assert out == "" and len(err.splitlines()) == 1 and f"interrupted by {signum.name}" in err
        after = snapshot(site_packages.root)
        if phase == "done":
            assert "it had finished: applied (source hunks only" in err and err.endswith(" and verified\n")
            assert {p for p in after if before.get(p) != after[p]} == {str(site_packages.gpt_step)}
        else:
            assert ROLLED_BACK[phase] in err
            assert after == before

    @pytest.mark.parametrize("phase", ["replaced", "done"])
    def test_signal_during_revert(self, cli, tool_env, tmp_path, snapshot, site_packages, phase):
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        patched = snapshot(site_packages.root)
        proc = start_paused(tool_env, tmp_path, phase, "revert", site_packages.root)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=600)
        assert (proc.returncode, out, err.count("\n")) == (128 + signal.SIGTERM, "", 1), err
        if phase == "done":
            assert "it had finished: reverted" in err and snapshot(site_packages.root) != patched
        else:
            assert "rolled back: the files are as before" in err and snapshot(site_packages.root) == patched


@pytest.mark.slow
class TestKilled:
    """kill -9 mid-apply: the journal makes the next check and verify tell the truth, and the next apply recovers."""

    @pytest.mark.parametrize(("phase", "state"), [("journaled", "as before"), ("replaced", "patched, not verified")])
    def test_check_verify_then_apply(self, cli, tool_env, tmp_path, refused, snapshot, site_packages, phase, state):
        """What was undone is said as it was: "put back" only where the bytes were not as before."""
        before = snapshot(site_packages.root)
        proc = start_paused(tool_env, tmp_path, phase, "apply", "--no-verify", site_packages.root)
        proc.kill()
        proc.communicate()
        line = verdict(cli("check", site_packages.root), 5)
        assert "an interrupted run left .mtp-mask-fix-journal.json" in line
        assert f"megatron/bridge/training/gpt_step.py {state}" in line
        refused(cli("verify", site_packages.root), 5, "an interrupted run left")
        result = cli("apply", "--no-verify", site_packages.root)
        assert result.returncode == 0, result.stderr
        put_back = "put back megatron/bridge/training/gpt_step.py, " if state != "as before" else ""
        undone = f"undid what an interrupted run left: {put_back}removed {JOURNAL}\n"
        assert result.stdout.startswith(f"{site_packages.root}: {undone}{site_packages.root}: applied (")
        assert "already applied" in verdict(cli("check", site_packages.root), 3)
        assert {p for p in snapshot(site_packages.root) if before.get(p) != snapshot(site_packages.root)[p]} == {
            str(site_packages.gpt_step)
        }


def failing(call: int, errno_: int):
    """A stand-in for a file system call that fails (OSError `errno_`) the `call`-th time, and works otherwise."""

    def fail(real):
        calls = []

        def call_it(*args, **kwargs):
            calls.append(args)
            if len(calls) == call:
                raise OSError(errno_, os.strerror(errno_))
            return real(*args, **kwargs)

        return call_it

    return fail


class TestFileSystemErrors:
    """An OS error names what the tool was doing and where, and what it left: nothing changed, or rolled back."""

    @pytest.mark.parametrize(
        ("call", "errno_", "path", "left"),
        [
            (1, errno.ENOSPC, JOURNAL, "nothing changed"),
            (2, errno.EIO, "megatron/bridge/training/gpt_step.py", "rolled back: the files are as before"),
        ],
        ids=["the journal: ENOSPC", "the file: EIO"],
    )
    def test_a_failed_write(self, cli, monkeypatch, snapshot, site_packages, call, errno_, path, left):
        before = snapshot(site_packages.root)
        monkeypatch.setattr(os, "fsync", failing(call, errno_)(os.fsync))
        done = cli("apply", "--no-verify", site_packages.root)
        said = f"writing {site_packages.root / path}: {os.strerror(errno_)}; {left}"
        assert (done.returncode, done.stdout, done.stderr) == (
            5,
            "",
            f"mtp-mask-fix: error: {site_packages.root}: {said}\n",
        )
        assert snapshot(site_packages.root) == before

    def test_a_full_temporary_folder(self, cli, monkeypatch, tmp_path, snapshot, site_packages):
        """check writes nothing of the target's, but copies its files aside to try the patch there."""
        before = snapshot(site_packages.root)
        monkeypatch.setattr(tempfile, "mkdtemp", failing(1, errno.ENOSPC)(tempfile.mkdtemp))
        done = cli("check", site_packages.root)
        said = f"making a temporary folder in {tempfile.gettempdir()}: No space left on device; nothing changed"
        assert (done.returncode, done.stdout, done.stderr) == (5, "", f"mtp-mask-fix: error: {said}\n")
        assert snapshot(site_packages.root) == before


class TestTemporaryFolders:
    """A run removes the temporary folders it makes in $TMPDIR as it ends; a killed run's stay, harmless."""

    @pytest.mark.slow
    def test_kill_9_at_random_moments(self, cli, tool_env, tmp_path, snapshot, probe_ok, site_packages):
        """12 kills anywhere in an apply that verifies (a probe of 0.2 s), each followed by apply and revert."""
        env, before = dict(tool_env, TMPDIR=str(tmp_path / "tmpdir")), snapshot(site_packages.root)
        (tmp_path / "tmpdir").mkdir()
        python, moments = probe_ok(seconds=0.2), random.Random(6103)
        apply = [sys.executable, "-m", "mtp_mask_fix", "apply", "--python", python, site_packages.root]
        for _ in range(12):
            proc = subprocess.Popen(apply, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            time.sleep(moments.uniform(0, 1.0))
            proc.kill()
            proc.communicate()
            left = set((tmp_path / "tmpdir").iterdir())  # the killed run's, if it had made one
            assert cli("apply", "--python", python, site_packages.root, env=env).returncode == 0
            assert cli("revert", site_packages.root, env=env).returncode == 0
            assert set((tmp_path / "tmpdir").iterdir()) == left
            assert snapshot(site_packages.root) == before


class TestRevert:
    """revert: the files as they were before the patch, all or nothing; refused where the patch is not what holds."""

    def test_apply_then_revert_gives_the_bytes_back(self, cli, snapshot, target):
        before = snapshot(target.root)
        assert cli("apply", "--no-verify", target.root).returncode == 0
        result = cli("revert", target.root)
        assert (result.returncode, result.stderr) == (0, ""), result.stdout
        assert result.stdout.startswith(f"{target.root}: reverted (")
        assert snapshot(target.root) == before
        assert "the patch applies" in verdict(cli("check", target.root), 0)

    def test_nothing_to_revert(self, cli, refused, snapshot, target):
        before = snapshot(target.root)
        refused(cli("revert", target.root), 2, "the patch is not applied here: nothing to revert")
        assert snapshot(target.root) == before

    def test_a_fix_made_another_way_is_not_the_tools_to_revert(self, cli, edit, refused, snapshot, target):
        edit(target, target.gpt_step, LABELS, EQUIVALENT_FIX)
        before = snapshot(target.root)
        refused(cli("revert", target.root), 2, "fixed another way, not by this patch")
        assert snapshot(target.root) == before


class TestJournal:
    """The journal names the release and each file's digests before and after: a killed run is put back only into
    the tree it left."""

    @pytest.fixture
    def killed(self, tool_env, tmp_path, release_root):
        """A site-packages holding `version`'s gpt_step.py and package_info.py, and an apply killed once it had
        replaced the file (the journal left); returns the root."""

        def make(version: str) -> Path:
            root = tmp_path / "site-packages"
            install(release_root(version), root)
            proc = start_paused(tool_env, tmp_path, "replaced", "apply", "--no-verify", root)
            proc.kill()
            proc.communicate()
            assert (root / JOURNAL).is_file()
            return root

        return make

    @pytest.mark.slow
    def test_a_tree_replaced_by_another_release_is_left_as_it_is(self, cli, refused, snapshot, killed, release_root):
        """pip installed another release over the killed run's tree: its files stay, and the step the refusal names
        works."""
        root = killed(PINNED_RELEASE)
        install(release_root("0.5.1"), root)
        before = snapshot(root)
        line = refused(cli("apply", "--no-verify", root), 2, f"changed since an interrupted run left {JOURNAL}")
        assert "is neither as it left it nor as it was" in line
        assert "changed since" in cli("check", root).stdout
        assert snapshot(root) == before
        (root / JOURNAL).unlink()  # the step it names
        result = cli("apply", "--no-verify", root)
        assert result.stdout == f"{root}: applied (source hunks only, {BACKPORT_FILE})\n", result.stderr

    @pytest.mark.slow
    def test_another_release_whose_file_the_run_had_patched(self, cli, refused, snapshot, killed):
        root = killed(PINNED_RELEASE)
        info = root / "megatron/bridge/package_info.py"
        info.write_text(info.read_text().replace("PATCH = ", "PATCH = 9  # was ", 1))
        before = snapshot(root)
        refused(cli("apply", "--no-verify", root), 2, f"it was made for megatron-bridge {PINNED_RELEASE}")
        assert snapshot(root) == before

    @pytest.mark.slow
    def test_check_names_the_step_that_works(self, cli, killed, release_root):
        root = killed(PINNED_RELEASE)
        assert "the next `apply` or `revert` puts it back first" in verdict(cli("check", root), 5)
        install(release_root("0.5.1"), root)
        assert f"if the files are as you want them, remove {root / JOURNAL}" in verdict(cli("check", root), 5)

    @pytest.mark.slow
    def test_revert_after_a_killed_apply_puts_the_release_back(self, cli, killed, release_root):
        root = killed(PINNED_RELEASE)
        result = cli("revert", root)
        assert (result.returncode, result.stderr) == (0, "")
        undone = (
            f"undid what an interrupted run left: put back megatron/bridge/training/gpt_step.py, removed {JOURNAL}"
        )
        assert result.stdout.startswith(f"{root}: {undone}\n")
        assert "the next `apply` or `revert`" not in result.stdout  # done already, not a step still to take
        assert result.stdout.endswith("the patch is not applied: the files are as before it\n")
        assert (root / "megatron/bridge/training/gpt_step.py").read_bytes() == (
            release_root(PINNED_RELEASE) / "megatron/bridge/training/gpt_step.py"
        ).read_bytes()

    @pytest.mark.slow
    def test_the_same_release_put_back_by_a_reinstall(self, cli, killed, release_root, patched_gpt_step):
        root = killed(PINNED_RELEASE)
        install(release_root(PINNED_RELEASE), root)
        result = cli("apply", "--no-verify", root)
        assert result.returncode == 0, result.stderr
        assert (root / FIXED.removeprefix("src/")).read_text() == patched_gpt_step
        assert not (root / JOURNAL).exists()

    def test_a_leftover_temporary_file_is_said_and_removed(self, cli, site_packages, patched_gpt_step):
        """kill -9 while a file's new bytes were written leaves `.NAME.mtp-mask-fix.tmp` beside it."""
        stray = site_packages.gpt_step.with_name(".gpt_step.py.mtp-mask-fix.tmp")
        stray.write_text("half")
        line = verdict(cli("check", site_packages.root), 5)
        assert (
            "an interrupted run left the temporary file megatron/bridge/training/.gpt_step.py.mtp-mask-fix.tmp" in line
        )
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        assert not stray.exists() and site_packages.gpt_step.read_text() == patched_gpt_step


class TestOneWriterAtATime:
    """Every rank of a job runs `apply || exit 1` at start-up, on one target."""

    def test_ranks_that_start_at_once(self, tool_env, tmp_path, site_packages, patched_gpt_step):
        """16 ranks `apply --no-verify` at once: every rank exits 0, one writes, the others find the fix."""
        apply = [sys.executable, "-m", "mtp_mask_fix", "apply", "--no-verify", site_packages.root]
        procs = [
            subprocess.Popen(
                apply, env=tool_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for _ in range(16)
        ]
        runs = [(proc.communicate(timeout=600), proc.returncode) for proc in procs]
        assert [code for _, code in runs] == [0] * 16, [err for (_, err), _ in runs]
        said = sorted(out.split(": ", 1)[1].split(" (")[0] for (out, _), _ in runs)
        assert said == ["already fixed"] * 15 + ["applied"]
        waiting = f"mtp-mask-fix: waiting for the lock on {site_packages.root}, which another process holds\n"
        assert all(err in ("", waiting) for (_, err), _ in runs), [err for (_, err), _ in runs]
        assert site_packages.gpt_step.read_text() == patched_gpt_step
        assert not list(site_packages.root.rglob(f"*{JOURNAL}*")) and not list(site_packages.root.rglob("*.tmp"))

    def test_a_slow_interpreter_keeps_no_rank_waiting(self, tool_env, tmp_path, site_packages, patched_gpt_step):
        """8 ranks, each probe as slow as the others': no lock is held for one, so each starts while the others run
        (none answers before all 8 have started), and no rank waits for another's probe; each rank that waited for
        the start's lock (held by the test until every rank has said it waits) says so once."""
        ranks, log, held = 8, tmp_path / "probes.log", os.open(site_packages.root, os.O_RDONLY)
        all_started = f"until [ $(grep -c . {log}) -ge {ranks} ]; do sleep 0.01; done"
        python = fake_python(tmp_path, "python", f"echo $$ >>{log}; timeout 600 sh -c '{all_started}'; {probe_says()}")
        apply = [
            sys.executable,
            "-m",
            "mtp_mask_fix",
            "apply",
            "--wait",
            "120",
            "--python",
            python,
            site_packages.root,
        ]
        errs = [tmp_path / f"rank-{rank}.err" for rank in range(ranks)]
        waiting = f"mtp-mask-fix: waiting for the lock on {site_packages.root}, which another process holds\n"
        fcntl.flock(held, fcntl.LOCK_EX)  # another process writes: every rank waits, then all go at once
        procs = [
            subprocess.Popen(
                apply, env=tool_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err.open("w"), text=True
            )
            for err in errs
        ]
        try:
            assert wait_until(lambda: all(err.read_text() == waiting for err in errs)), [e.read_text() for e in errs]
        finally:
            os.close(held)
        runs = [(proc.communicate(timeout=600)[0], proc.returncode) for proc in procs]
        assert [code for _, code in runs] == [0] * ranks, [err.read_text() for err in errs]
        said = sorted(out.split(": ", 1)[1].split(" (")[0] for out, _ in runs)
        assert said == ["already fixed"] * (ranks - 1) + ["applied"]
        assert [err.read_text() for err in errs] == [waiting] * ranks  # once, though it took the lock more than once
        assert len(log.read_text().split()) == ranks and site_packages.gpt_step.read_text() == patched_gpt_step
        assert not list(site_packages.root.rglob(f"*{JOURNAL}*"))

    def test_a_reader_does_not_keep_apply_from_finding_the_fix(self, cli, probe_ok, site_packages):
        """A verify (or check) holding the reader's lock: an apply that finds the fix verifies beside it."""
        assert cli("apply", "--no-verify", site_packages.root).returncode == 0
        held = os.open(site_packages.root, os.O_RDONLY)
        try:
            fcntl.flock(held, fcntl.LOCK_SH)
            result = cli("apply", "--wait", "0.5", "--python", probe_ok(), site_packages.root)
        finally:
            os.close(held)
        assert (result.returncode, result.stderr) == (0, "") and "already fixed" in result.stdout

    def test_a_lock_held_past_the_wait(self, cli, refused, snapshot, site_packages):
        """The refusal says another process held the lock, never that a writer of the tool did."""
        before = snapshot(site_packages.root)
        held = os.open(site_packages.root, os.O_RDONLY)
        try:
            fcntl.flock(held, fcntl.LOCK_EX)  # what another apply holds while it runs
            for command in ("apply", "revert"):
                line = refused(cli(command, "--wait", "0.2", site_packages.root), 6, "nothing changed")
                assert "another process held it" in line and "mtp-mask-fix process" not in line
        finally:
            os.close(held)
        assert snapshot(site_packages.root) == before

    @pytest.mark.parametrize("wait", ["-1", "soon", "nan"])
    def test_a_wait_that_is_no_number_of_seconds(self, cli, refused, site_packages, wait):
        refused(cli("apply", "--no-verify", "--wait", wait, site_packages.root), 2, "not a number of seconds")


class TestOutput:
    """What the tool prints: only what it did."""

    def test_an_unreadable_journal_is_removed_not_put_back(self, cli, site_packages, patched_gpt_step):
        (site_packages.root / JOURNAL).write_text("{not json")
        result = cli("apply", "--no-verify", site_packages.root)
        assert (result.returncode, result.stderr) == (0, "")
        assert result.stdout.splitlines() == [
            f"{site_packages.root}: undid what an interrupted run left: removed {JOURNAL}",
            f"{site_packages.root}: applied (source hunks only, {PATCH_FILE})",
        ]
        assert site_packages.gpt_step.read_text() == patched_gpt_step

    def test_a_closed_stdout_is_no_traceback(self, tool_env, monkeypatch, capsys, site_packages, patched_gpt_step):
        """`mtp-mask-fix apply | head` where head has gone: the work is done, and its exit code is the command's."""
        read, write = os.pipe()
        os.close(read)
        monkeypatch.setattr(sys, "stdout", os.fdopen(write, "w"))
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        with pytest.raises(SystemExit) as done:
            tool_main(["apply", "--no-verify", str(site_packages.root)])
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the tool blocks signals once its outcome stands
        assert done.value.code == 0 and capsys.readouterr().err == ""
        assert site_packages.gpt_step.read_text() == patched_gpt_step
        sys.stdout.close()


class TestStartUp:
    """A signal before the tool has read anything, and a probe whose tool is signalled."""

    def test_the_handlers_come_before_the_rest_of_the_tool(self, tool_env):
        """The console script's module sets its handlers as it is imported, with nothing of the tool but the signal
        set: the rest (argparse, subprocess, unidiff, git) loads under them."""
        code = "import signal, sys, mtp_mask_fix.__main__ as m; "
        code += "print(sorted(n for n in sys.modules if n.startswith('mtp_mask_fix')), "
        code += "{signal.getsignal(s) is m._before_anything for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)})"
        done = subprocess.run([sys.executable, "-c", code], env=tool_env, capture_output=True, text=True)
        loaded = "['mtp_mask_fix', 'mtp_mask_fix.__main__', 'mtp_mask_fix.errors', 'mtp_mask_fix.signals']"
        assert done.stdout == f"{loaded} {{True}}\n", done.stderr
        script = (Path(sys.executable).parent / "mtp-mask-fix").read_text()
        assert "from mtp_mask_fix.__main__ import main" in script

    @pytest.mark.slow
    @pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2])
    def test_ctrl_c_at_start_up_is_one_line(self, tool_env, tmp_path, site_packages, delay):
        """From the tool's first line on (its handlers are up: the interpreter's own start-up is Python's), while
        the rest of it is still being imported and once it runs."""
        script = Path(sys.executable).parent / "mtp-mask-fix"
        proc = subprocess.Popen(
            [script, "check", site_packages.root],
            env=tool_env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while not handles(proc.pid, signal.SIGTERM) and proc.poll() is None:
            time.sleep(0.001)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=600)
        assert "Traceback" not in err, err
        assert proc.returncode in (128 + signal.SIGINT, 0), (proc.returncode, err)  # interrupted, or done before
        if proc.returncode:
            assert err.count("\n") == 1 and err.startswith("mtp-mask-fix: error: interrupted by SIGINT"), err

    @pytest.mark.slow  # a probe that imports torch: `./run test --all`
    def test_the_probe_ends_with_a_signalled_apply(self, cli, tool_env, tmp_path, site_packages):
        """SIGTERM to apply while its probe imports Megatron-Bridge: the probe goes too; the new bytes were verified
        aside, so nothing was written, and the next apply applies."""
        pid_file = tmp_path / "probe.pid"
        (site_packages.root / "megatron/bridge/__init__.py").write_text(
            f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(3600)\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "mtp_mask_fix", "apply", site_packages.root],
            env=tool_env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), proc), proc.communicate()
        probe = int(pid_file.read_text())
        proc.terminate()
        said = proc.communicate()[1].decode()
        assert (proc.returncode, said) == (143, "mtp-mask-fix: error: interrupted by SIGTERM: nothing changed\n")
        if not wait_until(lambda: gone(probe)):
            os.kill(probe, signal.SIGKILL)
            pytest.fail("the probe outlived its apply")
        result = cli("apply", "--no-verify", site_packages.root)
        assert result.stdout == f"{site_packages.root}: applied (source hunks only, {PATCH_FILE})\n", result.stderr


PINNED_RELEASE = "0.6.2"  # a release whose files the journal tests install, and 0.5.1 as the other one


def install(release: Path, root: Path) -> None:
    """What a pip install of `release` writes into `root`, as far as the tool reads it: gpt_step.py and
    package_info.py (the version a journal names)."""
    for rel in ("megatron/bridge/training/gpt_step.py", "megatron/bridge/package_info.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes((release / rel).read_bytes())


def gone(pid: int) -> bool:
    """Whether a process has ended (no entry in /proc, or a zombie's)."""
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def handles(pid: int, signum: int) -> bool:
    """Whether the process has its own handler for `signum` (SigCgt in /proc), which Python sets for SIGTERM only
    when asked to."""
    status = Path(f"/proc/{pid}/status")
    try:
        caught = next(line for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


@pytest.fixture
def release_root():
    return lambda version: release_target(version).root
