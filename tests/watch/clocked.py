"""A loop of tests/watch/loops.py as its command line runs it (`python clocked.py LOOP --steps N`), under `watch`, in a
process whose clock moves a second at each reading: watch's judging of a call outweighs the job's time, whatever this
machine's speed."""

import itertools
import runpy
import sys
import time
import types
from pathlib import Path

import megatron.core.transformer.multi_token_prediction as mtp


watched = mtp.process_mtp_loss.__globals__  # watch's sitecustomize wraps core's MTP loss as core is imported
assert "CONFIG" in watched, "not run under mtp-mask-fix watch"
ticks = itertools.count()
watched["time"] = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)), monotonic=time.monotonic)
sys.argv[0] = str(Path(__file__).with_name("loops.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
