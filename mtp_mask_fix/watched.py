"""The sitecustomize of each Python process that `mtp-mask-fix watch` runs: it compares the positions megatron-core's
MTP loss counts with those the job's own loss trains (where the gradient that loss sends back is not zero), reports to
watch's folder as it goes and runs the sitecustomize it hides; standard library only, inert."""

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
LANGUAGE = "megatron.core.models.common.language_module.language_module"
LOOKED_FOR = f"{MTP}.process_mtp_loss (megatron-core 0.17 on), or the inline one of {GPT}.GPTModel._postprocess (0.16)"
CONFIG = json.loads(os.environ.get("MTP_MASK_FIX_WATCH", "{}"))  # {"steps": N or null, "strict": its exit code or 0}
EVERY = 10.0  # seconds between a process's reports while it runs, besides one whenever its verdict changes
SHIFTS = (1, 0, 2, 3)  # label[i] = input[i + shift]: the contract's first
NEARLY = 0.99  # labels are the inputs shifted by k when they are so on this share of the counted positions
JUDGED = ("no_gradient", "against", "no_mask", "trains", "skips", "unread", *(f"shift {k}" for k in SHIFTS[1:]))
COUNTS = ("calls", "evaluated", "trained", "no_labels", *JUDGED)
seen, found = collections.Counter(), []  # this process's counts; core's MTP loss, once wrapped
pending, awaiting = [], []  # judged calls' figures leaving their devices; the call whose LM loss comes next
_exit, _import, _due = os._exit, builtins.__import__, [0.0]


def _observe(c: dict) -> dict | None:
    """What an MTP loss call is handed, kept for its backward; on the stage with the output layer, with MTP on.

    Args:
        c: the call's arguments by name ("self": 0.16's GPTModel._postprocess computes the loss inline).

    Returns:
        The call's tensors and flags, or None when it computes no MTP loss.
    """
    if "self" in c and not (c["self"].post_process and c["self"].config.mtp_num_layers is not None):
        return None
    torch, labels, inputs, mask = sys.modules["torch"], c.get("labels"), c.get("input_ids"), c.get("loss_mask")
    derived = labels is None and "self" not in c  # 0.19 on: core rolls input_ids into labels, and the mask with them
    aligned = inputs if derived else labels
    if aligned is None:
        return None
    seen["calls"] += 1
    call = {"derived": derived, "no_mask": mask is None, "no_labels": labels is None, "shape": aligned.shape}
    if mask is None or mask.numel() == aligned.numel():  # else a layout this file does not read
        call["counted"] = (
            aligned.new_ones(aligned.shape, dtype=bool) if mask is None else mask.view(aligned.shape) != 0
        )
    cu, positions = getattr(c.get("packed_seq_params"), "cu_seqlens_q", None), torch.arange(aligned.shape[-1])
    positions = positions.to(aligned.device)  # each position's sequence: packed rows (THD) hold several
    call["sequence"] = positions * 0 if cu is None else torch.bucketize(positions, cu[1:].to(positions), right=True)
    if not derived and inputs is not None and inputs.shape == labels.shape:
        call.update(labels=labels, inputs=inputs)
    awaiting[:] = [labels, call] if labels is not None else []  # its forward's LM loss of these labels follows
    return call


def _keeping_the_gradient(function):
    """LanguageModule.compute_language_model_loss, which gives the LM loss of the labels an MTP loss call just had
    the hook that keeps its gradient per position, unreduced."""

    @functools.wraps(function)
    def compute_language_model_loss(self, labels, *args, **kwargs):
        loss = function(self, labels, *args, **kwargs)
        if awaiting and awaiting[0] is labels and getattr(loss, "requires_grad", False):
            call = awaiting.pop()
            call["losses"] = loss.detach().clone()
            loss.register_hook(functools.partial(call.__setitem__, "gradient"))
            awaiting.clear()
        return loss

    return compute_language_model_loss


def _judged(call: dict, gradient) -> dict:
    """A trained call's figures as device tensors: where its MTP loss counts against where the job's loss trains.

    Args:
        call: what _observe kept.
        gradient: what the job's loss sent back, per position ([b, s]) or per hidden state ([s, b, h]).

    Returns:
        The figures of JUDGED.
    """
    torch, shape = sys.modules["torch"], call["shape"]
    per_token = gradient.dim() == 2  # the LM loss's own: a mask weighs every position it keeps in a row alike there
    size = gradient.abs() if per_token else gradient.abs().amax(-1).transpose(0, 1)
    sent = size.any()
    if "counted" not in call or size.numel() != shape.numel():  # a layout this file does not read
        zero = torch.zeros((), dtype=torch.long, device=gradient.device)
        return dict(dict.fromkeys(JUDGED, zero), no_gradient=~sent, unread=zero + shape.numel())
    size, counted, sequence = size.reshape(shape), call["counted"], call["sequence"]
    trained = size != 0
    # An MTP target: a label from its sequence's second on (with derived labels, up to its last but one).
    target = torch.zeros_like(counted)
    target[..., 1:] = sequence[1:] == sequence[:-1]
    if call["derived"]:
        counted, target = counted.roll(-1, -1), target.roll(-1, -1) & target
        target[..., -1] = False
    kept = size.masked_fill(~trained, float("inf")).amin(-1, keepdim=True)
    read = (kept == size.amax(-1, keepdim=True)) & per_token  # a row's zeros are its mask's (not where it sent none)
    over, under = counted & ~trained & target, trained & ~counted & target
    if "losses" in call:  # nor where all lie above or all below those it trains: a loss may drop them by their value
        value, inf = call["losses"].reshape(shape).float(), float("inf")
        above = value.masked_fill(~over, inf).amin() > value.masked_fill(~trained, -inf).amax()
        below = value.masked_fill(~over, -inf).amax() < value.masked_fill(~trained, inf).amin()
        read = read & ~(above | below)
    figures = {"no_gradient": ~sent, "no_mask": sent & call["no_mask"], "trains": (over & read).sum()}
    figures.update(skips=under.sum(), unread=(over & ~read).sum() * sent)
    shifted = torch.zeros(len(SHIFTS) - 1, dtype=torch.bool, device=counted.device)
    if "labels" in call and shape[-1] > 3:
        n = shape[-1] - 3  # every shift scored on the same positions, each within one sequence
        window = counted[..., :n] & (sequence[:n] == sequence[3:])
        labels, inputs = call["labels"][..., :n], call["inputs"]
        hits = torch.stack([((labels == inputs[..., k : n + k]) & window).sum() for k in SHIFTS])
        best = hits[1:].argmax()
        wins = (hits[1:][best] > hits[0]) & (hits[1:][best] >= NEARLY * window.sum())
        shifted = torch.nn.functional.one_hot(best, len(SHIFTS) - 1).bool() & wins & sent
    figures.update({f"shift {k}": shifted[i] for i, k in enumerate(SHIFTS[1:])})
    figures["against"] = sent & (figures["no_mask"] | (figures["trains"] > 0) | (figures["skips"] > 0) | shifted.any())
    return figures


def _trained(call: dict, where: str | None, gradient) -> None:
    """A backward reached the call's MTP loss: it trains, so it is judged (once, whatever the backwards)."""
    if "shape" in call:
        figures = _judged(call, call.get("gradient", gradient))
        torch = sys.modules["torch"]
        values = torch.stack([figures[key].long() for key in JUDGED]).to("cpu", non_blocking=True)
        event = torch.cuda.Event() if gradient.is_cuda else None
        if event:
            event.record()
        pending.append((values, event, call["no_labels"]))
        call.clear()
        strict = bool(CONFIG.get("strict"))
        if _settle(block=strict or not seen["trained"]):  # the first trained call's verdict, synchronised once
            _report()
        if strict and seen["against"]:
            seen["where"] = where
            for stream in (sys.stdout, sys.stderr):  # os._exit flushes nothing
                with contextlib.suppress(Exception):
                    stream.flush()
            _report(final=True)
            _exit(CONFIG["strict"])


def _settle(block: bool = False) -> bool:
    """Count the judged calls whose figures have left their device (all of them when block).

    Returns:
        Whether the process's verdict changed: a first trained call, or a first finding of a kind.
    """
    before = tuple(bool(seen[key]) for key in ("trained", *JUDGED))
    while pending and (block or pending[0][1] is None or pending[0][1].query()):
        values, _, no_labels = pending.pop(0)
        seen.update(dict(zip(JUDGED, values.tolist())), trained=1, no_labels=int(no_labels))
    return before != tuple(bool(seen[key]) for key in ("trained", *JUDGED))


def _caller() -> str:
    """The first frame outside core, torch and this file: where the forward step calls the model."""
    skip = (*(os.path.dirname(sys.modules[m].__file__) + os.sep for m in ("torch", "megatron.core")), __file__)
    frame = sys._getframe(1)
    while frame and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else "?"


def _report(final: bool = False):
    """Write what this process has counted for watch to read (`final`: its last word, at its end)."""
    if found:
        _settle(block=True)  # the counts read off their devices: the one synchronisation, never at a call
        report = {key: int(seen[key]) for key in COUNTS}
        report.update(rank=os.environ.get("RANK"), pid=os.getpid(), where=seen.get("where"), final=final)
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
        elif call is not None:
            seen["evaluated"] += 1
        if _settle() or time.monotonic() > _due[0]:
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
    language = getattr(sys.modules.get(LANGUAGE), "LanguageModule", None)
    if found and language is not None:  # GPTModel's and HybridModel's LM loss, where they compute it
        if hasattr(language, "compute_language_model_loss"):
            language.compute_language_model_loss = _keeping_the_gradient(language.compute_language_model_loss)
        builtins.__import__ = _import
    return module


def _reported_then_default(signum, frame):
    """SIGTERM or SIGHUP where the job has no handler of its own: report, then end as that signal would."""
    _report(final=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _forked():
    seen.clear()  # a child counts its own calls
    pending.clear()
    awaiting.clear()


if __name__ == "sitecustomize":
    builtins.__import__ = _importing
    atexit.register(_report, final=True)
    # multiprocessing's children and forked ranks skip atexit
    os._exit = lambda code: (_report(final=True), _exit(code))
    os.register_at_fork(after_in_child=_forked)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:  # a handler the job installs later replaces this one
            signal.signal(sig, _reported_then_default)
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != HERE]
    if hidden := importlib.machinery.PathFinder.find_spec("sitecustomize"):  # the one this file hides, if any
        sys.modules["sitecustomize"] = importlib.util.module_from_spec(hidden)
        hidden.loader.exec_module(sys.modules["sitecustomize"])
