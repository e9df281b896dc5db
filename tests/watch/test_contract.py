"""What `mtp-mask-fix watch` says of each training loop of tests/watch/loops.py, judged here in this process: core's
real MTP loss on the tiny model, wrapped as watch's sitecustomize wraps it, and the verdict watch prints from the
process's report. Each right loop exits 0 with no finding, whatever its loss selects by value (clipping, ratio bands,
excess-loss selection, truncation, zero advantages, weights); each wrong one exits 7 at its first call, whatever the
model has learned, with the number of positions its MTP loss counts that its loss's mask leaves out, or leaves out
that the mask counts. Those numbers come from the batches (the mask each loop's loss applies), never from watch's
code."""

import copy
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from mtp_mask_fix import watched
from mtp_mask_fix.errors import Exit
from mtp_mask_fix.watch import verdict
from tests.watch import loops
from tinymodel import cpu_runtime


ONE_OF_THEM = "whose MTP loss counts what one of the loss's masks keeps, not what all of them keep"
UNJUDGED = {  # a loop that is not judged: why (None: the loss applies no 0/1 mask)
    None: "with no 0/1 mask found in the loss",
    "a row mask after a reduction": "whose loss masks after a reduction",
    "a row mask after a reduction, alone": "whose loss masks after a reduction",
    "reinforce, rewards of 0 and 1 as advantages": ONE_OF_THEM,
    "verl's label mask, one past the response, handed to the model": ONE_OF_THEM,
}
SHIFTED = {"labels shifted by 0": 0, "double-shifted labels": 2}  # loop: by how much its labels are shifted
COUNTS = "MTP loss calls trained {} ({} without labels), evaluated {}, not reached by a backward {}"


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

    original, call_model = mtp.process_mtp_loss, LanguageModule.__call__

    def wrapped(**config) -> None:
        function = watched._wrap(original)
        monkeypatch.setattr(gpt_model, "process_mtp_loss", function)  # bound by name, as core's importers bind it
        monkeypatch.setattr(mtp, "process_mtp_loss", function)
        monkeypatch.setattr(LanguageModule, "__call__", watched._returning_followed(call_model), raising=False)
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.setattr(watched, "HERE", str(tmp_path))  # watch's folder
        monkeypatch.setattr(watched, "found", [function])
        monkeypatch.setattr(watched, "CONFIG", config)
        monkeypatch.setattr(watched, "_due", [float("inf")])  # no report but those this test asks for or expects
        watched.seen.clear()
        watched.pending.clear()

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


def expected(name: str) -> tuple[int, int]:
    """(positions the MTP loss counts and the loss's mask leaves out, positions the mask counts and the MTP loss leaves
    out) of a loop, from its batch: its loss applies the batch's mask, label-aligned (each label from the second is an
    MTP target), and its label mask if it has one, the closer of them taken; without labels the loss scores token
    t + 1 at t and core rolls the mask it is handed by one, so the targets are from the second to the last but one."""
    loop = loops.LOOPS[name]
    batch = loop.batch()
    handed = loop.mtp_mask(batch)
    counted = torch.ones_like(batch["mask"], dtype=torch.bool) if handed is None else handed != 0
    datas = [batch[key] != 0 for key in ("mask", "label_mask") if key in batch]
    if batch["labels"] is None:
        datas, counted = (
            [torch.cat([m[:, 1:], torch.zeros_like(m[:, :1])], 1)[:, :-1] for m in ms] for ms in (datas, [counted])
        )
        counted = counted[0]
    return min(((int((counted & ~data)[:, 1:].sum()), int((data & ~counted)[:, 1:].sum())) for data in datas), key=sum)


def findings(counts: int, leaves: int, no_mask: bool = False) -> str:
    """watch's words for one call against its contract."""
    said = ["1 without a loss_mask (core's MTP loss counts every position)"] * no_mask
    said += [f"the MTP loss counts {counts} positions the loss's mask leaves out"] * bool(counts)
    said += [f"the MTP loss leaves out {leaves} positions the loss's mask counts"] * bool(leaves)
    return f": 1 trained against the contract: {'; '.join(said)}"


@pytest.mark.parametrize("name", [*loops.RIGHT, "packed thd"])
def test_a_right_loop_exits_0_with_no_finding(judged, name):
    text, code = judged(name)
    assert (code, text.count("\n")) == (Exit.OK, 0), text
    assert COUNTS.format(1, int(name != "packed thd" and loops.LOOPS[name].batch()["labels"] is None), 0, 0) in text
    assert text.endswith(": no finding"), text


@pytest.mark.parametrize("name", loops.WRONG)
def test_a_wrong_loop_exits_7_at_its_first_call_saying_which_positions(judged, name):
    loop, (text, code) = loops.LOOPS[name], judged(name)
    assert (code, text.count("\n")) == (Exit.UNMASKED, 0), text
    if name in SHIFTED:
        assert f": 1 trained against the contract: 1 with labels the inputs shifted by {SHIFTED[name]}, not 1" in text
    else:
        assert findings(*expected(name), no_mask=loop.mtp_mask(loop.batch()) is None) in text, text


@pytest.mark.parametrize("padding", [1, 2, 7, 8, 20])
@pytest.mark.parametrize("pad", [loops.EOS, loops.PAD], ids=["EOS pads", "its own pad"])
def test_an_all_ones_mask_over_any_padding_is_found(models, wrap, tmp_path, padding, pad):
    """Right padding of 1 position and up: each padded label is a position the loss's mask leaves out."""
    loop = loops.Loop(lambda: loops.sft(((24, 4), (24 - padding, 4)), pad=pad, loss="text"), mtp_mask=loops.ONES)
    wrap()
    loops.run(models[1], loop)
    text, code = verdict("loop", 0, [reported(tmp_path)])
    assert code == Exit.UNMASKED and findings(padding, 0) in text, text


def test_an_all_ones_mask_over_packed_rows_is_found(models, wrap, tmp_path):
    """THD, handed ones: core's MTP loss counts each label that follows one of its own sequence, so the positions
    found are those of them the loss's mask leaves out (the pad tail's but its first, each text's last label)."""
    wrap()
    batch = loops.run_packed(models[1], mtp_mask=torch.ones_like)
    sequence = torch.bucketize(torch.arange(batch["mask"].shape[1]), batch["cu"][1:], right=True)
    targets = sequence[1:] == sequence[:-1]
    text, code = verdict("loop", 0, [reported(tmp_path)])
    assert code == Exit.UNMASKED and findings(int((targets & (batch["mask"][0, 1:] == 0)).sum()), 0) in text, text


@pytest.mark.parametrize("name", loops.UNJUDGED)
def test_a_call_no_backward_reaches_or_whose_loss_applies_no_mask_is_not_judged(judged, name):
    """Alone it leaves nothing judged (exit 5); after a right call it is counted as such, and the job exits 0."""
    alone, code = judged(name)
    assert code == Exit.FAILED and alone.endswith(
        "; no call judged" + ": none was trained" * (name == "eval with grad")
    ), alone
    reached = name != "eval with grad"
    assert (f"; not judged: 1 call(s) {UNJUDGED.get(name, UNJUDGED[None])};" in alone) == reached, alone
    text, code = judged("sft", name)
    assert (code, text.count("\n")) == (Exit.OK, 0), text
    labelless = int(reached and loops.LOOPS[name].batch()["labels"] is None)
    assert COUNTS.format(1 + reached, labelless, 0, int(not reached)) in text and ": no finding" in text, text


def test_the_mtp_loss_trains_whatever_gradient_the_loss_sends(models):
    """Why a call whose loss is scaled to 0 (a skipped micro-batch) is judged: core's MTP loss gets its gradient from
    MTPLossAutoScaler's own scale, not from the loss's, so its layer trains all the same."""
    loops.run(models[1], "a zero loss scale, no mask")
    grads = [p.grad for name, p in models[1].named_parameters() if name.startswith("mtp.")]
    assert grads and all(g is not None for g in grads) and any(bool(g.abs().sum()) for g in grads)


def learned(model, batch: dict):
    """A copy of the model trained on what the batch's mask leaves out (an earlier stage that learned the prompt and
    the padding): their LM loss ends below every position the mask keeps, a case a verdict read off loss values would
    not judge."""
    learned = loops.gpt.build_model(1)
    learned.load_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(learned.parameters(), lr=3e-3)
    stage = loops.Loop(lambda: batch, loss=lambda b, out: loops.masked_mean(out, 1 - b["mask"]))
    for _ in range(60):
        loops.run(learned, stage)
        optimizer.step()
    return learned


@pytest.mark.parametrize("name", ["ones over the prompt", "ones over padding", "no mask"])
def test_a_wrong_loop_from_a_trained_checkpoint_exits_7_at_its_first_call(models, wrap, tmp_path, name):
    loop = loops.LOOPS[name]
    batch = loop.batch()
    model = learned(models[1], batch)
    with torch.no_grad():
        losses = loops.run(model, loops.Loop(loop.batch, loss=lambda b, out: out.detach(), backward=False), batch)
    masked, kept = (losses[:, 1:][(batch["mask"][:, 1:] != 0) == keep] for keep in (False, True))
    assert masked.max() < kept.min()  # the masked positions' loss lies below every kept one's
    wrap()
    loops.run(model, name)
    text, code = verdict("loop", 0, [reported(tmp_path)])
    assert code == Exit.UNMASKED and findings(*expected(name), no_mask=name == "no mask") in text, text


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


def _step(model, name: str) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """One call of the loop: what the model returned to it, its loss and the gradients."""
    returned, loop = [], loops.LOOPS[name]
    keeping = loops.Loop(loop.batch, loop.mtp_mask, lambda b, out: loop.loss(b, returned.append(out) or out))
    loss = loops.run(model, keeping).item()
    return returned[0], loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


WATCHED = ["ones over padding", "double-shifted labels", "sft", "rl", "2 MTP layers", "ppo, one unclipped token a row"]


@pytest.mark.parametrize("name", [*WATCHED, "per-token loss weights", "the mask a boolean index"])
def test_watching_changes_no_loss_no_gradient_and_nothing_the_job_receives(models, wrap, tmp_path, name):
    """Every check runs on these calls, and their backward hooks with them; the job gets a torch.Tensor of the same
    values and shape, which pickles and copies as the plain tensor."""
    model = models[loops.LOOPS[name].layers]
    bare = _step(model, name)
    wrap()
    seen = _step(model, name)
    assert reported(tmp_path)["trained"] == 1
    assert isinstance(seen[0], torch.Tensor) and seen[0].shape == bare[0].shape and torch.equal(seen[0], bare[0])
    for copied in (pickle.loads(pickle.dumps(seen[0].detach())), copy.deepcopy(seen[0].detach())):
        assert type(copied) is torch.Tensor and torch.equal(copied, bare[0])  # torch.save, a queue to a process
    assert seen[1] == bare[1] and bare[2].keys() == seen[2].keys() and bare[2]
    assert [name for name in bare[2] if not torch.equal(bare[2][name], seen[2][name])] == []


def test_an_error_in_the_jobs_loss_is_the_jobs(models, wrap):
    """An operation the job gets wrong fails as it would without watch, and watch's own bookkeeping never raises."""
    wrap()
    shapes = loops.Loop(loops.sft, loss=lambda batch, out: (out * batch["mask"][:, :-1]).sum())
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        loops.run(models[1], shapes)


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


def test_a_report_waits_for_tallies_still_on_their_way_off_the_device(wrap, tmp_path, monkeypatch):
    """A report reads a call's tallies once their copy off the device has landed (on CUDA: the copy's event)."""
    wrap()
    landing = torch.zeros(9, dtype=torch.long)  # one call, one mask: it counts 5 positions the mask leaves out

    class Copy:
        """A CUDA event whose copy lands once it is waited for."""

        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            landing.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 5, 0, 1]))

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: Copy().synchronize())  # the device's work too
    watched.pending.append((landing, Copy(), False, False))
    report = reported(tmp_path)
    assert (report["trained"], report["against"], report["counts"]) == (1, 1, 5)


def test_a_device_in_error_at_the_end_leaves_the_last_report_and_raises_nothing(wrap, tmp_path):
    """A job that ends with its device in error (a CUDA error stays): its last report is written with the calls counted
    so far, and watch adds no traceback of its own to the job's."""
    wrap()

    class Failed:
        """A CUDA event on a device in error: torch raises on every use of it."""

        def query(self) -> bool:
            raise RuntimeError("CUDA error: device-side assert triggered")

        synchronize = query

    watched.seen.update(calls=2, trained=1)
    watched.pending.append((torch.zeros(9, dtype=torch.long), Failed(), False, False))
    try:
        report = reported(tmp_path)
    except RuntimeError as error:
        pytest.fail(f"the report raised {error!r}")
    assert (report["final"], report["calls"], report["trained"]) == (True, 2, 1)
