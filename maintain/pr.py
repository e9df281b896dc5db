"""pr: the upstream route, written from the patch and from red/green measured on this very patch (never typed in).

(a) A review of PR #6105, which proposes the same line first, written to its author: a general comment
(templates/review_6105.md) whose every claim links upstream's code at a gated commit, then one comment per change,
each a suggestion on the lines #6105's description names, to be committed together. (b) A PR body that carries #6105
forward (templates/pr_body.md), for when #6105 stalls and its author, asked there, agrees; it credits that author
exactly as `--co-author` gives it (never guessed). Its only input beyond the patch is what `gate --checkout` recorded
for this very patch (results_file): the counts, the megatron-core tested and the lines each link points at.
"""

import ast
import hashlib
import json
import re
import subprocess
from itertools import groupby
from pathlib import Path
from string import Template

from maintain.repo import WORK
from mtp_mask_fix import cli
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.patch import Patch
from mtp_mask_fix.paths import FIXED_FILE


TEMPLATES = Path(__file__).parent / "templates"
REVIEW = ("review_6105", "review_fix", "review_assert", "review_tests")  # the review's comments, in order
UPSTREAM = "https://github.com/NVIDIA-NeMo/Megatron-Bridge"
MEGATRON_LM = "https://github.com/NVIDIA/Megatron-LM"
SUBMODULE = "3rdparty/Megatron-LM"
STEPS = "src/megatron/bridge/training"
FALCON_H1 = "src/megatron/bridge/models/falcon_h1/modeling_falconh1/falconh1_model.py"
MODELS = "src/megatron/bridge/models/__init__.py"
RECIPES = "src/megatron/bridge/recipes"
MTP = "megatron/core/transformer/multi_token_prediction.py"
PRETRAIN = "pretrain_gpt.py"  # Megatron-LM's own GPT training step
CO_AUTHOR = re.compile(r"[^<>@\n]*\S <[^<>\s@]+@[^<>\s@]+\.[^<>\s@]+>")
GATE = (
    f"./run gate --checkout <a Megatron-Bridge clone holding {{}}, its {SUBMODULE} checked out> --checkouts-only "
    "--python <an interpreter whose megatron-core is built from that pin>"
)
RULE = "-" * 100
# What gate records per upstream commit where the patch held: red = the tests the patch adds or changes that fail by
# assertion there, of all FAIL_TO_PASS; green = tests passing patched, of all run; megatron_lm = the Megatron-LM
# commit the interpreter's megatron-core was built from, the one the commit pins; anchors = anchors() there.
FIELDS = {"commit": r"[0-9a-f]{40}", "megatron_core": r"\d+\.\d+\S*", "megatron_lm": r"[0-9a-f]{40}"}
FIELDS |= {"red": r"[1-9]\d*/\d+", "green": r"[1-9]\d*/\d+"}


def added(patch: Patch, path: str) -> str:
    """The lines the patch adds to `path`, which must be one run of added lines and nothing removed (what a
    suggestion or a block of new tests is)."""
    (patched,) = [f for f in patch.files if f.path == path]
    groups = groupby((line for hunk in patched for line in hunk), key=lambda line: line.is_added)
    runs = ["".join(line.value for line in run) for added, run in groups if added]
    if len(runs) != 1 or patched.removed:
        raise ToolError(f"the patch changes {path} in {len(runs)} places: one suggestion per change needs one")
    return runs[0].rstrip("\n") + "\n"


def patch_key(patch: Patch) -> str:
    """The git blob hash of the patch's diff: a new diff is a new key; its message or DEP-3 block do not count."""
    data = patch.diff.encode()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def results_file(patch: Patch) -> Path:
    """{"patch": patch_key(patch), "checkouts": [FIELDS | {"anchors": ...}, ...]}, in the repo's .work/."""
    return WORK / "gate" / "by-patch" / f"{patch_key(patch)}.json"


# --- the lines the review links, found in upstream's tree at the gated commit ---------------------------------------


def _nodes(source: str, function: str | None = None) -> list[ast.AST]:
    """Every node of `source`, or of its function `function` (none if it has no such function)."""
    tree = ast.parse(source)
    scope = next((n for n in ast.walk(tree) if getattr(n, "name", None) == function), None) if function else tree
    return list(ast.walk(scope)) if scope else []


def _lines(nodes: list[ast.AST]) -> list[int] | None:  # [first, last] line of a run of nodes
    return [nodes[0].lineno, nodes[-1].end_lineno] if nodes else None


def _assigns(nodes: list[ast.AST], name: str, value: str = "") -> list[ast.Assign]:
    """The assignments to `name` (alone or first of a tuple) whose value's source starts with `value`."""
    found = [n for n in nodes if isinstance(n, ast.Assign) and ast.unparse(n.value).startswith(value)]
    return [n for n in found if ast.unparse(n.targets[0]).strip("(").split(",")[0] == name]


def falcon_h1_forward_lines(source: str) -> list[int] | None:
    """[first, last] line of FalconH1Model.forward's signature, if it takes neither loss_mask nor **kwargs."""
    classes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "FalconH1Model"]
    forward = [n for c in classes for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]
    takes = {getattr(arg, "arg", None) for method in forward for arg in ast.walk(method.args)}
    if len(forward) != 1 or forward[0].args.kwarg or "loss_mask" in takes:
        return None
    return [forward[0].lineno, forward[0].body[0].lineno - 1]  # `def forward(` to the line ending in `:`


def anchors(tree: Path, checkout: Path, commit: str) -> dict:
    """What the review links at `commit` (`tree` holds its files), each [first, last] line or None where the code is
    not as the review says: where _forward_step_common computes use_mtp, FalconH1Model.forward's signature, its
    provider in `__all__`, each other step's `"loss_mask": loss_mask` entry; then `megatron_lm`, the commit pinned for
    SUBMODULE, and in its process_mtp_loss (read from the submodule's repository in `checkout`) the all-ones fallback
    and the per-depth roll of labels and mask, and pretrain_gpt.py's model call that passes `loss_mask` as it is."""

    def read(path: str | Path) -> str:
        return (tree / path).read_text() if (tree / path).is_file() else ""

    def mask_entry(source: str) -> list[int] | None:
        pairs = [(k, v) for d in _nodes(source) if isinstance(d, ast.Dict) for k, v in zip(d.keys, d.values) if k]
        return _lines([k for k, v in pairs if (ast.unparse(k), ast.unparse(v)) == ("'loss_mask'", "loss_mask")][:1])

    export = [e for n in _assigns(_nodes(read(MODELS)), "__all__") for e in getattr(n.value, "elts", [])]
    steps = {p.stem: mask_entry(p.read_text()) for p in sorted((tree / STEPS).glob("*_step.py"))}
    pin = _git(checkout, "rev-parse", "--verify", "--quiet", f"{commit}:{SUBMODULE}")

    def at_pin(path: str) -> str:
        return (
            _git(checkout / SUBMODULE, "show", f"{pin}:{path}")
            if pin and (checkout / SUBMODULE / ".git").exists()
            else ""
        )

    core = at_pin(MTP)
    model_calls = [
        n
        for n in _nodes(at_pin(PRETRAIN))
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) == "model"
        and any(kw.arg == "loss_mask" and ast.unparse(kw.value) == "loss_mask" for kw in n.keywords)
    ]
    nodes = _nodes(core, "process_mtp_loss")
    loops = [n.body for n in nodes if isinstance(n, ast.For)]
    rolls = [a for body in loops for x in ("mtp_labels", "loss_mask") for a in _assigns(body, x, f"roll_tensor({x}")]
    fallback = _assigns(nodes, "loss_mask", "torch.ones_like(")
    fallback = [i for i in nodes if isinstance(i, ast.If) and any(a in i.body for a in fallback)] or fallback
    return {
        "use_mtp": _lines(_assigns(_nodes(read(FIXED_FILE), "_forward_step_common"), "use_mtp")[:1]),
        "falcon_h1_forward": falcon_h1_forward_lines(read(FALCON_H1)) if read(FALCON_H1) else None,
        "falcon_h1_export": _lines([e for e in export if ast.unparse(e) == "'FalconH1ModelProvider'"][:1]),
        "steps": {step: lines for step, lines in steps.items() if lines and step != "gpt_step"},
        "megatron_lm": pin or None,
        "mtp_fallback": _lines(fallback) if len(fallback) == 1 else None,
        "mtp_roll": _lines(sorted(rolls, key=lambda a: a.lineno)) if len(rolls) == 2 else None,
        "mlm_pretrain": _lines(model_calls) if len(model_calls) == 1 else None,
    }


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


# --- rendering --------------------------------------------------------------------------------------------------


def _gate(patch: Patch) -> str:  # the command that records this patch's results
    return GATE.format((patch.base_commit or "")[:12] or "the patch's base-commit")


def _measured(patch: Patch) -> list[dict]:
    """This patch's complete gated checkouts (megatron_lm is null for one tested with a megatron-core not built from
    its pin); refuses (exit 5, naming the command) when there are none."""
    path, run = results_file(patch), _gate(patch)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ToolError(f"no red/green of this patch on an upstream checkout yet: run `{run}`", Exit.FAILED) from None
    except (OSError, ValueError) as exc:
        raise ToolError(f"cannot read {path} ({exc.__class__.__name__}): run `{run}` again", Exit.FAILED) from exc
    rows = data.get("checkouts") if isinstance(data, dict) and data.get("patch") == patch_key(patch) else None
    rows = [r for r in rows or [] if all(re.fullmatch(form, str(r.get(key))) for key, form in FIELDS.items())]
    if not rows:
        raise ToolError(f"{path} holds no complete red/green of this patch: run `{run}`", Exit.FAILED)
    return rows


LINKED = ("use_mtp", "falcon_h1_forward", "falcon_h1_export", "mtp_fallback", "mtp_roll", "mlm_pretrain")


def _links(row: dict) -> dict[str, str]:
    """The review's permalinks, at the row's commit (Megatron-LM's at the commit it pins)."""

    def at(repo: str, commit: str, path: str, lines: list[int]) -> str:
        first, last = lines
        return f"{repo}/blob/{commit}/{path}#L{first}" + (f"-L{last}" if last != first else "")

    found, commit = row["anchors"], row["commit"]
    paths = {"use_mtp": FIXED_FILE, "falcon_h1_forward": FALCON_H1, "falcon_h1_export": MODELS}
    links = {key: at(UPSTREAM, commit, path, found[key]) for key, path in paths.items()}
    links |= {key: at(MEGATRON_LM, row["megatron_lm"], MTP, found[key]) for key in ("mtp_fallback", "mtp_roll")}
    links["mlm_pretrain"] = at(MEGATRON_LM, row["megatron_lm"], PRETRAIN, found["mlm_pretrain"])
    links["recipes"] = f"{UPSTREAM}/tree/{commit}/{RECIPES}"
    links["steps"] = ", ".join(
        f"[`{step}`]({at(UPSTREAM, commit, f'{STEPS}/{step}.py', lines)})" for step, lines in found["steps"].items()
    )
    return links


def _review_row(patch: Patch, rows: list[dict]) -> dict:
    """The row the review links: the patch's base-commit (what #6105 targets) if gated, else the first; refused
    unless every link's lines were found there."""
    row = sorted(rows, key=lambda r: r["commit"] != patch.base_commit)[0]
    found = row.get("anchors") if isinstance(row.get("anchors"), dict) else {}
    missing = [key for key in LINKED if not found.get(key)] + ["steps"] * (not found.get("steps"))
    if missing or found.get("megatron_lm") != row["megatron_lm"]:
        what = ", ".join(missing) or f"{SUBMODULE} at the commit tested"
        raise ToolError(
            f"the gated checkout at {row['commit'][:12]} lacks the review's lines ({what}): run `{_gate(patch)}`",
            Exit.FAILED,
        )
    return row


def _tested(row: dict) -> str:
    """One bullet of the PR body: a gated commit, its megatron-core, and what the patch's tests did there."""
    red, of = row["red"].split("/")
    needed = f"the {of} new cases that need it" if red == of else f"{red} of the {of} new cases that need it"
    return (
        f"- at {row.get('tag') or 'commit'} {row['commit'][:12]}, with megatron-core {row['megatron_core']} built from its `{SUBMODULE}` pin "
        f"(NVIDIA/Megatron-LM@{row['megatron_lm'][:12]}): {row['green']} pass; without the `gpt_step.py` change, "
        f"{needed} fail by assertion."
    )


def render(patch: Patch, co_author: str | None) -> str:
    """Both texts, each between rules; the refusals come first and change nothing."""
    if len(patch.test_files()) != 1:
        raise ToolError(f"{patch.path.name}: pr needs the carried patch, which changes one upstream test file")
    # the base-commit's row first, then untagged commits, then tags
    rows = sorted(_measured(patch), key=lambda r: (r["commit"] != patch.base_commit, bool(r.get("tag"))))
    if not co_author or not CO_AUTHOR.fullmatch(co_author.strip()):
        raise ToolError(
            '--co-author "Name <email>" is required: the identity on #6105\'s commits (see its pull/6105.patch); '
            "it is not recorded here and never guessed"
        )
    (test_file,) = patch.test_files()
    row = _review_row(patch, rows)
    tests = added(patch, test_file)
    values = _links(row) | {
        "fixed_file": FIXED_FILE,
        "test_file": test_file,
        "fix": added(patch, FIXED_FILE),
        "tests": tests,
        "test_names": " and ".join(f"`{name}`" for name in re.findall(r"^    def (test_\w+)\(", tests, re.M)),
        "subject": patch.subject,
        "co_author": co_author.strip(),
        "tested": "\n".join(_tested(r) for r in rows),
    }
    text = {name: Template((TEMPLATES / f"{name}.md").read_text()).substitute(values) for name in (*REVIEW, "pr_body")}
    review = f"{RULE}\n".join(text[name] for name in REVIEW)
    trailer = (
        f'git commit --amend --no-edit --reset-author --signoff --trailer "Co-authored-by: {values["co_author"]}"'
    )
    return (
        "(a) review of #6105, to post while #6105 is open and upstream main still lacks the kwarg (`./run check` of a\n"
        "fresh clone exits 0): a general comment, then one comment per suggestion; each suggestion's first line says\n"
        f"which of #6105's lines it goes on (not part of the comment); they are committed as one batch\n{RULE}\n"
        f"{review}{RULE}\n\n"
        "(b) PR body, only if #6105 stalls and its author, asked in #6105, agrees that it be carried forward; open it\n"
        "from the patch as a commit on current main (`./run branch`), gated there (`./run gate --checkout`), after\n"
        f"`{trailer}`\n(you author and sign it off, DCO; a squash merge keeps the trailers)\n{RULE}\n{text['pr_body']}{RULE}\n"
    )


def parser() -> cli.Parser:
    """The command line of `./run NAME` for this module: its refusals are the tool's (one line, the same exit codes)."""
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
