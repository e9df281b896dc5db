"""The layout is the architecture: the installed tool imports nothing of this repo but itself, and each room imports
only the rooms before it (mtp_mask_fix < maintain < tinymodel < experiments < bench < tests), with no cycle; inside
the tool one module imports torch or megatron (the probe, run in the target's interpreter) and one reads diff text;
README's tables are the ones the code prints."""

import ast
import re
from graphlib import CycleError, TopologicalSorter

import pytest

from maintain import __main__ as commands
from maintain.repo import REPO
from mtp_mask_fix.errors import Exit


ROOMS = ["mtp_mask_fix", "maintain", "tinymodel", "experiments", "bench", "tests"]  # each may import those before it
SOURCES = {path: ast.parse(path.read_text()) for room in ROOMS for path in sorted((REPO / room).rglob("*.py"))}


def _imports(module: ast.Module) -> set[str]:
    """Every module a file imports, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _room(path) -> str:
    return path.relative_to(REPO).parts[0]


@pytest.mark.parametrize("room", ROOMS[:-1])
def test_a_room_imports_only_the_rooms_below_it(room):
    above = set(ROOMS[ROOMS.index(room) + 1 :])
    wrong = {
        str(path.relative_to(REPO)): sorted(m for m in _imports(module) if m.split(".")[0] in above)
        for path, module in SOURCES.items()
        if _room(path) == room
    }
    assert {path: names for path, names in wrong.items() if names} == {}


def test_no_import_cycle():
    modules = {
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): m
        for path, m in SOURCES.items()
    }
    graph = {name: {m for m in _imports(module) if m in modules} - {name} for name, module in modules.items()}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:  # pragma: no cover - the failure message is the point
        pytest.fail(f"import cycle: {exc.args[1]}")


# What reading a diff's text, or git apply's complaint about one, takes: its markers, as text or as a regex.
DIFF_TEXT = re.compile(r"diff --git|(\\?\+){3} b/|--- a/|@@|patch failed")


def _reads_diff_text(module: ast.Module) -> bool:
    """Whether a module imports unidiff, or a string of its (docstrings aside) holds a marker of diff text."""
    scopes = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    docs = {
        id(node.body[0].value) for node in ast.walk(module) if isinstance(node, scopes) and ast.get_docstring(node)
    }
    strings = [n.value for n in ast.walk(module) if isinstance(n, ast.Constant) and id(n) not in docs]
    return "unidiff" in {i.split(".")[0] for i in _imports(module)} or any(
        isinstance(text, str) and DIFF_TEXT.search(text) for text in strings
    )


def test_in_the_tool_only_the_probe_imports_torch_or_megatron_and_only_patch_reads_diff_text():
    tool = {path.stem: module for path, module in SOURCES.items() if _room(path) == "mtp_mask_fix"}
    heavy = {name for name, m in tool.items() if any(i.split(".")[0] in ("torch", "megatron") for i in _imports(m))}
    diff = {name for name, module in tool.items() if _reads_diff_text(module)}
    assert (heavy, diff) == ({"probe"}, {"patch"})


@pytest.mark.parametrize(
    "line",
    [
        r're.findall(r"^\+\+\+ b/(.+)$", diff, re.M)',  # how trial.py once named a diff's files
        r're.search(r"patch failed: (\S+):(\d+)", error)',  # how check.py once found the hunk git failed on
        'text.split("\\n@@", 1)',
        "from unidiff import PatchSet",
    ],
)
def test_the_diff_text_rule_sees_a_module_that_reads_diff_text(line):
    assert _reads_diff_text(ast.parse(line))


def test_readme_holds_the_exit_codes_and_the_commands_as_the_code_prints_them():
    readme = (REPO / "README.md").read_text()
    rows = [f"| {'128+n' if code is Exit.INTERRUPTED else int(code)} | {code.meaning} |" for code in Exit]
    assert "\n".join(["| exit | meaning |", "| --- | --- |", *rows]) in readme
    assert commands.table() in readme, "run `./run --help --markdown` and put its table in README"
