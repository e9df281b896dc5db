"""`mtp-mask-fix watch` without the tiny model: its bad input, a command that dies or is interrupted (once, or twice
for a job that ignores the first), a sitecustomize of the user's that keeps working, the one wrapper it puts on each
function of the installed megatron-core, the one line it says of a megatron-core it cannot watch (a stand-in package
first on the import path), and which ranks get a line of their own. tests/watch runs it on the real tiny model. Its
jobs run as processes of their own; the push tier keeps its bad input and the verdicts judged in-process, the rest is
marked slow (`./run test --all`)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mtp_mask_fix.errors import Exit
from mtp_mask_fix.signals import Interrupted, guard
from mtp_mask_fix.watch import verdict, watch
from mtp_mask_fix.watched import COUNTS, LOOKED_FOR


PY = sys.executable
GPT_MODEL = "megatron/core/models/gpt/gpt_model.py"
IMPORT_GPT = "import megatron.core.models.gpt.gpt_model"


def core(root: Path, files: dict[str, str]) -> dict:
    """A stand-in megatron-core of `files` (path: text) under root; the environment that puts it first."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in ("megatron/core", "megatron/core/models", "megatron/core/models/gpt", "megatron/core/transformer"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").touch()
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


MOVED = {  # a GPTModel whose MTP loss is neither where 0.17 on has it nor inline as in 0.16
    GPT_MODEL: "class GPTModel:\n    def _postprocess(self, hidden_states, labels, loss_mask=None):\n        pass\n",
    "megatron/core/transformer/multi_token_prediction.py": "def mtp_loss(hidden_states, labels, loss_mask):\n    pass\n",
}
WITHOUT_MTP = {GPT_MODEL: "class GPTModel:\n    pass\n"}  # no multi_token_prediction module at all
NEVER_RAN = {
    GPT_MODEL: "from megatron.core.transformer.multi_token_prediction import process_mtp_loss\n",
    "megatron/core/transformer/multi_token_prediction.py": "def process_mtp_loss(hidden_states, labels, loss_mask):\n"
    "    pass\n",
}


NOT_FOUND = (
    f"no MTP loss call: megatron-core's MTP loss not seen imported (looked for {LOOKED_FOR}); "
    "a process watch cannot see (python -I or -E, a cleaned environment, a Ray worker) may have run it"
)
NEVER_CALLED = "no MTP loss call: megatron-core's MTP loss imported in 1 process(es), never called with MTP on"


@pytest.fixture
def env(tool_env, tmp_path):
    """The tool's environment with TMPDIR of its own: watch must leave nothing there."""
    (tmp_path / "tmp").mkdir()
    return dict(tool_env, TMPDIR=str(tmp_path / "tmp"))


REFUSED = {  # argv after `watch`, exit code, what the one `error:` line says
    "no command": ((), 2, "no command after --"),
    "only --": (("--",), 2, "no command after --"),
    "a command not found": (("--", "no-such-command-here"), 2, "no-such-command-here: command not found"),
    "--steps 0": (("--steps", "0", "--", PY, "-c", "pass"), 2, "--steps 0: not a number of calls (1 or more)"),
    "--steps x": (("--steps", "x", "--", PY, "-c", "pass"), 2, "argument --steps: invalid int value: 'x'"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_bad_input_is_one_error_line_and_exit_2(cli, refused, env, tmp_path, name):
    argv, code, words = REFUSED[name]
    refused(cli("watch", *argv, env=env), code, words)
    assert list((tmp_path / "tmp").iterdir()) == []


NO_CALL = {  # the job, the stand-in core (or none), exit code, how the one line ends
    "a command that fails": ("raise SystemExit(3)", None, Exit.JOB_FAILED, f"before {PY} ended with exit code 3\n"),
    "a command that exits 7": ("raise SystemExit(7)", None, Exit.JOB_FAILED, f"before {PY} ended with exit code 7\n"),
    "a command killed": ("import os; os.kill(os.getpid(), 9)", None, 128 + 9, f"before {PY} was killed by SIGKILL\n"),
    "no megatron-core": ("pass", None, Exit.FAILED, NOT_FOUND),
    "a core whose MTP loss moved": (IMPORT_GPT, MOVED, Exit.FAILED, NOT_FOUND),
    "a core without MTP": (IMPORT_GPT, WITHOUT_MTP, Exit.FAILED, NOT_FOUND),
    "an MTP loss that never ran": (IMPORT_GPT, NEVER_RAN, Exit.FAILED, f"{NEVER_CALLED} (looked for {LOOKED_FOR})"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", NO_CALL)
def test_a_job_without_an_mtp_loss_call_is_one_line_never_exit_0(cli, env, tmp_path, name):
    """No code of the table but its own: a command's 3 or 7 is not `check`'s 3 nor a finding's 7; a command that
    ended before any MTP loss call gets only that said."""
    job, files, code, words = NO_CALL[name]
    if files is not None:
        env = dict(env, **core(tmp_path / "core", files))
    result = cli("watch", "--", PY, "-c", job, env=env)
    assert (result.returncode, result.stderr) == (code, ""), result
    assert result.stdout.startswith(f"mtp-mask-fix watch: {PY}: no MTP loss call"), result.stdout
    assert words in result.stdout, result.stdout
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.slow
def test_the_users_sitecustomize_still_runs(cli, env, tmp_path):
    """Found after watch's own on the path, it runs as `sitecustomize` in every process, as it did without watch."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
    env = dict(env, **core(tmp_path / "core", NEVER_RAN))
    env["PYTHONPATH"] += os.pathsep + str(tmp_path / "site")
    code = f"{IMPORT_GPT}; import os, sitecustomize; print(os.environ['USER_SITE_RAN'], sitecustomize.__file__)"
    result = cli("watch", "--", PY, "-c", code, env=env)
    ran, said = result.stdout.splitlines()
    assert ran == f"1 {tmp_path / 'site' / 'sitecustomize.py'}", result.stderr
    assert NEVER_CALLED in said  # and watch's own ran too


@pytest.mark.slow
def test_each_place_is_wrapped_once_whatever_core_imports_as_it_is_imported(cli, env):
    """Core's imports nest inside its own (the installed megatron-core): its MTP loss and LanguageModule.__call__ each
    get one wrapper, which its __wrapped__ takes out (as bench/benchmark.py's paired steps do), leaving core's own."""
    job = (
        f"{IMPORT_GPT}; import torch, megatron.core.transformer.multi_token_prediction as mtp\n"
        "from megatron.core.models.common.language_module.language_module import LanguageModule\n"
        "print(LanguageModule.__call__.__wrapped__ is torch.nn.Module.__call__, "
        "mtp.process_mtp_loss.__wrapped__.__module__ == mtp.__name__)"
    )
    result = cli("watch", "--", PY, "-c", job, env=env)
    assert result.stdout.splitlines()[0] == "True True", result


def _watching(env: dict, tmp_path, job: str, written: str) -> subprocess.Popen:
    """`watch -- python -c JOB` in a session of its own, once the job has written the file `written`."""
    watch = subprocess.Popen(
        [PY, "-m", "mtp_mask_fix", "watch", "--", PY, "-c", job],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    while not (tmp_path / written).exists() or not (tmp_path / written).read_text():
        assert watch.poll() is None, watch.communicate()
        time.sleep(0.05)
    return watch


def test_a_signal_as_the_job_starts_goes_on_to_the_job(mocker, tmp_path):
    """A signal that reaches watch while it starts its command (before it holds the job's handle) ends the command."""
    popen, started = subprocess.Popen, []

    def starting(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # inside Popen, to watch's one thread
        return started[0]

    mocker.patch("mtp_mask_fix.watch.subprocess.Popen", side_effect=starting)
    job = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); time.sleep(600)"
    try:
        with guard(), pytest.raises(Interrupted):
            watch([sys.executable, "-c", job], steps=None, strict=False)
        assert started[0].returncode is not None, "the job runs on after watch was interrupted"
    finally:
        started[0].kill()
        started[0].wait()


def test_a_signal_before_the_job_starts_ends_watch_and_starts_no_job(mocker):
    """A signal whose handler runs before watch blocks signals to start its command (between any two bytecodes) ends
    watch as interrupted, and the command never runs."""
    mocker.patch("mtp_mask_fix.watch.held", side_effect=Interrupted(signal.SIGTERM))
    popen = mocker.patch("mtp_mask_fix.watch.subprocess.Popen")
    with pytest.raises(BaseException) as raised:
        watch([sys.executable, "-c", "pass"], steps=None, strict=False)
    assert (raised.type, popen.call_count) == (Interrupted, 0)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_the_job_ends_and_nothing_is_left(env, tmp_path, signum):
    """SIGINT to watch's process group (Ctrl-C at a terminal), SIGTERM to watch alone: the command gets it once, ends,
    and watch says so in one line, 128+n, with its folder gone."""
    env = dict(env, **core(tmp_path / "core", NEVER_RAN))
    job = f"import os, signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); {IMPORT_GPT}; "
    job += "open('pid', 'w').write(str(os.getpid())); time.sleep(3600)"
    watch = _watching(env, tmp_path, job, "pid")
    (os.killpg if signum == signal.SIGINT else os.kill)(watch.pid, signum)
    out, err = watch.communicate(timeout=600)
    assert (watch.returncode, out) == (128 + signum, "")
    assert err == f"mtp-mask-fix: error: interrupted by {signum.name}: nothing changed\n"
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.slow
def test_a_second_signal_ends_a_job_that_ignores_the_first(env, tmp_path):
    """Ctrl-C twice at a terminal (SIGINT to watch's process group each time): the job, which ignores SIGINT, and the
    child it started end at the second; watch exits 130."""
    env = dict(env, **core(tmp_path / "core", NEVER_RAN))
    child = "import subprocess, sys; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])"
    job = f"import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); {IMPORT_GPT}; {child}; "
    job += "open('pids', 'w').write(f'{child.pid}'); time.sleep(3600)"
    watch = _watching(env, tmp_path, job, "pids")
    os.killpg(watch.pid, signal.SIGINT)
    with pytest.raises(subprocess.TimeoutExpired):  # the job ignores it, and watch waits for the job
        watch.wait(timeout=2)
    os.killpg(watch.pid, signal.SIGINT)
    try:
        out, err = watch.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        out, err = "", "still waiting for the job 600 s after the second SIGINT"
        watch.kill()
    assert (watch.returncode, out, err) == (130, "", "mtp-mask-fix: error: interrupted by SIGINT: nothing changed\n")
    stat = Path(f"/proc/{(tmp_path / 'pids').read_text()}/stat")
    deadline = time.monotonic() + 600
    while stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # gone, or a zombie not reaped yet
        assert time.monotonic() < deadline, f"the job's child still runs: {stat.read_text()}"
        time.sleep(0.05)


def report(rank: str | None, pid: int, **counts: int) -> dict:
    """A watched process's report: counts (the rest 0) of rank (None: a process without one)."""
    return dict(dict.fromkeys(COUNTS, 0), rank=rank, pid=pid, where=None, final=True, **counts)


TRAINED = dict(calls=4, trained=4)
NOTHING_JUDGED = "; no call judged"


def test_data_parallel_ranks_that_differ_only_in_their_data_print_the_job_line_alone():
    """How many positions each rank's MTP loss trains against its loss, or leaves unjudged, is its data's."""
    reports = [report(str(rank), 10 + rank, **TRAINED, against=4, counts=40 + rank) for rank in range(4)]
    text, code = verdict("job", 0, reports)
    assert (code, text.count("\n")) == (Exit.UNMASKED, 0), text
    assert "(run in 4 rank(s)): 16 trained against the contract: the MTP loss counts 166 positions" in text


def test_a_rank_unlike_the_others_gets_its_line():
    reports = [report(str(rank), 10 + rank, **TRAINED) for rank in range(3)]
    reports.append(report("3", 13, **TRAINED, no_mask=4, against=4))
    text, code = verdict("job", 0, reports)
    assert code == Exit.UNMASKED
    assert [line.split(":")[0] for line in text.splitlines()[1:]] == ["  rank 3"], text


def test_every_rank_counts_and_a_ranks_forks_count_as_the_rank():
    """Rank 1's data loader worker (a fork: its own pid, its rank's RANK), rank 0 a pipeline stage without the MTP
    loss, and a process without a rank that never called it (a launcher)."""
    reports = [report("0", 10), report("1", 11, **TRAINED), report("1", 12), report(None, 9)]
    text, code = verdict("job", 0, reports)
    assert (code, text.count("\n")) == (Exit.OK, 0), text
    assert (
        "MTP loss calls trained 4 (0 without labels), evaluated 0, not reached by a backward 0" in text
        and "(run in 2 rank(s))" in text
    )


def test_training_evaluation_and_forwards_awaiting_their_backward_are_counted_apart():
    text, _ = verdict("job", 0, [report("0", 10, calls=7, trained=4, evaluated=2)])
    assert "MTP loss calls trained 4 (0 without labels), evaluated 2, not reached by a backward 1" in text


@pytest.mark.parametrize("code", [0, 3, -9])
def test_a_verdict_stands_however_the_job_ended(code):
    """The job killed by SIGKILL (-9) after its first trained call: its report of that call decides."""
    text, exit_code = verdict("job", code, [report("0", 10, **TRAINED, against=1, leaves=2)])
    assert exit_code == Exit.UNMASKED and "the MTP loss leaves out 2 positions the loss's mask counts" in text, text


@pytest.mark.parametrize(
    "counts",
    [
        dict(calls=2, evaluated=2),
        dict(calls=1),
        dict(calls=2, trained=2, maskless=2),
        dict(calls=1, trained=1, unplaced=1),
    ],
    ids=str,
)
def test_nothing_judged_is_exit_5_unless_the_job_failed(counts):
    text, code = verdict("job", 0, [report("0", 10, **counts)])
    assert code == Exit.FAILED and text.endswith(
        NOTHING_JUDGED + ": none was trained" * (not counts.get("trained"))
    ), text
    assert verdict("job", -9, [report("0", 10, **counts)])[1] == 128 + 9
    assert verdict("job", 5, [report("0", 10, **counts)])[1] == Exit.JOB_FAILED


@pytest.mark.parametrize("code", [3, 5, 7])
def test_a_right_job_that_fails_exits_8_whatever_its_code(code):
    """The tool's own codes keep their meanings: a job's 7 is not a finding, its 3 not `check`'s."""
    text, exit_code = verdict("job", code, [report("0", 10, **TRAINED)])
    assert exit_code == Exit.JOB_FAILED, text
    assert text.endswith(f": no finding; job ended with exit code {code}"), text


def test_counts_a_process_killed_before_its_last_report_are_said_to_be_partial():
    reports = [dict(report("0", 10, **TRAINED), final=False), report("1", 11, **TRAINED)]
    text, code = verdict("job", -9, reports)
    assert code == 128 + 9 and "; 1 process(es) ended without a last report (SIGKILL, a crash): " in text, text
    assert "ended without a last report" not in verdict("job", 0, reports[1:])[0]


TRAINS = {  # a stand-in MTP loss with the arguments core's has, passing the hidden states on as core's does
    GPT_MODEL: "from megatron.core.transformer.multi_token_prediction import process_mtp_loss\n",
    "megatron/core/transformer/multi_token_prediction.py": "def process_mtp_loss(hidden_states, labels, loss_mask, "
    "input_ids=None):\n    return hidden_states * 1\n",
}


@pytest.mark.slow
def test_a_job_stopped_through_watch_after_masked_steps_prints_its_counts_and_exits_128_plus_n(env, tmp_path):
    """Two trained calls with the batch's mask, then SIGTERM to watch alone (as `timeout` sends it)."""
    env = dict(env, **core(tmp_path / "core", TRAINS))
    job = f"import os, time, torch; {IMPORT_GPT} as g; inputs = torch.arange(10)[None]; labels = inputs.roll(-1)\n"
    job += "for _ in range(2):\n    h = torch.ones(10, 1, 4, requires_grad=True)\n"
    job += "    g.process_mtp_loss(h, labels, torch.ones(1, 10), input_ids=inputs).sum().backward()\n"
    job += "open('pid', 'w').write(str(os.getpid())); time.sleep(3600)"
    watch = _watching(env, tmp_path, job, "pid")
    watch.send_signal(signal.SIGTERM)
    out, err = watch.communicate(timeout=600)
    assert (watch.returncode, err) == (128 + signal.SIGTERM, "")
    assert out.startswith("mtp-mask-fix watch: ") and out.count("\n") == 1, out
    counts = "MTP loss calls trained 2 (0 without labels), evaluated 0, not reached by a backward 0"
    assert counts in out and out.endswith("; stopped by SIGTERM\n"), out
    assert list((tmp_path / "tmp").iterdir()) == []


def test_steps_says_how_many_calls_of_each_process_were_counted():
    text, code = verdict("job", 0, [report("0", 10, **TRAINED)], steps=4)
    assert code == Exit.OK and "(run in 1 rank(s); each process's first 4 calls counted, --steps): no finding" in text
