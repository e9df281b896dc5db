"""pr: the upstream route, written from the patch and from figures measured here (never typed in).

(a) A review comment for PR #6105, which proposes the same line first: the finding, the fix and the test
additions as GitHub suggestion blocks on #6105's files, and the reproduction (templates/review_6105.md).
(b) A PR body (upstream's template sections, at most 25 lines) for when #6105 stalls: it supersedes #6105 and
credits its author (templates/pr_body.md).
"""

import ast
import json
from itertools import groupby
from pathlib import Path
from string import Template

from mtp_mask_fix.errors import ToolError
from mtp_mask_fix.gate import SUMMARY
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import FIXED_FILE, WORK
from mtp_mask_fix.targets import pins, release


TEMPLATES = Path(__file__).parent / "templates"
PR_6105_AUTHOR = "linmuchuiyang"  # GitHub author of #6103 and #6105
FALCON_H1 = "megatron/bridge/models/falcon_h1/modeling_falconh1/falconh1_model.py"
EFFECT = WORK / "effect" / "figures.json"


def _figures(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ToolError(
            f"cannot read figures from {path} ({exc.__class__.__name__}); run `mtp-mask-fix repro` first"
        ) from exc


def _falcon_h1_signature() -> str:
    """FalconH1Model.forward's parameters, read from the pinned release: a public model without `loss_mask`."""
    source = release(pins()["megatron-bridge"]).root / FALCON_H1
    tree = ast.parse(source.read_text())
    forward = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward")
    names = [a.arg for a in forward.args.args + forward.args.kwonlyargs if a.arg != "self"]
    if "loss_mask" in names or forward.args.kwarg:
        raise ToolError(f"{source}: FalconH1Model.forward now takes loss_mask; revisit the review comment")
    return f"FalconH1Model.forward({', '.join(names)})"


def _split_tests(patch: Patch, path: str) -> tuple[str, str]:
    """(the new test functions, the file's diff without them): a run of added lines holding a `def` is new tests."""
    patched_file = next(f for f in patch.files if f.path == path)
    new, diff = [], [str(patched_file).split("\n@@", 1)[0] + "\n"]
    for hunk in patched_file:
        kept = []
        for added, run in groupby(hunk, key=lambda line: line.is_added):
            run = list(run)
            if added and any(line.value.startswith("    def ") for line in run):
                new.append("".join(line.value for line in run))
            else:
                kept += run
        added, removed = sum(x.is_added for x in kept), sum(x.is_removed for x in kept)
        header = f"@@ -{hunk.source_start},{len(kept) - added} +{hunk.target_start},{len(kept) - removed} @@"
        diff.append(f"{header} {hunk.section_header}".rstrip() + "\n" + "".join(map(str, kept)))
    return "".join(new), "".join(diff)


def _effect() -> str:
    """`effect`'s figures in one line, if it has run: what the bug costs the MTP head on answer tokens."""
    if not EFFECT.exists():
        return ""
    from experiments.effect import summary_line

    return f"- Through SFT (`./run effect`, tiny model): {summary_line(json.loads(EFFECT.read_text()))}.\n"


def render(figures_path: Path = WORK / "repro" / "figures.json") -> str:
    """Both texts, each between rules."""
    patch, figures = Patch.load(), _figures(figures_path)
    before, after = figures["before"], figures["after"]
    test_file = patch.test_files()[0]
    new_tests, asserts = _split_tests(patch, test_file)
    counts = json.loads(SUMMARY.read_text()).items() if SUMMARY.exists() else []
    values = {
        "subject": patch.subject,
        "fixed_file": FIXED_FILE,
        "test_file": test_file,
        "fix": "".join(x.value for f in patch.files if f.path == FIXED_FILE for h in f for x in h if x.is_added),
        "new_tests": new_tests,
        "asserts": asserts,
        "falcon_h1": _falcon_h1_signature(),
        "author": PR_6105_AUTHOR,
        "repro": f"mtp_1 loss {before['mtp_1_loss']:.4f} -> {after['mtp_1_loss']:.4f}, lm loss {before['lm_loss']:.4f} -> "
        f"{after['lm_loss']:.4f}, grad norm {before['grad_norm']:.3f} -> {after['grad_norm']:.3f}\n"
        f"MTP loss mass on masked positions {before['mtp_mass_on_masked']:.1%} -> {after['mtp_mass_on_masked']:.1%}\n",
        "repro_line": f"MTP loss mass on masked positions {before['mtp_mass_on_masked']:.1%} -> "
        f"{after['mtp_mass_on_masked']:.1%}, LM loss {before['lm_loss']:.4f} -> {after['lm_loss']:.4f}.",
        "local_counts": "; ".join(
            f"{where}: {red} fail without the fix, {green} pass with it" for where, (red, green) in counts
        )
        or "(no upstream checkout gated yet: `mtp-mask-fix gate --checkout <upstream>` first)",
        "effect": _effect(),
    }
    texts = [Template((TEMPLATES / name).read_text()).substitute(values) for name in ("review_6105.md", "pr_body.md")]
    rule = "-" * 100
    return (
        f"(a) review comment for #6105\n{rule}\n{texts[0]}{rule}\n\n(b) PR body, if #6105 stalls\n{rule}\n{texts[1]}"
    )
