"""The sitecustomize of each Python process that `mtp-mask-fix watch` runs: it counts what megatron-core's MTP loss is
handed, reports that to watch's folder at exit and runs the sitecustomize it hides; standard library only, inert."""

import atexit
import builtins
import collections
import contextlib
import functools
import importlib.machinery
import importlib.util
import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
MTP, GPT = "megatron.core.transformer.multi_token_prediction", "megatron.core.models.gpt.gpt_model"
LOOKED_FOR = f"{MTP}.process_mtp_loss (megatron-core 0.17 on), or the inline one of {GPT}.GPTModel._postprocess (0.16)"
CONFIG = json.loads(os.environ.get("MTP_MASK_FIX_WATCH", "{}"))  # {"steps": N or null, "strict": its exit code or 0}
COUNTS = ("calls", "no_mask", "no_labels", "ones", "masked", "positions", "unmasked")
seen, found, _exit, _import = collections.Counter(), [], os._exit, builtins.__import__


def _observe(c):  # an MTP loss call's arguments by name ("self": 0.16's GPTModel._postprocess computes it inline)
    if "self" in c and not (c["self"].post_process and c["self"].config.mtp_num_layers is not None):
        return  # not the stage with the output layer, or MTP off
    seen.update(calls=1, no_labels=c.get("labels") is None, no_mask=c.get("loss_mask") is None)
    labels = c.get("input_ids") if c.get("labels") is None and "self" not in c else c.get("labels")  # 0.19: derived
    if labels is None:  # core computes no MTP loss
        return
    seen.update(positions=labels.numel())
    training = c["self"].training if "self" in c else c.get("is_training")
    if c.get("loss_mask") is not None:  # tensors, summed on their device: no synchronisation before the report
        seen.update(masked=(c["loss_mask"] == 0).sum(), ones=(c["loss_mask"] == 1).all())
    elif training and getattr(c.get("hidden_states"), "requires_grad", False):  # the gradient covers every position
        seen.update(unmasked=1)
        if CONFIG.get("strict"):  # the first frame outside core, torch and this file: the forward step's call
            skip = (*(os.path.dirname(sys.modules[m].__file__) + os.sep for m in ("torch", "megatron.core")), __file__)
            frame = sys._getframe(1)
            while frame and frame.f_code.co_filename.startswith(skip):
                frame = frame.f_back
            seen["where"] = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "?"
            _report()
            _exit(CONFIG["strict"])


def _report():
    if found:
        report = dict({key: int(seen[key]) for key in COUNTS}, rank=os.environ.get("RANK"), pid=os.getpid())
        path = os.path.join(HERE, str(os.getpid()))
        with contextlib.suppress(OSError):  # watch has ended, and its folder with it
            with open(path + ".tmp", "w") as out:
                json.dump(dict(report, where=seen.get("where")), out)
            os.replace(path + ".tmp", path + ".json")


def _wrap(function):
    names = function.__code__.co_varnames[: function.__code__.co_argcount + function.__code__.co_kwonlyargcount]

    @functools.wraps(function)
    def watched(*args, **kwargs):
        if seen["calls"] != CONFIG.get("steps"):  # --steps N: N calls counted, reported at once, then no more
            _observe(dict(zip(names, args), **kwargs))
            if seen["calls"] == CONFIG.get("steps"):
                _report()
        return function(*args, **kwargs)

    return watched


def _importing(*args, **kwargs):
    """builtins.__import__ until core's MTP loss is wrapped: as its module is imported, before an importer binds it."""
    module, mtp = _import(*args, **kwargs), sys.modules.get(MTP)
    post = getattr(getattr(sys.modules.get(GPT), "GPTModel", None), "_postprocess", None)
    if not found and hasattr(mtp, "process_mtp_loss"):
        mtp.process_mtp_loss = _wrap(mtp.process_mtp_loss)
        found.append(mtp.process_mtp_loss)
    elif not found and post and {"ones_like", "MTPLossAutoScaler"} <= set(post.__code__.co_names):  # 0.16: inline
        sys.modules[GPT].GPTModel._postprocess = _wrap(post)
        found.append(post)
    if found and builtins.__import__ is _importing:
        builtins.__import__ = _import
    return module


if __name__ == "sitecustomize":
    builtins.__import__ = _importing
    atexit.register(_report)
    os._exit = lambda code: (_report(), _exit(code))  # multiprocessing's children and forked ranks skip atexit
    os.register_at_fork(after_in_child=seen.clear)  # a child counts its own calls
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != HERE]
    if hidden := importlib.machinery.PathFinder.find_spec("sitecustomize"):  # the one this file hides, if any
        sys.modules["sitecustomize"] = importlib.util.module_from_spec(hidden)
        hidden.loader.exec_module(sys.modules["sitecustomize"])
