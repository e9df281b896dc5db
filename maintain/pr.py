"""pr: the upstream route, written from the patch and from red/green measured on this very patch (never typed in).

(a) A review of PR #6105, which proposes the same line first: a general comment (templates/review_6105.md) with the
FalconH1 finding, then one comment per change, each anchored on lines named by their text, with a suggestion that
stands alone. (b) A PR body for when #6105 stalls (templates/pr_body.md), crediting #6105's author exactly as
`--co-author` gives it (never guessed). Its only input beyond the patch is what `gate --checkout` recorded for this
very patch (results_file), so no result of another patch or an older diff reaches a text.
"""

import ast
import hashlib
import json
import re
from pathlib import Path
from string import Template

from maintain.repo import WORK
from mtp_mask_fix import cli
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import FIXED_FILE


TEMPLATES = Path(__file__).parent / "templates"
TEMPLATES_USED = ("review_6105", "review_fix", "review_assert", "review_tests", "pr_body")  # the review's in order
UPSTREAM = "https://github.com/NVIDIA-NeMo/Megatron-Bridge"
FALCON_H1 = "src/megatron/bridge/models/falcon_h1/modeling_falconh1/falconh1_model.py"
CO_AUTHOR = re.compile(r"[^<>@\n]*\S <[^<>\s@]+@[^<>\s@]+\.[^<>\s@]+>")
GATE = "./run gate --checkout <a Megatron-Bridge clone holding {}> --checkouts-only --python <its interpreter>"
RULE = "-" * 100
# What gate records per upstream commit where the patch held: red = the tests the patch adds or changes that fail by
# assertion there, of all FAIL_TO_PASS; green = tests passing patched, of all run; falcon_h1_forward = [first, last]
# line of FalconH1Model.forward's signature at that commit, or null.
FIELDS = {"commit": r"[0-9a-f]{40}", "megatron_core": r"\d+\.\d+\S*", "red": r"[1-9]\d*/\d+", "green": r"[1-9]\d*/\d+"}


def patch_key(patch: Patch) -> str:
    """The git blob hash of the patch's diff: a new diff is a new key; its message or DEP-3 block do not count."""
    data = patch.diff.encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def results_file(patch: Patch) -> Path:
    """{"patch": patch_key(patch), "checkouts": [FIELDS | {"falcon_h1_forward": ...}, ...]}, in the repo's .work/."""
    return WORK / "gate" / "by-patch" / f"{patch_key(patch)}.json"


def falcon_h1_forward_lines(source: str) -> list[int] | None:
    """[first, last] line of FalconH1Model.forward's signature, if it takes neither loss_mask nor **kwargs."""
    classes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "FalconH1Model"]
    forward = [n for c in classes for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    takes = {getattr(arg, "arg", None) for method in forward for arg in ast.walk(method.args)}
    if len(forward) != 1 or forward[0].args.kwarg or "loss_mask" in takes:
        return None
    return [forward[0].lineno, forward[0].body[0].lineno - 1]  # `def forward(` to the line ending in `:`


def _gate(patch: Patch) -> str:  # the command that records this patch's results
    return GATE.format((patch.base_commit or "")[:12] or "the patch's base-commit")


def _measured(patch: Patch) -> list[dict]:
    """This patch's gated checkouts; refuses (exit 5, naming the command) when there are none or one is incomplete."""
    path, run = results_file(patch), _gate(patch)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ToolError(f"no red/green of this patch on an upstream checkout yet: run `{run}`", Exit.FAILED) from None
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot read {path} ({exc.__class__.__name__}): run `{run}` again", Exit.FAILED) from exc
    rows = data.get("checkouts") if isinstance(data, dict) and data.get("patch") == patch_key(patch) else None
    if not rows or not all(re.fullmatch(form, str(r.get(key))) for r in rows for key, form in FIELDS.items()):
        raise ToolError(f"{path} holds no complete red/green of this patch: run `{run}`", Exit.FAILED)
    return rows


def _effect(patch: Patch) -> str:
    """`./run effect`'s own summary line for this patch, if it ran (it names its settings, size and seeds)."""
    path = WORK / "effect" / patch_key(patch) / "figures.json"
    summary = json.loads(path.read_text())["citations"]["summary"] if path.exists() else ""
    return summary and f"- What the bug costs a tiny MCore GPTModel with MTP (CPU): {summary}.\n"


def render(patch: Patch, co_author: str | None) -> str:
    """Both texts, each between rules; the refusals come first and change nothing."""
    if len(patch.test_files()) != 1:
        raise ToolError(f"{patch.path.name}: pr needs the carried patch, which changes one upstream test file")
    rows = _measured(patch)
    if not co_author or not CO_AUTHOR.fullmatch(co_author.strip()):
        raise ToolError(
            '--co-author "Name <email>" is required: the identity on #6105\'s commits (see its pull/6105.patch); '
            "it is not recorded here and never guessed"
        )
    (test_file,) = patch.test_files()
    by_base = sorted(rows, key=lambda r: r["commit"] != patch.base_commit)
    falcon = next((r for r in by_base if r.get("falcon_h1_forward")), None)
    if falcon is None:
        raise ToolError(
            f"no gated checkout holds FalconH1Model.forward without loss_mask: run `{_gate(patch)}`", Exit.FAILED
        )
    first, last = falcon["falcon_h1_forward"]
    values = {
        "fixed_file": FIXED_FILE,
        "test_file": test_file,
        "falcon_h1": f"{UPSTREAM}/blob/{falcon['commit']}/{FALCON_H1}#L{first}-L{last}",
        "fix": patch.added(FIXED_FILE),
        "tests": patch.added(test_file),
        "subject": patch.subject,
        "co_author": co_author.strip(),
        "effect": _effect(patch),
        "counts": "; ".join(
            f"at {r['commit'][:9]} with megatron-core {r['megatron_core']}, {r['red'].split('/')[0]} of the new "
            f"cases fail without the fix (by assertion; the others are guards) and {r['green']} tests pass with it"
            for r in rows
        ),
    }
    text = {name: Template((TEMPLATES / f"{name}.md").read_text()).substitute(values) for name in TEMPLATES_USED}
    review = f"\n{RULE}\n".join(text[name] for name in TEMPLATES_USED[:-1])
    trailer = f'git commit --amend --no-edit --trailer "Co-authored-by: {values["co_author"]}"'
    return (
        f"(a) review of #6105: one general comment, then one comment per change\n{RULE}\n{review}{RULE}\n\n"
        f"(b) PR body, if #6105 stalls (first `{trailer}`: a squash merge keeps the commit's trailers)\n"
        f"{RULE}\n{text['pr_body']}{RULE}\n"
    )


def parser() -> cli.Parser:
    parser = cli.Parser(
        prog="./run pr",
        description="print the review of #6105 and the fallback PR body, from this patch's gated red/green",
    )
    parser.add_argument(
        "--co-author",
        metavar='"NAME <EMAIL>"',
        help='"Name <email>" as on #6105\'s commits (pull/6105.patch), credited',
    )
    parser.add_argument("--patch", type=Path, help="the patch (default: the first in patches/series)")
    parser.set_defaults(func=lambda args: (render(Patch.load(args.patch), args.co_author), Exit.OK))
    return parser


if __name__ == "__main__":
    cli.main(parser=parser())
