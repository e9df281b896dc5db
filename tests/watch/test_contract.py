"""What `mtp-mask-fix watch` says of each training loop of tests/watch/loops.py, judged here in this process: core's
real MTP loss on the tiny model, wrapped as watch's sitecustomize wraps it, and the verdict watch prints from the
process's report. A wrong loop of each class exits 7 with its own words and counts; each right loop exits 0 with no
finding. The counts expected come from the batches' spans, not from the code under test."""

import json
import os
from pathlib import Path

import pytest
import torch

from mtp_mask_fix import watched
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.watch import verdict
from tests.watch import loops
from tinymodel import cpu_runtime, gpt


def _padding_after_eos() -> list[int]:
    """Per SFT row, how many label positions follow its text's EOS (padding), from the samples alone."""
    seq = max(prompt + answer for prompt, answer in gpt.SFT_SAMPLES) - 1
    return [seq - (prompt + answer - 1) for prompt, answer in gpt.SFT_SAMPLES]


AGAINST = "1 trained against the contract: "
WRONG = {  # loop: what the job's line says of it
    "double-shifted labels": AGAINST + "1 with labels the inputs shifted by 2, not 1",
    "input-aligned mask": AGAINST + f"1 with a mask that counts padding ({sum(map(bool, _padding_after_eos()))} ",
    "ones over padding": AGAINST + f"1 with a mask that counts padding ({sum(_padding_after_eos())} positions)",
    "no mask": AGAINST + "1 without a loss_mask (core's MTP loss then counts every position)",
    "eval-mode training": AGAINST + "1 without a loss_mask",
}
RIGHT = {  # loop: its calls (trained, evaluated)
    "pretraining": (1, 0),
    "sft": (1, 0),
    "rl": (1, 0),
    "packed": (1, 0),
    "eval with grad": (0, 1),
}


def reported(folder: Path) -> dict:
    """This process's report, written where watch reads it."""
    watched._report()
    return json.loads((folder / f"{os.getpid()}.json").read_text())


@pytest.fixture(scope="module")
def model():
    """The one-MTP-layer tiny model, its process group this session's while the module runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield loops.build_model()
    finally:
        cpu_runtime.shutdown_distributed()
        torch.set_num_threads(threads)


@pytest.fixture
def wrap(monkeypatch, tmp_path):
    """A function that wraps core's MTP loss as in a watched process, with this process's counts emptied and its
    report written to tmp_path."""
    import megatron.core.models.gpt.gpt_model as gpt_model
    import megatron.core.transformer.multi_token_prediction as mtp

    def wrapped() -> None:
        function = watched._wrap(mtp.process_mtp_loss)
        monkeypatch.setattr(gpt_model, "process_mtp_loss", function)  # bound by name, as core's importers bind it
        monkeypatch.setattr(mtp, "process_mtp_loss", function)
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.setattr(watched, "HERE", str(tmp_path))  # watch's folder
        monkeypatch.setattr(watched, "found", [function])
        monkeypatch.setattr(
            watched, "_due", [0.0], raising=False
        )  # a report due at the first call, as in a new process
        watched.seen.clear()

    yield wrapped
    watched.seen.clear()


@pytest.fixture
def judged(model, wrap, tmp_path):
    """Run a loop watched; then watch's lines and exit code."""
    wrap()

    def run(loop: str) -> tuple[str, int]:
        loops.run_packed(model) if loop == "packed" else loops.run(model, loop)
        return verdict("loop", 0, [reported(tmp_path)])

    return run


@pytest.mark.parametrize("loop", WRONG)
def test_a_wrong_loop_exits_7_saying_how(judged, loop):
    text, code = judged(loop)
    assert (code, text.count("\n")) == (Exit.UNMASKED, 0), text
    assert WRONG[loop] in text


@pytest.mark.parametrize("loop", RIGHT)
def test_a_right_loop_exits_0_with_no_finding(judged, loop):
    text, code = judged(loop)
    trained, evaluated = RIGHT[loop]
    assert (code, text.count("\n")) == (Exit.OK, 0), text
    assert f"MTP loss calls trained {trained}, evaluated {evaluated}: 0 without loss_mask" in text
    assert "against the contract" not in text and "shift" not in text and "padding" not in text


def _step(model, loop: str) -> tuple[float, dict[str, torch.Tensor]]:
    loss = loops.run(model, loop).item()
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loop", ["ones over padding", "double-shifted labels", "sft", "rl"])
def test_watching_changes_no_loss_and_no_gradient(model, wrap, tmp_path, loop):
    """Every check runs on these calls, and the backward hook with them."""
    bare = _step(model, loop)
    wrap()
    seen = _step(model, loop)
    assert reported(tmp_path).get("trained") == 1
    assert seen[0] == bare[0] and bare[1].keys() == seen[1].keys() and bare[1]
    assert [name for name in bare[1] if not torch.equal(bare[1][name], seen[1][name])] == []


def test_a_process_reports_while_it_runs(model, wrap, tmp_path, monkeypatch):
    """Every so many seconds, at a call (here at each one): what a SIGKILL later cannot take away."""
    wrap()
    monkeypatch.setattr(watched, "EVERY", 0.0, raising=False)
    for _ in range(2):
        loops.run(model, "sft")
    written = tmp_path / f"{os.getpid()}.json"
    assert written.exists()
    report = json.loads(written.read_text())
    assert (report["calls"], report.get("trained")) == (2, 1)  # the second call reports before its backward
