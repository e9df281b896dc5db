"""Run several pytest sessions from one warm process: import the third-party stack once, fork per session.

`python -m mtp_mask_fix.warm_pytest` reads {"warm": [module, ...], "jobs": [{args, cwd, out}, ...]} on stdin, imports
the warm modules (the caller names them: the third-party stack of the tree under test), then runs the jobs. The tool
itself imports none of them. Nothing of megatron.bridge is imported before the fork: each child's arguments put its own tree first on the import
path, exactly as in a fresh process. What is shared (torch, megatron.core, megatron.training, transformers,
modelopt) is the same for every tree, and importing it is most of a session's start-up.
"""

import importlib
import importlib.util
import json
import os
import sys


def _child(job: dict) -> None:
    os.chdir(job["cwd"])
    os.environ["MTP_FIX_OUTCOMES"] = job["out"] + ".jsonl"  # the recorder plugin writes there
    log = os.open(job["out"] + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import pytest

    code = pytest.main(job["args"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def main() -> None:
    """Fork one child per job, at most `parallel` at a time; each leaves OUT.jsonl (the recorder's) and OUT.log."""
    spec = json.load(sys.stdin)
    jobs = spec["jobs"]
    parallel = max(1, int(os.environ.get("MTP_FIX_PARALLEL", os.cpu_count() or 1)))
    for module in ["pytest", *spec["warm"]]:
        if importlib.util.find_spec(module.split(".")[0]) and importlib.util.find_spec(module):  # megatron-core < 0.17
            importlib.import_module(module)  # has no megatron.training: what the environment lacks is not warmed
    pending, running = list(jobs), 0
    while pending or running:
        while pending and running < parallel:
            job = pending.pop(0)
            if os.fork() == 0:
                _child(job)
            running += 1
        os.wait()
        running -= 1


if __name__ == "__main__":
    main()
