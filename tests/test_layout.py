"""The layout is the architecture: the installed tool imports nothing of this repo but itself, and each room imports
only the rooms below it (mtp_mask_fix < maintain < tinymodel < experiments < tests), with no cycle; inside the tool
one module imports torch or megatron (the probe, run in the target's interpreter) and one reads diff text; README's
tables are the ones the code prints."""

import ast
import re
from graphlib import CycleError, TopologicalSorter

import pytest

from maintain import __main__ as commands
from maintain.repo import REPO
from mtp_mask_fix.errors import exit_table


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


def test_in_the_tool_only_the_probe_imports_torch_or_megatron_and_only_patch_reads_diff_text():
    tool = {path.stem: (path, module) for path, module in SOURCES.items() if _room(path) == "mtp_mask_fix"}
    heavy = {
        name for name, (_, m) in tool.items() if any(i.split(".")[0] in ("torch", "megatron") for i in _imports(m))
    }
    diff = {
        name
        for name, (path, module) in tool.items()
        if "unidiff" in {i.split(".")[0] for i in _imports(module)}
        or re.search(r"""["'](diff --git|\+\+\+ b/|--- a/|@@ )""", path.read_text())
    }
    assert (heavy, diff) == ({"probe"}, {"patch"})


def test_readme_holds_the_exit_codes_and_the_commands_as_the_code_prints_them():
    readme = (REPO / "README.md").read_text()
    assert exit_table() in readme
    assert commands.table() in readme, "run `./run --help --markdown` and put its table in README"
