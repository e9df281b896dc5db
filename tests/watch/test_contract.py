"""What `mtp-mask-fix watch` says of each training loop of tests/watch/loops.py, judged here in this process: core's
real MTP loss on the tiny model, wrapped as watch's sitecustomize wraps it, and the verdict watch prints from the
process's report. Each right loop exits 0 with no finding; each wrong one exits 7 with the number of positions its MTP
loss trains that its loss masks, or skips that its loss trains. Those numbers come from the batches and from the
gradient autograd gives the loop's own loss here, never from watch's code."""

import json
import os
from pathlib import Path

import pytest
import torch

from mtp_mask_fix import watched
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.watch import verdict
from tests.watch import loops
from tinymodel import cpu_runtime


SHIFTED = {"labels shifted by 0": 0, "double-shifted labels": 2}  # loop: by how much its labels are shifted
COUNTS = "MTP loss calls trained {}, evaluated {}, not reached by a backward {}: {} whose loss sent no gradient"


def reported(folder: Path) -> dict:
    """This process's report as watch reads it, written now as at its end."""
    watched._report(final=True)
    return json.loads((folder / f"{os.getpid()}.json").read_text())


@pytest.fixture(scope="module")
def models():
    """The tiny model with one MTP layer and with two, their process group this session's while the module runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = loops.build_model(1)
        yield {1: one, 2: loops.gpt.build_model(2)}
    finally:
        cpu_runtime.shutdown_distributed()
        torch.set_num_threads(threads)


@pytest.fixture
def wrap(monkeypatch, tmp_path):
    """A function that wraps core's MTP loss as in a watched process (options as watch's --strict would set them),
    with this process's counts emptied and its report written to tmp_path."""
    import megatron.core.models.gpt.gpt_model as gpt_model
    import megatron.core.transformer.multi_token_prediction as mtp
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original, language_loss = mtp.process_mtp_loss, LanguageModule.compute_language_model_loss

    def wrapped(**config) -> None:
        function = watched._wrap(original)
        monkeypatch.setattr(gpt_model, "process_mtp_loss", function)  # bound by name, as core's importers bind it
        monkeypatch.setattr(mtp, "process_mtp_loss", function)
        monkeypatch.setattr(
            LanguageModule, "compute_language_model_loss", watched._keeping_the_gradient(language_loss)
        )
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.setattr(watched, "HERE", str(tmp_path))  # watch's folder
        monkeypatch.setattr(watched, "found", [function])
        monkeypatch.setattr(watched, "CONFIG", config)
        monkeypatch.setattr(watched, "_due", [float("inf")])  # no report but those this test asks for or expects
        watched.seen.clear()
        watched.pending.clear()
        watched.awaiting.clear()

    yield wrapped
    watched.seen.clear()


@pytest.fixture
def judged(models, wrap, tmp_path):
    """Run loops watched, one call each; then watch's lines and exit code."""

    def run(*names: str) -> tuple[str, int]:
        wrap()
        for name in names:
            loops.run_packed(models[1]) if name == "packed thd" else loops.run(models[loops.LOOPS[name].layers], name)
        return verdict("loop", 0, [reported(tmp_path)])

    return run


def trained_positions(model, loop: loops.Loop, batch: dict) -> torch.Tensor:
    """Where the loop's own loss sends the model's output a gradient, per position: autograd, unwatched."""
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    attention_mask = torch.ones(1, 1, tokens.shape[1], tokens.shape[1], dtype=torch.bool).triu(diagonal=1)
    model.train()
    with cpu_runtime.CudaAsCpu():
        out = model(tokens, position_ids, attention_mask, labels=batch["labels"], loss_mask=loop.mtp_mask(batch))
    (gradient,) = torch.autograd.grad(loop.loss(batch, out), out)
    return (gradient if gradient.dim() == 2 else gradient.abs().amax(-1)) != 0


def mismatch(model, name: str) -> tuple[int, int]:
    """(positions the MTP loss counts and the loss masks, positions the loss trains and the MTP loss skips) of a loop:
    its MTP targets are the labels from the second on; without labels core derives them from the inputs and rolls the
    mask with them (so the last position is none), and only skipped positions are judged."""
    loop = loops.LOOPS[name]
    batch = loop.batch()
    trained = trained_positions(model, loop, batch)
    mask = loop.mtp_mask(batch)
    counted = torch.ones_like(trained) if mask is None else mask != 0
    if batch["labels"] is None:
        counted = torch.cat([counted[:, 1:], torch.zeros_like(counted[:, :1])], 1)
        trained, counted = trained[:, 1:-1], counted[:, 1:-1]
        return 0, int((trained & ~counted).sum())
    return int((counted & ~trained)[:, 1:].sum()), int((trained & ~counted)[:, 1:].sum())


@pytest.mark.parametrize("name", [*loops.RIGHT, "packed thd"])
def test_a_right_loop_exits_0_with_no_finding(judged, name):
    text, code = judged(name)
    assert (code, text.count("\n")) == (Exit.OK, 0), text
    assert COUNTS.format(1, 0, 0, 0) in text
    assert "against the contract" not in text and "shift" not in text


@pytest.mark.parametrize("name", loops.WRONG)
def test_a_wrong_loop_exits_7_saying_which_positions(judged, models, name):
    trains, skips = mismatch(models[1], name)
    loop, text = loops.LOOPS[name], judged(name)
    assert (text[1], text[0].count("\n")) == (Exit.UNMASKED, 0), text[0]
    said = [f"the MTP loss trains {trains} positions the loss masks"] * bool(trains)
    said += [f"the MTP loss skips {skips} positions the loss trains"] * bool(skips)
    if loop.mtp_mask(loop.batch()) is None:
        said.insert(0, "1 without a loss_mask (core's MTP loss then counts every position)")
    if name in SHIFTED:
        said = [f"1 with labels the inputs shifted by {SHIFTED[name]}, not 1"]
    assert f": 1 trained against the contract: {'; '.join(said)}" in text[0]


@pytest.mark.parametrize("padding", [1, 2, 7, 8, 20])
@pytest.mark.parametrize("pad", [loops.EOS, loops.PAD], ids=["EOS pads", "its own pad"])
def test_an_all_ones_mask_over_any_padding_is_found(models, wrap, tmp_path, padding, pad):
    """Right padding of 1 position and up: each padded label is a position the loss masks and the MTP loss trains."""
    loop = loops.Loop(lambda: loops.sft(((24, 4), (24 - padding, 4)), pad=pad, loss="text"), mtp_mask=loops.ONES)
    wrap()
    loops.run(models[1], loop)
    text, code = verdict("loop", 0, [reported(tmp_path)])
    assert code == Exit.UNMASKED and f"the MTP loss trains {padding} positions the loss masks" in text, text


@pytest.mark.parametrize("name", loops.UNJUDGED)
def test_a_call_without_a_gradient_is_not_judged(judged, name):
    """Alone it leaves nothing judged (exit 5); after a right call it is counted as such, and the job exits 0."""
    alone, code = judged(name)
    assert code == Exit.FAILED and alone.endswith("; no call judged: none was trained with a gradient"), alone
    text, code = judged("sft", name)
    reached = name != "eval with grad"
    assert (code, text.count("\n")) == (Exit.OK, 0), text
    assert COUNTS.format(1 + reached, 0, int(not reached), int(reached)) in text, text
    assert "against the contract" not in text


def test_without_labels_a_zero_gradient_is_said_not_judged(judged):
    """A GRPO-style loss zeroes the gradient of clipped tokens and of rows whose advantage is 0, inside the mask."""
    text, code = judged("rl")
    assert code == Exit.OK and "1 without labels" in text, text
    assert " positions the MTP loss counts where a zero gradient need not be a mask (no labels, " in text


def test_strict_never_stops_a_right_loop(models, wrap, monkeypatch):
    wrap(strict=int(Exit.UNMASKED))
    monkeypatch.setattr(watched, "_exit", lambda code: pytest.fail(f"--strict stopped a right loop with {code}"))
    for name in loops.RIGHT:
        loops.run(models[loops.LOOPS[name].layers], name)
    loops.run_packed(models[1])
    assert watched.seen["trained"] == len(loops.RIGHT) + 1 and not watched.seen["against"]


def test_strict_stops_at_the_first_wrong_call(models, wrap, monkeypatch):
    class Stopped(Exception):
        pass

    wrap(strict=int(Exit.UNMASKED))
    monkeypatch.setattr(watched, "_exit", lambda code: (_ for _ in ()).throw(Stopped(code)))
    loops.run(models[1], "sft")
    with pytest.raises(Stopped, match=str(int(Exit.UNMASKED))):
        loops.run(models[1], "input-aligned mask")
    assert watched.seen["where"].endswith(" in run")  # loops.run calls the model


def _step(model, name: str) -> tuple[float, dict[str, torch.Tensor]]:
    loss = loops.run(model, name).item()
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["ones over padding", "double-shifted labels", "sft", "rl", "2 MTP layers"])
def test_watching_changes_no_loss_and_no_gradient(models, wrap, tmp_path, name):
    """Every check runs on these calls, and both of its backward hooks with them."""
    model = models[loops.LOOPS[name].layers]
    bare = _step(model, name)
    wrap()
    seen = _step(model, name)
    assert reported(tmp_path)["trained"] == 1
    assert seen[0] == bare[0] and bare[1].keys() == seen[1].keys() and bare[1]
    assert [name for name in bare[1] if not torch.equal(bare[1][name], seen[1][name])] == []


def test_a_process_reports_its_first_trained_call_and_each_new_finding(models, wrap, tmp_path):
    """What a SIGKILL after it cannot take away: a forward awaiting its backward is not an evaluation."""
    wrap()
    written = tmp_path / f"{os.getpid()}.json"
    batch = loops.sft()
    forward = loops.Loop(loops.sft, backward=False)
    loops.run(models[1], forward, batch)
    assert not written.exists()  # nothing judged yet
    first = loops.run(models[1], forward, batch)
    first.backward()
    report = json.loads(written.read_text())
    assert (report["calls"], report["trained"], report["evaluated"], report["against"]) == (2, 1, 0, 0)
    loops.run(models[1], "sft")
    assert json.loads(written.read_text())["trained"] == 1  # the same verdict: no report
    loops.run(models[1], "no mask")
    report = json.loads(written.read_text())
    assert (report["calls"], report["trained"], report["against"], report["no_mask"]) == (4, 3, 1, 1)
