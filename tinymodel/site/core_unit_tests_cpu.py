"""CPU shims for megatron-core's own unit tests on this machine (no CUDA, no NCCL), a pytest plugin that `./run gate`
loads into its sessions of Megatron-LM trees (`-p core_unit_tests_cpu`). Nothing here enters a patch.

- tests/unit_tests/test_utilities.py's Utils.initialize_distributed calls torch.cuda.set_device(local_rank %
  torch.cuda.device_count()) and starts an NCCL process group: no device to set, gloo instead of NCCL.
- It meets its peers at MASTER_PORT, 29500 by default, and gate runs two sessions at once: a free port each, unless
  a launcher (torchrun) started several ranks, which share the port it set.
- Its rendezvous gives up after one minute, and on a loaded machine one rank may still be importing the test module
  minutes after another: several ranks meet here first, before collection, with torch's own timeout.
- MTPLossLoggingHelper allocates its tracker on torch.cuda.current_device(): the CPU.
- `--nccl-ranks N` stands in for upstream's CI, where gloo would hide what NCCL refuses: the session starts N - 1 more
  ranks on its own command line, a collective on CPU tensors fails as on an NCCL group (any group not made as gloo),
  and each test's setup and call end on every rank as on the worst of them, so rank 0's outcomes speak for all.
"""

import datetime
import functools
import inspect
import os
import socket
import subprocess
import sys

import pytest
import torch


# What NCCL runs on CUDA tensors only (torch.distributed's names; Megatron calls them as its attributes).
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
PEERS = []  # the ranks this session started


def pytest_addoption(parser):
    """The option that runs the session on several ranks, as NCCL would."""
    parser.addoption(
        "--nccl-ranks",
        type=int,
        default=0,
        metavar="N",
        help="run on N ranks that refuse CPU collectives as NCCL does",
    )


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return str(probe.getsockname()[1])


def pytest_configure(config):
    """Before any test: CUDA calls answered on the CPU, gloo for NCCL; several ranks meet, one gets a free MASTER_PORT."""
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    init = torch.distributed.init_process_group
    torch.distributed.init_process_group = lambda backend=None, *args, **kwargs: init("gloo", *args, **kwargs)
    ranks = config.getoption("nccl_ranks")
    if ranks:
        _refuse_cpu_tensors()
        if "RANK" not in os.environ:  # rank 0: started by gate, not by a launcher
            _start_peers(config, ranks)
    if ranks and "CORE_UNIT_TESTS_STORE_PORT" in os.environ:  # the ranks that rank 0 started
        config.pluginmanager.register(_Agreement(ranks))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as the launcher set them
        return
    os.environ["MASTER_PORT"] = _free_port()


def pytest_unconfigure(config):
    """Rank 0 ends after the ranks it started (each ends its session when rank 0 does, collectives aside)."""
    for peer in PEERS:
        try:
            peer.wait(timeout=600)
        except subprocess.TimeoutExpired:
            peer.kill()


def _start_peers(config, ranks: int) -> None:
    """Ranks 1..N-1 on this session's command line, each recording its outcomes (maintain.redgreen's) beside rank 0's."""
    env = dict(os.environ, WORLD_SIZE=str(ranks), MASTER_ADDR="localhost", MASTER_PORT=_free_port())
    env["CORE_UNIT_TESTS_STORE_PORT"] = _free_port()
    for rank in range(1, ranks):
        args = [f"{arg}.rank{rank}" if arg.startswith("--outcomes=") else arg for arg in config.invocation_params.args]
        PEERS.append(
            subprocess.Popen(
                [sys.executable, "-m", "pytest", *args],
                cwd=config.invocation_params.dir,
                env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    os.environ.update(env, RANK="0", LOCAL_RANK="0")


def _refuse_cpu_tensors() -> None:
    """Collectives on a group that upstream's CI makes NCCL (the default and any not made as gloo) refuse CPU tensors."""
    gloo, new_group = set(), torch.distributed.new_group

    @functools.wraps(new_group)
    def made(*args, **kwargs):
        group = new_group(*args, **kwargs)
        if "gloo" in str(inspect.signature(new_group).bind(*args, **kwargs).arguments.get("backend")):
            gloo.add(group)
        return group

    torch.distributed.new_group = made
    for name in COLLECTIVES:
        setattr(torch.distributed, name, _refusing(getattr(torch.distributed, name), gloo))


def _refusing(collective, gloo: set):
    signature = inspect.signature(collective)

    @functools.wraps(collective)
    def refusing(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments
        tensors = [t for v in given.values() for t in (v if isinstance(v, (list, tuple)) else [v])]
        if given.get("group") not in gloo and any(torch.is_tensor(t) and t.device.type == "cpu" for t in tensors):
            raise RuntimeError("No backend type associated with device type cpu")  # NCCL's words
        return collective(*args, **kwargs)

    return refusing


class _Agreement:
    """Each test's setup and call end alike on every rank, as the worst of them: a rank that passes where another
    failed fails too, naming that rank, by assertion if it failed by one."""

    def __init__(self, ranks: int):
        self.rank, self.ranks = int(os.environ["RANK"]), ranks
        port = int(os.environ["CORE_UNIT_TESTS_STORE_PORT"])
        timeout = datetime.timedelta(minutes=10)  # a rank stuck in a collective fails rather than hangs
        self.store = torch.distributed.TCPStore("localhost", port, ranks, self.rank == 0, timeout=timeout)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        return (yield from self._agree(item, "setup"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self._agree(item, "call"))

    def _agree(self, item, when: str):
        error = None
        try:
            result = yield
        except (AssertionError, Exception, pytest.skip.Exception, pytest.fail.Exception) as raised:
            error = raised
        self.store.set(f"{item.nodeid} {when} {self.rank}", _said(error))
        theirs = {rank: self.store.get(f"{item.nodeid} {when} {rank}").decode() for rank in range(self.ranks)}
        if error is not None:
            raise error
        for rank, what in theirs.items():
            kind, _, why = what.partition(" ")
            if kind in ("assertion", "other"):
                raise (AssertionError if kind == "assertion" else RuntimeError)(f"rank {rank}: {why}")
        return result


def _said(error: BaseException | None) -> str:
    """How a rank's setup or call ended, as the others read it."""
    if error is None or isinstance(error, pytest.skip.Exception):
        return "passed" if error is None else "skipped"
    return f"{'assertion' if isinstance(error, AssertionError) else 'other'} {type(error).__name__}: {error}"
