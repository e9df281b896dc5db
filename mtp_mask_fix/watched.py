"""The sitecustomize of each Python process that `mtp-mask-fix watch` runs: it checks what megatron-core's MTP loss is
handed against what that loss assumes, reports to watch's folder as it goes and runs the sitecustomize it hides;
standard library only, inert."""

import atexit
import builtins
import collections
import contextlib
import functools
import importlib.machinery
import importlib.util
import json
import os
import signal
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
MTP, GPT = "megatron.core.transformer.multi_token_prediction", "megatron.core.models.gpt.gpt_model"
LOOKED_FOR = f"{MTP}.process_mtp_loss (megatron-core 0.17 on), or the inline one of {GPT}.GPTModel._postprocess (0.16)"
CONFIG = json.loads(os.environ.get("MTP_MASK_FIX_WATCH", "{}"))  # {"steps": N or null, "strict": its exit code or 0}
EVERY = 10.0  # seconds between a process's reports while it runs: what a SIGKILL can lose
SHIFTS = (1, 0, 2, 3)  # label[i] = input[i + shift]: the contract's first, so that it wins a tie
PADDING_RUN = 8  # a row's trailing run of one token at least this long is padding (a text rarely ends so)
COUNTS = ("calls", "trained", "no_mask", "no_labels", "ones", "masked", "positions", "against", "padding", "padded")
COUNTS += tuple(f"shift {k}" for k in SHIFTS[1:])
seen, found, _exit, _import, _due = collections.Counter(), [], os._exit, builtins.__import__, [0.0]


def _observe(c: dict) -> dict | None:
    """What an MTP loss call adds to the counts once a backward reaches it (device tensors, never read here).

    Args:
        c: the call's arguments by name ("self": 0.16's GPTModel._postprocess computes the loss inline).

    Returns:
        The call's counts, or None when it computes no MTP loss.
    """
    if "self" in c and not (c["self"].post_process and c["self"].config.mtp_num_layers is not None):
        return None  # not the stage with the output layer, or MTP off
    labels, inputs, mask = c.get("labels"), c.get("input_ids"), c.get("loss_mask")
    derived = labels is None and "self" not in c  # 0.19 on: core rolls input_ids into labels, and the mask with them
    aligned = inputs if derived else labels  # what the mask is aligned to, by core's rule
    seen["calls"] += 1
    if aligned is None:  # core computes no MTP loss
        return None
    if mask is not None and mask.numel() != aligned.numel():
        return {"no_labels": int(labels is None), "positions": aligned.numel()}  # a layout this file does not know
    torch = sys.modules["torch"]  # the job's own, imported by core
    counted = aligned.new_ones(aligned.shape, dtype=torch.bool) if mask is None else mask.reshape(aligned.shape) != 0
    call = {"no_mask": int(mask is None), "no_labels": int(labels is None), "positions": aligned.numel()}
    call.update(masked=(~counted).sum(), against=int(mask is None))
    if not derived and inputs is not None and inputs.shape == labels.shape:
        n = labels.shape[-1]
        hits = [((labels[..., : n - k] == inputs[..., k:]) & counted[..., : n - k]).sum() for k in SHIFTS]
        best = torch.stack(hits).argmax()  # the first of equals
        call.update(
            {f"shift {k}": best == i for i, k in enumerate(SHIFTS) if i}, against=call["against"] | (best != 0)
        )
    if mask is not None:  # padding: a row's trailing run after its first token (a text's own EOS, when EOS pads)
        rows = aligned.reshape(-1, aligned.shape[-1])
        run = (rows == rows[:, -1:]).flip(-1).cumprod(-1).flip(-1).bool()
        run &= run.sum(-1, keepdim=True) >= PADDING_RUN
        padded = (run[:, 1:] & run[:, :-1] & counted.reshape(rows.shape)[:, 1:]).sum()
        call.update(ones=counted.all(), padded=padded, padding=padded > 0, against=call["against"] | (padded > 0))
    return call


def _trained(call: dict, where: str | None, grad) -> None:
    """A backward reached the call's MTP loss: it trains, so its counts are judged (once, whatever the backwards)."""
    if call:
        seen.update(call, trained=1)
        if CONFIG.get("strict") and bool(call.get("against")):
            seen["where"] = where
            for stream in (sys.stdout, sys.stderr):  # os._exit flushes nothing
                with contextlib.suppress(Exception):
                    stream.flush()
            _report()
            _exit(CONFIG["strict"])
        call.clear()


def _caller() -> str:
    """The first frame outside core, torch and this file: where the forward step calls the model."""
    skip = (*(os.path.dirname(sys.modules[m].__file__) + os.sep for m in ("torch", "megatron.core")), __file__)
    frame = sys._getframe(1)
    while frame and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "?"


def _report():
    if found:  # the counts read off their devices: the one synchronisation, never at a call
        report = {key: int(seen[key]) for key in COUNTS}
        report.update(rank=os.environ.get("RANK"), pid=os.getpid(), where=seen.get("where"))
        path = os.path.join(HERE, str(os.getpid()))
        with contextlib.suppress(OSError):  # watch has ended, and its folder with it
            with open(path + ".tmp", "w") as out:
                json.dump(report, out)
            os.replace(path + ".tmp", path + ".json")
    _due[0] = time.monotonic() + EVERY


def _wrap(function):
    names = function.__code__.co_varnames[: function.__code__.co_argcount + function.__code__.co_kwonlyargcount]

    @functools.wraps(function)
    def watched(*args, **kwargs):
        call = None
        if seen["calls"] != CONFIG.get("steps"):  # --steps N: N calls counted, then no more
            call = _observe(dict(zip(names, args), **kwargs))
        out = function(*args, **kwargs)
        if call is not None and getattr(out, "requires_grad", False):  # a training call: only a backward tells
            out.register_hook(functools.partial(_trained, call, _caller() if CONFIG.get("strict") else None))
        if time.monotonic() > _due[0]:
            _report()
        return out

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


def _reported_then_default(signum, frame):
    """SIGTERM or SIGHUP where the job has no handler of its own: report, then end as that signal would."""
    _report()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


if __name__ == "sitecustomize":
    builtins.__import__ = _importing
    atexit.register(_report)
    os._exit = lambda code: (_report(), _exit(code))  # multiprocessing's children and forked ranks skip atexit
    os.register_at_fork(after_in_child=seen.clear)  # a child counts its own calls
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:  # a handler the job installs later replaces this one
            signal.signal(sig, _reported_then_default)
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != HERE]
    if hidden := importlib.machinery.PathFinder.find_spec("sitecustomize"):  # the one this file hides, if any
        sys.modules["sitecustomize"] = importlib.util.module_from_spec(hidden)
        hidden.loader.exec_module(sys.modules["sitecustomize"])
