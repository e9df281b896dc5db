"""mtp-mask-fix: check, apply, verify and revert the Megatron-Bridge #6103 fix on any Megatron-Bridge."""

import argparse
import re
import signal
import subprocess
import sys

from mtp_mask_fix import __version__, check, journal
from mtp_mask_fix.apply import apply, revert
from mtp_mask_fix.errors import Exit, ToolError
from mtp_mask_fix.journal import WAIT, Lock
from mtp_mask_fix.signals import SIGNALS, Interrupted, guard, say
from mtp_mask_fix.targets import find, interpreter
from mtp_mask_fix.verify import proven
from mtp_mask_fix.watch import watch


class Parser(argparse.ArgumentParser):
    """An argparse parser whose complaints are one line and exit 2, like every refusal."""

    def error(self, message):
        raise ToolError(f"{message} (see {self.prog} --help)")


def report(target: str | None, *, python: str, status: bool = False) -> int:
    """`check` (`status`: after the patch's DEP-3 block): print where TARGET stands; the state's exit code."""
    tree = find(target, python)
    patches = check.candidates()  # the carried patch's block; judged as `check` judges, backports too
    with Lock(tree.root, tree.label).held():  # a running write finishes first
        verdict = check.check(tree, patches)
    block = "".join(f"  {key}: {value}\n" for key, value in patches[0].metadata.items())
    say(f"{patches[0].path.name}: {patches[0].headers['Subject']}\n{block}  on {verdict}" if status else str(verdict))
    return verdict.state.code


def verify_command(target: str | None, *, python: str) -> int:
    """`verify`: print whether the model that `python` imports from TARGET receives the batch's loss_mask; 0 if so."""
    tree = find(target, python)
    python = interpreter(python)
    with Lock(tree.root, tree.label).held():  # what a killed run left is read alone; the probe runs unlocked
        if left := journal.left(tree.root, check.touched(tree, check.candidates())):
            raise ToolError(f"{tree.label}: an interrupted run left {left}", Exit.FAILED)
    shown = proven(tree, python, {}, f"{tree.label}: ")  # `; verified with PY: why`, or refused
    say(f"{tree.label}: {shown.removeprefix('; ')}")
    return Exit.OK


def seconds(text: str) -> float:
    if not re.fullmatch(r"\d+(\.\d*)?", text):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return float(text)


TARGET = "the folder holding src/megatron/bridge (a git checkout, a source tree) or megatron/bridge (site-packages)"
TRAINS = "the interpreter that trains (it imports this Megatron-Bridge), for the behaviour probe"
READS = "the interpreter that trains: with no TARGET, its Megatron-Bridge is read (its files, never run)"
COMMANDS = {  # each command's help, and what its --python is for
    "check": ("applies / already applied (or fixed another way) / drifted", READS),
    "apply": ("verify the patch by behaviour, then apply it (all or nothing)", TRAINS),
    "revert": ("take the patch out again (all or nothing): the bytes as before the patch", READS),
    "verify": ("exit 0 only if the batch's loss_mask reaches a model with MTP on", TRAINS),
    "status": ("the patch's DEP-3 block, and whether TARGET still needs the patch", READS),
}


def run(args: argparse.Namespace) -> int:
    if args.command == "apply":
        return apply(args.target, verify=not args.no_verify, python=args.python, wait=args.wait)
    if args.command == "revert":
        return revert(args.target, python=args.python, wait=args.wait)
    if args.command == "verify":
        return verify_command(args.target, python=args.python)
    if args.command == "watch":
        return watch(args.cmd, steps=args.steps, strict=args.strict)
    return report(args.target, python=args.python, status=args.command == "status")


def build_parser() -> argparse.ArgumentParser:
    codes = [f"  {'128+n' if code is Exit.INTERRUPTED else int(code):>5}  {code.meaning}" for code in Exit]
    parser = Parser(
        prog="mtp-mask-fix",
        description=__doc__.split("\n\n")[0],
        epilog="\n".join(["exit codes:", *codes]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.set_defaults(func=run)  # for every command: none sets its own
    parser.commands = parser.add_subparsers(dest="command", parser_class=Parser, required=True)  # maintain reads it
    for name, (help, python) in COMMANDS.items():
        p = parser.commands.add_parser(name, help=help, description=help)
        p.add_argument("target", metavar="TARGET", nargs="?", help=f"{TARGET}; default: what --python imports")
        p.add_argument("--python", metavar="PY", default=sys.executable, help=python)
        if name == "apply":
            p.add_argument("--no-verify", action="store_true", help="skip the behaviour probe before applying")
        if name in ("apply", "revert"):
            wait = f"for another's write (default {WAIT:.0f})"
            p.add_argument("--wait", metavar="SECONDS", type=seconds, default=WAIT, help=wait)
    said = "run CMD as it is: does megatron-core's MTP loss train on what it assumes?"
    p = parser.commands.add_parser("watch", help=said, description=said)
    p.add_argument("--strict", action="store_true", help="stop at the first call against it, naming its caller")
    p.add_argument("--steps", metavar="N", type=int, help="count each process's first N MTP loss calls only")
    p.add_argument("cmd", metavar="CMD", nargs="*", help="after --: the job, e.g. torchrun ... pretrain.py ...")
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> None:
    """Run a command line (maintain/'s too), with one line on stderr and its exit code for any refusal."""
    with guard():  # SIGINT, SIGTERM, SIGHUP: one line and 128+n (apply and revert roll back first)
        try:
            args = (parser or build_parser()).parse_args(argv)  # None: sys.argv[1:]
            sys.exit(int(args.func(args)))  # each command prints its outcome
        except ToolError as exc:
            text, code = str(exc), exc.code
        except subprocess.CalledProcessError as exc:  # a git step the tool did not expect to fail
            reason = (exc.stderr or "").strip().splitlines() or [f"exit {exc.returncode}"]  # git() decodes its output
            text, code = f"{' '.join(map(str, exc.cmd[:2]))} failed: {reason[-1]}", Exit.FAILED
        except OSError as exc:  # apply and revert say what they left themselves: here, nothing was changed
            text, code = f"{exc}; nothing changed", Exit.FAILED
        except Interrupted as exc:  # apply and revert say what they left; a reading command changes nothing
            text, code = f"{exc}: nothing changed", exc.code
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # a refusal's line is printed whole
        print(f"mtp-mask-fix: error: {text}", file=sys.stderr)
    sys.exit(int(code))
