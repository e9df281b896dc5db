"""`mtp-mask-fix watch` on the real tiny megatron-core GPTModel with MTP, each case one watched command run as a user
runs it (`python -m tinymodel.worker`, whose ranks fork from a fresh process, or torchrun), all started at once:

- Bridge's forward_step, one step of the SFT batch: on the view (release + patch) watch is silent, and the loss and
  every gradient are bit-identical to this session's unwatched step; on the release as shipped, PP2 reports each
  rank, and --strict stops at the first call, naming Bridge's call of the model;
- torchrun, two ranks calling the model themselves: Megatron-LM's way (labels, loss_mask) is silent, a label-less
  call (core derives the labels from input_ids) without a mask is reported; two data-parallel ranks that differ only
  in their data print the job's line alone;
- a loop of tests/watch/loops.py stopped through watch, killed with SIGKILL after its first trained call, or ending
  with exit 3, still has its verdict printed, and --strict keeps what the job printed before it stopped the job.

Every expected count comes from the batches; a watch that reports nothing fails each case. Only the jobs of the
selected tests start, all in `./run test --all` (the push tier holds watch's in-process tests). Each job's processes
also load this environment's own sitecustomize (tinymodel/site: the TransformerEngine stub Megatron-Bridge's import
needs), which watch's hides and runs.
"""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from maintain.repo import REPO, VIEW, pins, release
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.paths import GPT_STEP
from tests.watch import loops
from tinymodel import cpu_runtime, gpt, pipeline
from tinymodel.reference import changed_grads
from tinymodel.worker import Launch


pytestmark = pytest.mark.slow
RELEASE = release(pins()["megatron-bridge"]).root
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
OUT = Path("out")  # in each job's folder
STEP = ("--function", "tests.watch.one_step:step", "--arg", "")
RANKS, LOOPS = (
    str(Path(__file__).with_name("rank_calls.py")),
    [sys.executable, str(Path(__file__).with_name("loops.py"))],
)
JOBS = {  # name: (watch's options, the command: a worker run of its tree, or one with the view first on the path)
    "view": ((), Launch("call", VIEW, 1, OUT, STEP)),
    "strict": (("--strict",), Launch("call", RELEASE, 1, OUT, STEP)),
    "pp2": (("--steps", "3"), Launch("pipeline", RELEASE, 2, OUT)),
    "pp2 patched": ((), Launch("pipeline", VIEW, 2, OUT)),
    "torchrun": ((), [*TORCHRUN, RANKS, "mixed"]),
    "data-parallel": ((), [*TORCHRUN, RANKS, "data-parallel"]),
    "SIGINT": ((), [*LOOPS, "no mask", "--steps", "2", "--then", "sleep"]),
    "SIGTERM": ((), [*LOOPS, "no mask", "--steps", "2", "--then", "sleep"]),
    "SIGKILL": ((), [*LOOPS, "no mask", "--steps", "1", "--then", "sleep"]),
    "exit 3": ((), [*LOOPS, "sft", "--steps", "2", "--then", "exit-3"]),
    "strict, stdout to a file": (("--strict",), [*LOOPS, "no mask"]),
}
COUNTS = re.compile(
    r"MTP loss calls trained (\d+) \((\d+) without labels\), evaluated (\d+), not reached by a backward (\d+)"
)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, request):
    """The selected tests' jobs started now; each test waits for its own: name -> folder, Popen (stdout, stderr in the
    folder)."""
    started, chosen = (
        {},
        {item.callspec.params.get("watched") for item in request.session.items if hasattr(item, "callspec")},
    )
    for name, (options, command) in ((name, job) for name, job in JOBS.items() if name in chosen):
        folder, tree = tmp_path_factory.mktemp(name), command.tree if isinstance(command, Launch) else VIEW
        (folder / "tmp").mkdir()
        if isinstance(command, Launch):
            command = [sys.executable, "-m", "tinymodel.worker", *command.argv()]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]), TMPDIR=str(folder / "tmp"))
        env.pop("PYTHONUNBUFFERED", None)  # as a user's shell has it: stdout to a file is block-buffered
        argv = [sys.executable, "-m", "mtp_mask_fix", "watch", *options, "--", *command]
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
            started[name] = (
                folder,
                subprocess.Popen(argv, cwd=folder, env=env, stdout=out, stderr=err, start_new_session=True),
            )
    yield started
    for _, job in started.values():  # one a failed test left running: watch stops its command, then itself
        job.terminate()
        job.wait(timeout=600)


@dataclass
class Watched:
    """A job, ended: watch's exit code, its lines as {"job" or "rank N": (trained, without labels, evaluated, not reached
    by a backward)}, the job's line, watch's folders left in TMPDIR, the job's folder."""

    code: int
    report: dict[str, tuple]
    head: str
    left: list[Path]
    folder: Path

    @property
    def log(self) -> str:
        return (self.folder / "stderr").read_text()[-3000:]


@pytest.fixture
def watched(jobs, request) -> Watched:
    """The job the test's parameter names, once it has ended."""
    folder, job = jobs[request.param]
    if request.param in ("SIGINT", "SIGTERM", "SIGKILL"):  # stopped as a user stops it, once its steps have run
        while not (folder / "steps-done").exists() or not (folder / "steps-done").read_text():
            assert job.poll() is None, (folder / "stderr").read_text()[-3000:]
            time.sleep(0.1)
        if request.param == "SIGKILL":  # the job's process, as the OOM killer ends it: watch sees it die
            os.kill(int((folder / "steps-done").read_text()), signal.SIGKILL)
        else:
            os.kill(job.pid, signal.Signals[request.param])
    code = job.wait(timeout=600)
    lines = (folder / "stdout").read_text().splitlines()  # the job's own output comes first: the stream is shared
    lines = lines[max((i for i, line in enumerate(lines) if line.startswith("mtp-mask-fix watch:")), default=0) :]
    report = {}
    for line in lines:
        if counts := COUNTS.search(line):
            who = "job" if line.startswith("mtp-mask-fix watch:") else line.split(":")[0].strip()
            report[who] = tuple(map(int, counts.groups()))
    left = list((folder / "tmp").glob("mtp-mask-fix-*"))  # the job's own files may stay (torch's caches)
    return Watched(code, report, lines[0] if lines else "", left, folder)


def trains(*masks: torch.Tensor) -> str:
    """What watch says of calls without a mask whose loss applies these masks: their zeros, each label from the
    second on."""
    return f"the MTP loss counts {sum(int((mask == 0)[:, 1:].sum()) for mask in masks)} positions the loss's mask leaves out"


MASK = gpt.make_sft_batch()["loss_mask"]
UNMASKED = "trained against the contract: {} without a loss_mask (core's MTP loss counts every position); "


@pytest.fixture(scope="module")
def unwatched_step():
    """This session's own step of the same model on the same batch (its tree is the view), without watch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every worker rank
    cpu_runtime.init_distributed()
    try:
        yield gpt.run_step(gpt.build_model(1), gpt.make_sft_batch())
    finally:
        cpu_runtime.shutdown_distributed()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("watched", ["view"], indirect=True)
def test_bridge_patched_is_silent_and_the_step_bit_identical(watched, unwatched_step):
    silent = (Exit.OK, {"job": (1, 0, 0, 0)}, [])  # one call, trained with its mask: no line of a rank
    assert (watched.code, watched.report, watched.left) == silent, watched.log
    assert "against the contract" not in watched.head and "; not judged:" not in watched.head
    step = torch.load(watched.folder / OUT / "rank0.pt", weights_only=False)["step"]
    assert (step.lm_loss, step.mtp_losses, step.grad_norm) == (
        unwatched_step.lm_loss,
        unwatched_step.mtp_losses,
        unwatched_step.grad_norm,
    )
    assert step.grads and changed_grads(step.grads, unwatched_step.grads) == []


@pytest.mark.parametrize("watched", ["pp2"], indirect=True)
def test_bridge_unpatched_on_pp2_reports_the_last_stages_calls(watched):
    """--steps 3: rank 1 (the last stage, MTP) counts 3 of its calls (the step's micro-batches, then the perturbed
    copy's first), each trained, and the job runs to its end; rank 0 runs none, which is no line of its own."""
    first, second = (batch["loss_mask"] for batch in pipeline.micro_batches())
    assert (watched.code, watched.report, watched.left) == (Exit.UNMASKED, {"job": (3, 0, 0, 0)}, []), watched.log
    assert "(run in 2 rank(s); each process's first 3 calls counted, --steps): 3 " + UNMASKED.format(3) in watched.head
    assert trains(first, second, first) in watched.head
    assert sorted(p.name for p in (watched.folder / OUT).glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]


@pytest.mark.parametrize("watched", ["pp2 patched"], indirect=True)
def test_bridge_patched_on_pp2_is_silent(watched):
    """Both steps' two micro-batches, each trained with its mask on the last stage."""
    assert (watched.code, watched.report, watched.left) == (Exit.OK, {"job": (4, 0, 0, 0)}, []), watched.log
    assert "(run in 2 rank(s))" in watched.head and "against the contract" not in watched.head


@pytest.mark.parametrize("watched", ["strict"], indirect=True)
def test_bridge_unpatched_strict_stops_at_the_forward_steps_call(watched):
    assert (watched.code, watched.report, watched.left) == (Exit.UNMASKED, {"job": (1, 0, 0, 0)}, []), watched.log
    assert "1 " + UNMASKED.format(1) + trains(MASK) in watched.head
    where = re.search(r"stopped \(--strict\) at (.+):(\d+) in (\w+)$", watched.head)
    assert where, watched.head
    assert (where[1], where[3]) == (str(RELEASE / GPT_STEP), "_forward_step_common")
    assert "model(" in Path(where[1]).read_text().splitlines()[int(where[2]) - 1]
    assert not (watched.folder / OUT / "rank0.pt").exists()  # stopped before the step ended


@pytest.mark.parametrize("watched", ["strict, stdout to a file"], indirect=True)
def test_strict_keeps_what_the_job_printed(watched):
    assert (watched.code, watched.report["job"]) == (Exit.UNMASKED, (1, 0, 0, 0)), watched.log
    job = (watched.folder / "stdout").read_text().splitlines()
    assert job[0] == "no mask: 1 step(s)"  # printed before the stop, buffered: a file is no terminal
    assert re.search(r"stopped \(--strict\) at .+loops\.py:\d+ in run$", watched.head), watched.head


@pytest.mark.parametrize("watched", ["torchrun"], indirect=True)
def test_torchrun_ranks_megatron_lm_call_silent_label_less_call_reported(watched):
    ranks = {"job": (2, 1, 0, 0), "rank 0": (1, 0, 0, 0), "rank 1": (1, 1, 0, 0)}
    assert (watched.code, watched.report, watched.left) == (Exit.UNMASKED, ranks, []), watched.log
    assert "(run in 2 rank(s)): 1 trained against the contract: 1 without a loss_mask" in watched.head


@pytest.mark.parametrize("watched", ["data-parallel"], indirect=True)
def test_torchrun_data_parallel_ranks_print_the_job_line_alone(watched):
    """Their batches differ (one padded on the right, one on the left): that is data, not a difference in training."""
    silent = (Exit.OK, {"job": (2, 0, 0, 0)}, [])
    assert (watched.code, watched.report, watched.left) == silent, watched.log


@pytest.mark.parametrize("watched", ["SIGINT", "SIGTERM", "SIGKILL"], indirect=True)
def test_a_job_stopped_keeps_its_verdict(watched, request):
    """Unmasked steps, then a signal to watch (it passes it on once, and prints what the job reported), or SIGKILL to
    the job's process after its first trained call: its report of that call stands."""
    sig, steps = request.node.callspec.params["watched"], 2 - (request.node.callspec.params["watched"] == "SIGKILL")
    assert (watched.code, watched.report, watched.left) == (Exit.UNMASKED, {"job": (steps, 0, 0, 0)}, [])
    assert f"{steps} " + UNMASKED.format(steps) + trains(*[loops.sft()["mask"]] * steps) in watched.head
    ending = f"was killed by {sig}" if sig == "SIGKILL" else f"stopped by {sig}"
    assert watched.head.endswith(ending), watched.head


@pytest.mark.parametrize("watched", ["exit 3"], indirect=True)
def test_a_job_that_fails_after_masked_steps_prints_its_counts(watched):
    assert (watched.code, watched.report, watched.left) == (Exit.JOB_FAILED, {"job": (2, 0, 0, 0)}, [])
    assert watched.head.endswith(f"; {sys.executable} ended with exit code 3"), watched.head
    assert "against the contract" not in watched.head
