"""pr: the upstream route, written from the patch and from figures measured here (never typed in).

(a) A review comment for PR #6105, which proposes the same line first: the finding, the fix and the test
additions as GitHub suggestion blocks on #6105's files, and the reproduction in three lines.
(b) A PR body (at most 25 lines, upstream's template sections) for when #6105 stalls: it supersedes #6105 and
credits its author.
"""

import ast
import json
from pathlib import Path

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.gate import SUMMARY
from mtp_mask_fix.patch import FIXED_FILE, WORK, Patch
from mtp_mask_fix.targets import pins, release


PR_6105_AUTHOR = "linmuchuiyang"  # author of #6103 and #6105 (GitHub)
FENCE = "`" * 3
FALCON_H1 = "megatron/bridge/models/falcon_h1/modeling_falconh1/falconh1_model.py"


def _figures(path: Path | None) -> dict:
    if path is None:
        from mtp_mask_fix.harness.repro import run_repro

        return run_repro(WORK / "repro")
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot read figures from {path}: {exc}") from exc


def _falcon_h1_signature() -> str:
    """FalconH1Model.forward's parameters, read from the pinned release (a model without `loss_mask`)."""
    source = release(pins()["megatron-bridge"]).root / FALCON_H1
    forward = next(
        n for n in ast.walk(ast.parse(source.read_text())) if isinstance(n, ast.FunctionDef) and n.name == "forward"
    )
    names = [a.arg for a in forward.args.args + forward.args.kwonlyargs if a.arg != "self"]
    if "loss_mask" in names or forward.args.kwarg:
        raise ToolError(f"{source}: FalconH1Model.forward now takes loss_mask; revisit the review comment")
    return f"FalconH1Model.forward({', '.join(names)})"


def _runs_of_added_lines(hunk) -> list[list]:
    """The hunk's lines, with each run of consecutive added lines grouped into one list."""
    groups = []
    for line in hunk:
        if line.is_added and groups and isinstance(groups[-1], list):
            groups[-1].append(line)
        else:
            groups.append([line] if line.is_added else line)
    return groups


def _split_tests(patch: Patch, path: str) -> tuple[str, str]:
    """(the new test functions, the file's diff without them): runs of added lines holding a `def` are new tests."""
    patched_file = next(f for f in patch.files if f.path == path)
    new, diff = [], [str(patched_file).split("\n@@", 1)[0] + "\n"]
    for hunk in patched_file:
        kept = []
        for group in _runs_of_added_lines(hunk):
            if isinstance(group, list) and any(line.value.startswith("    def ") for line in group):
                new.append("".join(line.value for line in group))
            else:
                kept += group if isinstance(group, list) else [group]
        source = sum(not line.is_added for line in kept)
        header = f"@@ -{hunk.source_start},{source} +{hunk.target_start},{len(kept) - sum(line.is_removed for line in kept)} @@"
        diff.append(f"{header}{' ' + hunk.section_header if hunk.section_header else ''}\n" + "".join(map(str, kept)))
    return "".join(new), "".join(diff)


def _local_counts() -> str:
    if not SUMMARY.exists():
        return "(no local run recorded: `mtp-mask-fix gate --checkout <upstream>` first)"
    rows = json.loads(SUMMARY.read_text()).values()
    return "; ".join(f"{r['target']}: {r['red']} red without the fix, {r['green']} green with it" for r in rows)


def review_comment(patch: Patch, figures: dict) -> str:
    fix = "".join(
        line.value for hunk in next(f for f in patch.files if f.path == FIXED_FILE) for line in hunk if line.is_added
    )
    test_file = patch.test_files()[0]
    new_tests, asserts = _split_tests(patch, test_file)
    before, after = figures["before"], figures["after"]
    return f"""Thanks for this, it is the line we carry too. One problem before it can merge: \
`{_falcon_h1_signature()}` takes neither `loss_mask` nor `**kwargs`, and `FalconH1ModelProvider` is exported by \
`megatron.bridge.models`, so with the unconditional kwarg every FalconH1 run through `gpt_step.forward_step` \
raises `TypeError`. Only MCore's MTP loss reads the mask here, and `_forward_step_common` already computes \
`use_mtp` (NeMo-RL made the same call in NVIDIA-NeMo/RL#2876).

`{FIXED_FILE}`, on the `"loss_mask": loss_mask,` and `}}` lines:
{FENCE}suggestion
    }}
{fix}{FENCE}

`{test_file}`, on the `loss_mask=loss_mask,` line of the exact-kwargs assertion (with MTP off the call stays \
exact, which now guards FalconH1):
{FENCE}suggestion
{FENCE}

On the lines of `test_forward_common_passes_loss_mask_to_model` (add `create_autospec` to the \
`unittest.mock` import): dense and packed, forward and schedule plan, with values, plus a model without \
`loss_mask` with MTP off:
{FENCE}suggestion
{new_tests}{FENCE}

The rest of the test part, outside this diff: the import, and asserts in the existing MTP tests (last and \
non-last pipeline stage through the real `get_batch`), as a patch for this branch:
{FENCE}diff
{asserts}{FENCE}

Reproduction on a tiny MCore `GPTModel` with MTP (CPU, one step, answer-only SFT batch), before -> after:
{FENCE}
$ ./run repro   # github.com/<fork>/mtp-mask-fix
mtp_1 loss {before["mtp_1_loss"]:.4f} -> {after["mtp_1_loss"]:.4f}, lm loss {before["lm_loss"]:.4f} -> \
{after["lm_loss"]:.4f}, grad norm {before["grad_norm"]:.3f} -> {after["grad_norm"]:.3f}
MTP loss mass on masked positions {before["mtp_mass_on_masked"]:.1%} -> {after["mtp_mass_on_masked"]:.1%}
{FENCE}
"""


def pr_body(patch: Patch, figures: dict) -> str:
    before, after = figures["before"], figures["after"]
    return f"""Title: {patch.subject}

# What does this PR do ?
Hands the batch's `loss_mask` to the model when MTP is on, so MCore's MTP loss, its gradient and its logged \
acceptance rate stop counting padding and prompt tokens. Fixes #6103. Supersedes #6105 (same fix, gated on \
`use_mtp`: `FalconH1Model.forward` takes no `loss_mask`).

# Changelog
- `{FIXED_FILE}`: `forward_args["loss_mask"] = loss_mask` when `use_mtp`; the schedule-plan path already passed it.
- `{patch.test_files()[0]}`: the mask's values reach the model (dense/packed, forward/schedule plan, last and \
non-last stage); a model without `loss_mask` still runs with MTP off.

# GitHub Actions CI
Local, CPU: {_local_counts()}.

# Before your PR is "Ready for review"
- [x] Make sure you read and followed [Contributor guidelines](https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/CONTRIBUTING.md)
- [x] Did you write any new necessary tests?
- [ ] Did you add or update any necessary documentation? (no user-facing change)

# Additional Information
- Related to #6103. Tiny MCore GPTModel with MTP, one step: MTP loss mass on masked positions \
{before["mtp_mass_on_masked"]:.1%} -> {after["mtp_mass_on_masked"]:.1%}, LM loss {before["lm_loss"]:.4f} -> \
{after["lm_loss"]:.4f}.

Co-authored-by: {PR_6105_AUTHOR} <{PR_6105_AUTHOR}@users.noreply.github.com>
"""


def render(figures_path: Path | None = None) -> str:
    patch, figures = Patch.load(), _figures(figures_path)
    rule = "-" * 100
    return f"(a) review comment for #6105\n{rule}\n{review_comment(patch, figures)}{rule}\n\n(b) PR body, if #6105 stalls\n{rule}\n{pr_body(patch, figures)}"
