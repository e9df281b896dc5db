"""`./run --help`: every command of this clone, from the parsers themselves; `--markdown` gives README's table."""

import argparse
import re
import sys

from maintain import branch, gate, refresh, view
from mtp_mask_fix import cli
from mtp_mask_fix.signals import say


RUN = [  # what ./run does itself, around the modules
    ("./run setup", "sync the environment (uv.lock; a quick check once it is in sync) and write the view src/"),
    (
        "./run test [--all] [PYTEST ARGS]",
        "the push tier; with --all every tier (what CI runs); or what the arguments select",
    ),
    (
        "./run python VERSION|DIR",
        "the interpreter of a release's environment or of an upstream checkout's, built once",
    ),
    ("./run effect|repro [ARGS]", "the experiments: what the bug costs the MTP head (--help: their options)"),
]


def _usage(parser: argparse.ArgumentParser) -> str:
    return re.sub(r"\s+", " ", parser.format_usage().removeprefix("usage: ").replace(" [-h]", "")).strip()


def commands() -> list[tuple[str, str, str]]:
    """(usage, what it does, who has it) for the tool's commands, then this clone's."""
    tool = cli.build_parser().commands.choices.values()  # each command's parser, described by its help
    parsers = [(parser, "the tool: installed, or `./run NAME`") for parser in tool]
    parsers += [(module.parser(), "this clone") for module in (gate, branch, refresh, view)]
    return [(_usage(p), p.description, who) for p, who in parsers] + [(*row, "this clone") for row in RUN]


def table() -> str:
    """README's Commands table, a bar inside a cell escaped."""
    rows = [("command", "what it does", "where"), ("---", "---", "---")]
    rows += [(f"`{usage}`", said, who) for usage, said, who in commands()]
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows)


if __name__ == "__main__":  # said: a reader that has gone (`| head`) takes the rest without a traceback
    head = "./run NAME [ARGS]: this clone's commands and the tool's, in the environment ./run builds\n"
    listed = [f"  {usage}\n      {said}" for usage, said, _ in commands()]
    say(table() if sys.argv[1:] == ["--markdown"] else "\n".join([head, *listed]), final=False)
