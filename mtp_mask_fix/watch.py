"""`watch -- CMD`: CMD as it is, megatron-core's MTP loss watched in each of its Python processes (watched.py)."""

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.signals import SIGNALS, Interrupted, held, say
from mtp_mask_fix.watched import COUNTS, LOOKED_FOR, SHIFTS, UNJUDGED


UNBLOCK = functools.partial(signal.pthread_sigmask, signal.SIG_UNBLOCK, SIGNALS)  # in the job, as it starts
UNSEEN = "a process watch cannot see (python -I or -E, a cleaned environment, a Ray worker) may have run it"


def watch(command: list[str], *, steps: int | None, strict: bool) -> int:
    """Run CMD in a session of its own (watch passes a signal on once, a second ends it); print and return the verdict."""
    if steps is not None and steps < 1:
        raise ToolError(f"watch: --steps {steps}: not a number of calls (1 or more)")
    if not command or shutil.which(command[0]) is None:
        raise ToolError(f"watch: {command[0]}: command not found" if command else "watch: no command after --")
    with tempfile.TemporaryDirectory(prefix="mtp-mask-fix-watch-") as folder:
        (Path(folder) / "sitecustomize.py").symlink_to(Path(__file__).with_name("watched.py"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")])))
        env["MTP_MASK_FIX_WATCH"] = json.dumps({"steps": steps, "strict": Exit.UNMASKED if strict else 0})
        try:  # how the job ended: its code, and the signal that stopped it (None), one as it starts too
            with held():  # a signal is taken once `job` is bound, and so goes on to the job
                job = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=UNBLOCK)
            code, stopped = job.wait(), None
        except Interrupted as exc:
            if "job" not in locals():  # before the job started (a handler runs between any two bytecodes)
                raise
            code, stopped = _code_once_stopped(job, signal.Signals[exc.name]), exc
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # the job has ended: what it reported stands
        reports = [json.loads(p.read_text()) for p in Path(folder).glob("*.json")]
    text, code = verdict(command[0], code, reports, stopped, steps)
    say(text)
    return code


def _code_once_stopped(job: subprocess.Popen, sig: signal.Signals) -> int:
    """The job's exit code once sig has gone to its process group; a second signal to watch ends that group."""
    while True:
        try:
            with contextlib.suppress(ProcessLookupError):  # it may have ended already
                os.killpg(job.pid, sig)
            return job.wait()
        except Interrupted:
            sig = signal.SIGKILL


def verdict(name: str, code: int, reports: list, stopped: Interrupted | None = None, steps=None) -> tuple[str, Exit]:
    """The job's line and one per rank whose judged counts are unlike most ranks', from each process's last report,
    for `name` that exited with `code` (-n: signal n), maybe `stopped` by a signal passed on, counting each process's
    first `steps` calls; and watch's exit code (errors.Exit says what each means)."""
    total = {key: sum(r[key] for r in reports) for key in COUNTS}
    ranks = {}
    for r in reports:  # a rank's processes add up (its data loader's too); a process without a rank is its own
        ranks.setdefault(int(r["rank"]) if r["rank"] is not None else f"pid {r['pid']}", []).append(r)
    ranks = {who: {key: sum(r[key] for r in rs) for key in COUNTS} for who, rs in ranks.items()}
    ended = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"ended with exit code {code}"
    if not total["calls"]:
        if stopped:
            raise stopped
        if code:  # what the command did before it ended is all there is to say
            return f"mtp-mask-fix watch: {name}: no MTP loss call before {name} {ended}", _code(code)
        imported = f"imported in {len(ranks)} process(es), never called with MTP on" if ranks else "not seen imported"
        said = f"no MTP loss call: megatron-core's MTP loss {imported} (looked for {LOOKED_FOR}); {UNSEEN}"
        return f"mtp-mask-fix watch: {name}: {said}", Exit.FAILED
    shapes = {who: _judged_kinds(c) for who, c in ranks.items() if isinstance(who, int) and c["calls"]}
    usual = next((s for s in shapes.values() if 2 * list(shapes.values()).count(s) > len(shapes)), None)
    lines = [f"  rank {w}: {_counts(ranks[w])}{_against(ranks[w])}" for w in sorted(shapes) if shapes[w] != usual]
    ranked = [who for who in ranks if isinstance(who, int)]  # every rank, with the MTP loss (its last stage) or not
    run_in = f"{len(ranked)} rank(s)" if ranked else f"{sum(1 for c in ranks.values() if c['calls'])} process(es)"
    counted = f"; each process's first {steps} calls counted, --steps" if steps else ""
    head = f"mtp-mask-fix watch: {name}: {_counts(total)} (run in {run_in}{counted}){_against(total)}"
    unjudged = dict(zip(UNJUDGED, ("with no 0/1 mask found in the loss", "whose loss masks after a reduction")))
    unjudged["ambiguous"] = "whose MTP loss counts what one of the loss's masks keeps, not what all of them keep"
    if said := [f"{total[key]} call(s) {words}" for key, words in unjudged.items() if total[key]]:
        head += f"; not judged: {', '.join(said)}"
    nothing = total["trained"] == sum(total[key] for key in UNJUDGED)  # no call judged
    if stale := sum(not r["final"] for r in reports):
        head += f"; {stale} process(es) ended without a last report (SIGKILL, a crash): counted up to an earlier one"
    if strict := next((r["where"] for r in reports if r["where"]), None):
        head += f"; stopped (--strict) at {strict}"  # the job's code is then the stop's
    elif stopped:
        head += f"; stopped by {stopped.name}"
    elif code:
        head += f"; {name} {ended}"
    elif nothing:
        head += "; no call judged" + ("" if total["trained"] else ": none was trained")
    otherwise = stopped.code if stopped else _code(code) or (Exit.FAILED if nothing else Exit.OK)
    return "\n".join([head, *lines]), Exit.UNMASKED if total["against"] else otherwise


def _code(code: int) -> int:
    """watch's exit code for its command's: 128+n for signal n, 8 for any other failure (its own codes mean others)."""
    return Exit.INTERRUPTED - code if code < 0 else Exit.JOB_FAILED if code else Exit.OK


def _judged_kinds(c: dict) -> tuple:
    """What is judged of a rank's calls, not its data: the calls' counts, and which findings it has."""
    found = (c["counts"], c["leaves"], *(c[f"shift {k}"] for k in SHIFTS[1:]))
    return (*(c[key] for key in ("trained", "evaluated", "no_labels", "against", "no_mask")), *map(bool, found))


def _counts(c: dict) -> str:
    """How many MTP loss calls of a job (or a rank) trained, how many were evaluated, and what the trained ones had."""
    waiting = c["calls"] - c["evaluated"] - c["trained"]
    trained = f"MTP loss calls trained {c['trained']} ({c['no_labels']} without labels)"
    return f"{trained}, evaluated {c['evaluated']}, not reached by a backward {waiting}"


def _against(c: dict) -> str:
    """Which of the trained calls broke the contract of core's MTP loss, and how, with counts; or that none did."""
    said = [f"{c['no_mask']} without a loss_mask (core's MTP loss counts every position)"] if c["no_mask"] else []
    said += [f"the MTP loss counts {c['counts']} positions the loss's mask leaves out"] if c["counts"] else []
    said += [f"the MTP loss leaves out {c['leaves']} positions the loss's mask counts"] if c["leaves"] else []
    said += [f"{c[f'shift {k}']} with labels the inputs shifted by {k}, not 1" for k in SHIFTS[1:] if c[f"shift {k}"]]
    if c["against"]:
        return f": {c['against']} trained against the contract: {'; '.join(said)}"
    return ": no finding" if c["trained"] > sum(c[key] for key in UNJUDGED) else ""
