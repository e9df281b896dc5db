"""`watch -- CMD`: CMD as it is, megatron-core's MTP loss watched in each of its Python processes (watched.py)."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.signals import Interrupted, held
from mtp_mask_fix.watched import COUNTS, LOOKED_FOR


def watch(args) -> tuple[str, Exit]:
    """CMD leads a process group of its own (a signal to watch goes to all of it, once); then what it reported."""
    command, steps = args.cmd, args.steps
    if steps is not None and steps < 1:
        raise ToolError(f"watch: --steps {steps}: not a number of calls (1 or more)")
    if not command or shutil.which(command[0]) is None:
        raise ToolError(f"watch: {command[0]}: command not found" if command else "watch: no command after --")
    with tempfile.TemporaryDirectory(prefix="mtp-mask-fix-watch-") as folder:
        (Path(folder) / "sitecustomize.py").symlink_to(Path(__file__).with_name("watched.py"))
        config = {"PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))}
        config["MTP_MASK_FIX_WATCH"] = json.dumps({"steps": steps, "strict": Exit.UNMASKED * args.strict})
        job = subprocess.Popen(command, env=dict(os.environ, **config), start_new_session=True)
        try:
            code = job.wait()
        except Interrupted as exc:
            with held(), contextlib.suppress(ProcessLookupError):  # it may have ended already
                os.killpg(job.pid, signal.Signals[exc.name])
                job.wait()
            raise
        return verdict(command[0], code, [json.loads(p.read_text()) for p in Path(folder).glob("*.json")])


def verdict(name: str, code: int, reports: list[dict]) -> tuple[str, Exit]:
    """The job's line (every process that has the MTP loss), one per rank unlike most ranks, and the exit code."""
    total, ranks = {key: sum(r[key] for r in reports) for key in COUNTS}, {}
    for r in (r for r in reports if r["rank"] is not None):  # a rank's processes add up (its data loader's too)
        ranks[int(r["rank"])] = tuple(a + r[k] for a, k in zip(ranks.get(int(r["rank"]), (0,) * len(COUNTS)), COUNTS))
    shapes = list(ranks.values())
    usual = next((shape for shape in shapes if 2 * shapes.count(shape) > len(shapes)), None)  # that of most ranks
    lines = [f"  rank {rank}: {_counts(dict(zip(COUNTS, c)))}" for rank, c in sorted(ranks.items()) if c != usual]
    if code and not total["unmasked"]:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"ended with exit code {code}"
        raise ToolError(f"watch: {name} {how}", 128 - code if code < 0 else code)
    if not total["calls"]:  # each process that has it reports
        said = f"megatron-core's MTP loss found in {len(reports)} process(es), run in none (looked for {LOOKED_FOR})"
        raise ToolError(f"watch: {name}: {said}", Exit.FAILED)
    head = f"mtp-mask-fix watch: {name}: {_counts(total)} (in {len(reports)} process(es) holding it)"
    if total["unmasked"]:
        head += f": {total['unmasked']} trained without a loss_mask (core's MTP loss then counts every position)"
        head += next((f"; stopped (--strict) at {r['where']}" for r in reports if r["where"]), "")
    return "\n".join([head, *lines]), Exit.UNMASKED if total["unmasked"] else Exit.OK


def _counts(r: dict) -> str:
    masked = f"{r['ones']} with an all-ones mask; {r['masked'] / (r['positions'] or 1):.1%} of positions masked"
    return f"MTP loss calls {r['calls']}: {r['no_mask']} without loss_mask, {r['no_labels']} without labels, {masked}"
