"""Red/green's runner, `python -m maintain.redgreen.runner`: the sessions a client sends on stdin, each in a fork.

It imports the third-party stack and the first tree's megatron.bridge once (or the tree it was started with, before
the sessions are known), then forks a pytest session per job with that job's tree first on the import path. A forked
session keeps the warm megatron.bridge only where each of its modules is the same file in its own tree (what that saves
the push tier: CONTRIBUTING.md). Megatron-LM's trees hold megatron.core itself, which that stack would import from the
environment: their sessions start warm with torch alone.
"""

import contextlib
import importlib.util
import json
import multiprocessing.connection  # and multiprocessing itself
import os
import sys
from pathlib import Path

import pytest

from maintain.redgreen.contract import GPT_STEP_MODULE, PYTEST


# What every session under test imports before megatron.bridge, whatever the tree: imported once, before the fork.
WARM = ("megatron.core", "megatron.training", "modelopt.torch.distill", "transformers")


def _bridge() -> list[str]:
    return [name for name in sys.modules if name.split(".")[:2] == ["megatron", "bridge"]]


def _drop_bridge() -> None:
    """No megatron.bridge at all: out of sys.modules and off `megatron` (`from megatron import bridge` reads that)."""
    for name in _bridge():
        del sys.modules[name]
    if hasattr(sys.modules.get("megatron"), "bridge"):
        del sys.modules["megatron"].bridge


def _warm_bridge(tree: str) -> None:
    """Import megatron.bridge from `tree` once, or none where that fails or imports gpt_step (each session's own)."""
    sys.path.insert(0, tree)
    with contextlib.suppress(Exception):  # an import that fails leaves no megatron.bridge in sys.modules
        importlib.import_module("megatron.bridge")
    sys.path.remove(tree)
    if "megatron.bridge" not in sys.modules or GPT_STEP_MODULE in sys.modules:
        _drop_bridge()


def _adopt_bridge(tree: str, warmed: str) -> None:
    """Keep the warm megatron.bridge, searched in `tree`, where each module is the same file there; else drop it."""
    tree, found = os.path.abspath(tree), {}  # absolute: the session changes directory before it imports
    for module in map(sys.modules.get, _bridge()):
        where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
        mine = os.path.join(tree, os.path.relpath(where, warmed)) if where else None
        if not (mine and os.path.exists(mine) and os.path.samefile(mine, where)):
            _drop_bridge()
            return
        found[module] = mine
    for module, mine in found.items():
        if hasattr(module, "__path__"):  # a package: its own directory there, or a namespace package's
            module.__path__ = [os.path.dirname(mine) if getattr(module, "__file__", None) else mine]


def _session(warmed: str, out: str, args: list[str], tree: str, cwd: str, module: str) -> None:
    _adopt_bridge(tree, warmed)
    os.chdir(cwd)
    Path(out).touch()  # a session that records nothing still leaves its file
    pytest.main([*PYTEST, "-o", f"pythonpath={tree}", f"--outcomes={out}", f"--outcomes-module={module}", *args])


if __name__ == "__main__":  # each session on stdin (a client's Job and its `out`) is one pytest run, in a fork
    early = sys.argv[1:2]  # a Megatron-Bridge tree to warm from before the sessions come; they test that module
    sessions = [] if early else json.loads(sys.stdin.read() or "[]")  # nothing: the suite that started it has ended
    bridge = all(session["module"] == GPT_STEP_MODULE for session in sessions)
    for module in WARM if bridge else ("torch",):  # what the environment lacks is skipped (core < 0.17: no training)
        if importlib.util.find_spec(module.split(".")[0]) and importlib.util.find_spec(module):
            importlib.import_module(module)
    warmed = (early or [session["tree"] for session in sessions] or [None])[0]
    if warmed and bridge:
        _warm_bridge(warmed)
    sessions = json.loads(sys.stdin.read() or "[]") if early else sessions
    parallel = os.cpu_count() or 1
    fork = multiprocessing.get_context("fork")  # not a Pool: it waits forever on a worker that died
    pending, running = [fork.Process(target=_session, args=(warmed,), kwargs=session) for session in sessions], []
    while pending or running:  # a session that dies (os._exit, a signal) ends there: its tests read "did not run"
        while pending and len(running) < parallel:
            running.append(pending.pop(0))
            running[-1].start()
        multiprocessing.connection.wait([process.sentinel for process in running])
        running = [process for process in running if process.is_alive()]
