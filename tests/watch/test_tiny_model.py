"""`mtp-mask-fix watch` on the real tiny megatron-core GPTModel with MTP, each case one watched command run as a user
runs it (`python -m tinymodel.worker`, whose ranks fork from a fresh process, or torchrun), all started at once:

- Bridge's forward_step, one step of the SFT batch: on the view (release + patch) watch is silent, and the loss and
  every gradient are bit-identical to this session's unwatched step; on the release as shipped, PP2 reports each
  rank, and --strict stops at the first call, naming Bridge's call of the model;
- torchrun, two ranks calling the model themselves: Megatron-LM's way (labels, loss_mask) is silent, a label-less
  call (core derives the labels from input_ids) is reported.

Every expected count comes from the batches; a watch that reports nothing fails each case. Each job's processes
also load this environment's own sitecustomize (tinymodel/site: the TransformerEngine stub Megatron-Bridge's import
needs), which watch's hides and runs.
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from maintain.repo import REPO, VIEW, pins, release
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.paths import GPT_STEP
from tinymodel import cpu_runtime, gpt
from tinymodel.reference import changed_grads
from tinymodel.worker import Launch


RELEASE = release(pins()["megatron-bridge"]).root
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]
OUT = Path("out")  # in each job's folder
STEP = ("--function", "tests.watch.one_step:step", "--arg", "")
JOBS = {  # name: (watch's options, the command: a worker run of its tree, or one with the view first on the path)
    "view": ((), Launch("call", VIEW, 1, OUT, STEP)),
    "strict": (("--strict",), Launch("call", RELEASE, 1, OUT, STEP)),
    "pp2": (("--steps", "3"), Launch("pipeline", RELEASE, 2, OUT)),
    "torchrun": ((), [*TORCHRUN, str(Path(__file__).with_name("rank_calls.py"))]),
}
COUNTS = re.compile(
    r"MTP loss calls (\d+): (\d+) without loss_mask, (\d+) without labels, (\d+) with an all-ones mask; "
    r"([\d.]+)% of positions masked"
)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every job started now; each test waits for its own: name -> folder, Popen (stdout, stderr in the folder)."""
    started = {}
    for name, (options, command) in JOBS.items():
        folder, tree = tmp_path_factory.mktemp(name), command.tree if isinstance(command, Launch) else VIEW
        (folder / "tmp").mkdir()
        if isinstance(command, Launch):
            command = [sys.executable, "-m", "tinymodel.worker", *command.argv()]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]), TMPDIR=str(folder / "tmp"))
        argv = [sys.executable, "-m", "mtp_mask_fix", "watch", *options, "--", *command]
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
            started[name] = folder, subprocess.Popen(argv, cwd=folder, env=env, stdout=out, stderr=err)
    yield started
    for _, job in started.values():  # one a failed test left running: watch stops its command, then itself
        job.terminate()
        job.wait(timeout=60)


@dataclass
class Watched:
    """A job, ended: watch's exit code, its lines as {"job" or "rank N": (calls, without loss_mask, without labels,
    with an all-ones mask, % masked)}, the job's line, watch's folders left in TMPDIR, the job's folder."""

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
    code = job.wait(timeout=600)
    lines = (folder / "stdout").read_text().splitlines()  # the job's own output comes first: the stream is shared
    lines = lines[max((i for i, line in enumerate(lines) if line.startswith("mtp-mask-fix watch:")), default=0) :]
    report = {}
    for line in lines:
        if counts := COUNTS.search(line):
            who = "job" if line.startswith("mtp-mask-fix watch:") else line.split(":")[0].strip()
            report[who] = (*map(int, counts.groups()[:4]), float(counts.group(5)))
    left = list((folder / "tmp").glob("mtp-mask-fix-*"))  # the job's own files may stay (torch's caches)
    return Watched(code, report, lines[0] if lines else "", left, folder)


def masked(*masks: torch.Tensor) -> float:
    """The share of the label positions that these masks mask, in %, as watch prints it."""
    flat = torch.cat([mask.flatten() for mask in masks])
    return round(100 * float((flat == 0).sum()) / flat.numel(), 1)


MASK = gpt.make_sft_batch()["loss_mask"]


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
    silent = (Exit.OK, {"job": (1, 0, 0, 0, masked(MASK))}, [])  # one call, its mask: no line of a rank
    assert (watched.code, watched.report, watched.left) == silent, watched.log
    step = torch.load(watched.folder / OUT / "rank0.pt", weights_only=False)["step"]
    assert (step.lm_loss, step.mtp_losses, step.grad_norm) == (
        unwatched_step.lm_loss,
        unwatched_step.mtp_losses,
        unwatched_step.grad_norm,
    )
    assert step.grads and changed_grads(step.grads, unwatched_step.grads) == []


@pytest.mark.parametrize("watched", ["pp2"], indirect=True)
def test_bridge_unpatched_on_pp2_reports_each_rank(watched):
    """--steps 3: rank 1 (the last stage, MTP) counts 3 of its calls (the step's micro-batches, then the perturbed
    copy's) and the job runs to its end; rank 0 has none."""
    ranks = {"job": (3, 3, 0, 0, 0.0), "rank 0": (0, 0, 0, 0, 0.0), "rank 1": (3, 3, 0, 0, 0.0)}
    assert (watched.code, watched.report, watched.left) == (Exit.UNMASKED, ranks, []), watched.log
    assert "3 trained without a loss_mask" in watched.head
    assert sorted(p.name for p in (watched.folder / OUT).glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]


@pytest.mark.parametrize("watched", ["strict"], indirect=True)
def test_bridge_unpatched_strict_stops_at_the_forward_steps_call(watched):
    assert (watched.code, watched.report, watched.left) == (Exit.UNMASKED, {"job": (1, 1, 0, 0, 0.0)}, []), watched.log
    where = re.search(r"stopped \(--strict\) at (.+):(\d+) in (\w+)$", watched.head)
    assert where, watched.head
    assert (where[1], where[3]) == (str(RELEASE / GPT_STEP), "_forward_step_common")
    assert "model(" in Path(where[1]).read_text().splitlines()[int(where[2]) - 1]
    assert not (watched.folder / OUT / "rank0.pt").exists()  # stopped before the step ended


@pytest.mark.parametrize("watched", ["torchrun"], indirect=True)
def test_torchrun_ranks_megatron_lm_call_silent_label_less_call_reported(watched):
    ranks = {
        "job": (2, 1, 1, 0, masked(MASK, torch.ones_like(MASK))),  # every position of rank 1's call counts
        "rank 0": (1, 0, 0, 0, masked(MASK)),
        "rank 1": (1, 1, 1, 0, 0.0),
    }
    assert (watched.code, watched.report, watched.left) == (Exit.UNMASKED, ranks, []), watched.log
    assert "1 trained without a loss_mask" in watched.head
