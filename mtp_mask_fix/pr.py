"""pr: the PR title and body in upstream's PULL_REQUEST_TEMPLATE sections, filled from the patch, the
red/green manifest and figures that `repro` measured (never typed in)."""

import json
from collections import Counter
from pathlib import Path

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.patch import WORK, Patch
from mtp_mask_fix.redgreen import Manifest


def _test_summary(nodeids: list[str]) -> str:
    """One line per test function, with how many parametrisations it has."""
    counts = Counter(nodeid.split("[")[0] for nodeid in nodeids)
    return "\n".join(f"  - `{name}`" + (f" ({n} cases)" if n > 1 else "") for name, n in counts.items())


def _figures(path: Path | None) -> dict:
    if path is not None:
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ToolError(f"cannot read figures from {path}: {exc}") from exc
    from mtp_mask_fix.repro import run_repro

    return run_repro(WORK / "repro")


def _lm_loss_sentence(figures: dict) -> str:
    before, after = figures["before"]["lm_loss"], figures["after"]["lm_loss"]
    lm = "The LM loss is identical" if before == after else f"The LM loss moves ({before:.6f} -> {after:.6f})"
    return f"{lm}; the MTP loss counts {figures['after']['mtp_mass_on_masked']:.1%} of its mass at masked positions."


def render_pr(figures_path: Path | None = None) -> str:
    """Title, then the body as Markdown."""
    from mtp_mask_fix.repro import format_table

    patch, manifest = Patch.load(), Manifest.load()
    figures = _figures(figures_path)
    changed = [f.path for f in patch.files()]
    new_test = next(path for path in patch.new_files())
    updated_tests = [path for path in changed if path.startswith("tests/") and path != new_test]
    upstream_f2p = [nodeid.split("::")[-1] for nodeid in manifest.fail_to_pass["upstream"]]
    return f"""Title: {patch.subject}

# What does this PR do ?

Pass `loss_mask` to the model in `gpt_step._forward_step_common`, so MCore's Multi-Token Prediction loss \
masks padding and prompt tokens instead of falling back to an all-ones mask. Fixes #6103.

# Changelog

- `src/megatron/bridge/training/gpt_step.py`: `forward_args` gains `"loss_mask": loss_mask`, the same tensor \
Bridge's loss function gets (the `build_schedule_plan` branch already passed it). `forward_step`, \
`forward_step_modelopt` and `deepseek_v4_step.forward_step` all go through `_forward_step_common`.
- `{new_test}` (new): normal and schedule-plan paths, dense and packed batches, MTP on and off, \
first/middle pipeline stages, every entry point, unchanged LM loss.
- `{", ".join(updated_tests)}`: the exact-kwargs assertion in `{" / ".join(upstream_f2p)}` \
(name differs between v0.6.0 and main) now includes `loss_mask`.

No extra shift: `get_batch` returns the mask aligned with `labels`, which is what `process_mtp_loss` expects \
when labels are given; it rolls labels and mask together per MTP depth (per segment for THD). With MTP off \
and no output processor, `GPTModel` does not read the mask. `GPTModel.forward` takes `loss_mask` since \
MCore 0.12, `MambaModel`/`HybridModel` since 0.17, and `Float16Module`/DDP pass kwargs through. \
Bridge's `FalconH1Model.forward` has no `loss_mask`; no recipe trains it through `gpt_step`.

Effect on a tiny MCore `GPTModel` with MTP (CPU, gloo; answer-only SFT batch padded to the longest \
sample), before/after this change, measured by the reproduction script:

```
{format_table(figures)}
```

{_lm_loss_sentence(figures)} At random init answer tokens \
are no easier to predict than padding, so the tiny model's mtp_1 value may move either way; on a trained model \
padding is where the MTP head is worst: #6103 measured, on DeepSeek-V4 SFT, 96.5 % of the MTP loss mass on \
padding, and with the mask mtp_1 loss 15.8 -> 4.42 and step-1 grad norm 86 -> 67.5, LM loss unchanged.

# GitHub Actions CI

CPU-only unit tests: `pytest {new_test} {" ".join(updated_tests)}`.
Fail before this change (by assertion) and pass after it:
{_test_summary(manifest.fail_to_pass["unit"])}
  - `{upstream_f2p[-1]}`
Pass before and after: the other tests in both files, including
{_test_summary(manifest.pass_to_pass["unit"])}

# Before your PR is "Ready for review"

**Pre checks**:

- [x] Make sure you read and followed [Contributor guidelines](https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/CONTRIBUTING.md)
- [x] Did you write any new necessary tests?
- [ ] Did you add or update any necessary documentation? (no user-facing change)
- [ ] Does the PR affect components that are optional to install? (Ex: Numba, Pynini, Apex etc)
  - [ ] Reviewer: Does the PR have correct import guards for all optional libraries?

# Additional Information

- Related to #6103 (fixes it). #6105 proposes the same one-line change; this PR adds the wider tests.
"""
