"""mtp-mask-fix: check, apply, verify and revert the Megatron-Bridge #6103 fix on any Megatron-Bridge."""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from mtp_mask_fix import __version__, apply, check, journal, targets, watch
from mtp_mask_fix.errors import Exit, ToolError, doing, exit_table
from mtp_mask_fix.journal import WAIT, Lock
from mtp_mask_fix.signals import SIGNALS, Interrupted, guard, say
from mtp_mask_fix.verify import verify


TARGET = "the folder holding src/megatron/bridge (a git checkout, a source tree) or megatron/bridge (site-packages)"


class Parser(argparse.ArgumentParser):
    """An argparse parser whose complaints are one line and exit 2, like every refusal."""

    commands = None  # the subcommands' action, once added

    def add_subparsers(self, **kwargs):
        self.commands = super().add_subparsers(**kwargs)
        return self.commands

    def parse_args(self, args=None, namespace=None):
        # An unknown flag is named before a missing command, by the (sub)command whose --help lists the flags.
        known, unknown = self.parse_known_args(args, namespace)
        command = self.commands and getattr(known, self.commands.dest)
        if unknown:
            (self.commands.choices[command] if command else self).error(f"unrecognized arguments: {' '.join(unknown)}")
        if self.commands and command is None:
            self.error(f"the following arguments are required: {self.commands.dest}")
        return known

    def error(self, message):
        raise ToolError(f"{message} (see {self.prog} --help)")


def interpreter(python: str) -> str:
    """The absolute path of --python, which every "verified" line names; refused where it cannot be run."""
    if (found := shutil.which(python)) is None:
        raise ToolError(f"--python {python}: no executable file of that name{'' if os.sep in python else ' on PATH'}")
    return os.path.abspath(found)


def _target(args) -> targets.Target:
    """TARGET as given, else the Megatron-Bridge that --python finds wherever it runs (an editable one's checkout)."""
    if args.target is not None:
        return targets.resolve(args.target)
    python = interpreter(args.python)
    # Not the cwd's (what trains runs elsewhere), unless PYTHONPATH names it: then it imports it wherever it runs.
    code = "import os, sys, importlib.util as u; named = os.environ.get('PYTHONPATH', '').split(os.pathsep); "
    code += "sys.path = [p for p in sys.path if p and (p != os.getcwd() or p in named)]; "
    code += "print(u.find_spec('megatron.bridge').submodule_search_locations[0])"
    with doing("running --python", python):
        found = subprocess.run([python, "-c", code], capture_output=True, text=True)
    where = Path((found.stdout.strip().splitlines() or [""])[-1])
    if found.returncode != 0 or where.parts[-2:] != ("megatron", "bridge"):
        raise ToolError(f"{python} imports no megatron.bridge; give --python the interpreter that trains, or a TARGET")
    root = where.parent.parent  # an editable install's src/: its checkout is the TARGET
    return targets.resolve(str(root.parent if root.name == "src" else root))


def cmd_check(args) -> int:
    return report(_target(args))


def cmd_apply(args) -> int:
    target, python = _target(args), None if args.no_verify else interpreter(args.python)
    return apply.apply(target, check.candidates(), python=python, wait=args.wait)


def cmd_revert(args) -> int:
    return apply.revert(_target(args), check.candidates(), wait=args.wait)


def cmd_verify(args) -> int:
    return verify_command(_target(args), interpreter(args.python))


def cmd_status(args) -> int:
    return report(_target(args), status=True)


def report(target: targets.Target, *, status: bool = False) -> int:
    """Print where TARGET stands (`status`: after the patch's DEP-3 block); the state's exit code."""
    patches = check.candidates()  # the carried patch's block; judged as `check` judges, backports too
    with Lock(target.root, target.label).held():  # a running write finishes first
        verdict = check.check(target, patches)
    block = "".join(f"  {key}: {value}\n" for key, value in patches[0].metadata.items())
    say(f"{patches[0].path.name}: {patches[0].subject}\n{block}  on {verdict}" if status else str(verdict))
    return verdict.state.code


def verify_command(target: targets.Target, python: str) -> int:
    """Print whether the model that `python` imports from TARGET receives the batch's loss_mask; 0 only if it does."""
    with Lock(target.root, target.label).held():  # what a killed run left is read alone; the probe runs unlocked
        if left := journal.left(target.root, check.touched(target, check.candidates())):
            raise ToolError(f"{target.label}: an interrupted run left {left}", Exit.FAILED)
    delivered, reason = verify(target, python)
    if not delivered:
        raise ToolError(f"{target.label}: not verified with {python}: {reason}", Exit.FAILED)
    say(f"{target.label}: verified with {python}: {reason}")
    return Exit.OK


def seconds(text: str) -> float:
    """The seconds that --wait gives, 0 or more."""
    if not re.fullmatch(r"\d+(\.\d*)?", text):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="mtp-mask-fix",
        description=__doc__.split("\n\n")[0],
        epilog=exit_table(markdown=False),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)

    def command(func, help, python):
        p = sub.add_parser(func.__name__.removeprefix("cmd_"), help=help, description=help)
        p.set_defaults(func=func)
        p.add_argument("target", metavar="TARGET", nargs="?", help=f"{TARGET}; default: what --python imports")
        p.add_argument("--python", metavar="PY", default=sys.executable, help=python)
        return p

    trains = "the interpreter that trains (it imports this Megatron-Bridge), for the behaviour probe"
    reads = "the interpreter that trains: with no TARGET, its Megatron-Bridge is read (its files, never run)"
    wait = dict(metavar="SECONDS", type=seconds, default=WAIT, help=f"for another's write (default {WAIT:.0f})")
    command(cmd_check, "applies / already applied (or fixed another way) / drifted", reads)
    p = command(cmd_apply, "verify the patch by behaviour, then apply it (all or nothing)", trains)
    p.add_argument("--no-verify", action="store_true", help="skip the behaviour probe before applying")
    p.add_argument("--wait", **wait)
    p = command(cmd_revert, "take the patch out again (all or nothing): the bytes as before the patch", reads)
    p.add_argument("--wait", **wait)
    command(cmd_verify, "exit 0 only if the batch's loss_mask reaches a model with MTP on", trains)
    command(cmd_status, "the patch's DEP-3 block, and whether TARGET still needs the patch", reads)
    said = "run CMD as it is: does megatron-core's MTP loss train on what it assumes?"
    p = sub.add_parser("watch", help=said, description=said)
    p.set_defaults(func=watch.watch)
    p.add_argument("--strict", action="store_true", help="stop at the first call against it, naming its caller")
    p.add_argument("--steps", metavar="N", type=int, help="count each process's first N MTP loss calls only")
    p.add_argument("cmd", metavar="CMD", nargs="*", help="after --: the job, e.g. torchrun ... pretrain.py ...")
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> None:
    """Run a command line (maintain/'s too), with one line on stderr and its exit code for any refusal."""
    with guard():  # SIGINT, SIGTERM, SIGHUP: one line and 128+n (apply and revert roll back first)
        text, out = "", sys.stderr
        try:
            args = (parser or build_parser()).parse_args(sys.argv[1:] if argv is None else argv)
            code = args.func(args)  # it prints its outcome, or hands it back (watch, maintain's) to print here
            (text, code), out = code if isinstance(code, tuple) else ("", code), sys.stdout
        except ToolError as exc:
            text, code = f"mtp-mask-fix: error: {exc}", exc.code
        except subprocess.CalledProcessError as exc:  # a git step the tool did not expect to fail
            reason = (exc.stderr or "").strip().splitlines() or [f"exit {exc.returncode}"]  # git() decodes its output
            text, code = f"mtp-mask-fix: error: {' '.join(map(str, exc.cmd[:2]))} failed: {reason[-1]}", Exit.FAILED
        except OSError as exc:  # apply and revert say what they left themselves: here, nothing was changed
            text, code = f"mtp-mask-fix: error: {exc}; nothing changed", Exit.FAILED
        except Interrupted as exc:  # apply and revert say what they left; a reading command changes nothing
            text, code = f"mtp-mask-fix: error: {exc}: nothing changed", exc.code
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # the outcome stands: a signal from here on is not delivered
    if text and out is sys.stdout:
        say(text)
    elif text:
        print(text, file=out)
    sys.exit(int(code))
