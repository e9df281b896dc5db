"""mtp-mask-fix: check, apply and gate the Megatron-Bridge #6103 fix on any Megatron-Bridge; prepare the PR.

Exit codes: 0 ok (check: the patch applies, the bug is present) · 2 bad input · 3 already applied ·
4 drifted · 5 a gate or verification failed.
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from mtp_mask_fix.errors import FAILED, USAGE, ToolError


TARGET_HELP = (
    "a Megatron-Bridge git checkout, a source tree holding src/megatron/bridge, a directory holding "
    "megatron/bridge (site-packages), or a PyPI version such as 0.6.2 (default: the pinned release)"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise ToolError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """Subcommands and their options."""
    parser = _Parser(prog="mtp-mask-fix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patch", type=Path, help="the patch to use (default: the first in patches/series)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    check = sub.add_parser("check", help="say whether the patch applies, is already applied, or has drifted")
    check.add_argument("target", nargs="?", help=TARGET_HELP)

    apply = sub.add_parser("apply", help="apply the patch (all or nothing), then verify by behaviour")
    apply.add_argument(
        "target", help=TARGET_HELP.replace(", or a PyPI version such as 0.6.2 (default: the pinned release)", "")
    )
    apply.add_argument("--branch", help="git checkouts: make this branch with `git am -s` (your sign-off)")
    apply.add_argument("--no-verify", action="store_true", help="skip the behaviour probe after applying")
    apply.add_argument("--python", default=sys.executable, help="interpreter that trains, for the probe")

    gate = sub.add_parser("gate", help="red/green on base and patched trees of each target; non-zero on failure")
    gate.add_argument("--release", action="append", help="PyPI release to gate (repeatable; default: all supported)")
    gate.add_argument("--checkout", action="append", type=Path, default=[], help="also gate an upstream checkout")
    gate.add_argument("--checkouts-only", action="store_true", help="gate only the --checkout trees, no release")
    gate.add_argument(
        "--python", default=sys.executable, help="interpreter whose megatron-core matches the targets (e.g. main's)"
    )

    refresh = sub.add_parser("refresh", help="regenerate the patch from an upstream checkout and this repo's tests")
    refresh.add_argument("--upstream", type=Path, required=True, help="Megatron-Bridge git checkout")
    refresh.add_argument("--base", help="upstream commit to rebase on (default: the patch's base-commit)")

    pr = sub.add_parser("pr", help="print the PR title and body, with figures measured by `repro`")
    pr.add_argument("--figures", type=Path, help="figures.json from `repro` (default: measure now)")

    repro = sub.add_parser("repro", help="tiny real MTP model: the report's table before/after, and a plot")
    repro.add_argument("--out", type=Path, default=Path(".work/repro"), help="where figures.json and the PNG go")

    status = sub.add_parser("status", help="the patch's upstream status, and whether TARGET still needs it")
    status.add_argument("target", nargs="?", help=TARGET_HELP)

    sub.add_parser("view", help="write src/.../gpt_step.py = pinned release + patch (and the base beside it)")
    return parser


def run(argv: list[str]) -> int:
    """Run one subcommand; returns its exit code (refusals raise ToolError)."""
    args = build_parser().parse_args(argv)
    from mtp_mask_fix.patch import Patch

    if args.command == "check":
        from mtp_mask_fix.apply import check
        from mtp_mask_fix.targets import resolve

        verdict = check(resolve(args.target), Patch.load(args.patch))
        print(verdict.message)
        return verdict.code
    if args.command == "apply":
        from mtp_mask_fix.apply import apply, make_branch
        from mtp_mask_fix.targets import resolve

        target, patch = resolve(args.target), Patch.load(args.patch)
        print(
            make_branch(target, patch, args.branch)
            if args.branch
            else apply(target, patch, verify=not args.no_verify, python=args.python)
        )
        return 0
    if args.command == "gate":
        from mtp_mask_fix.gate import gate
        from mtp_mask_fix.targets import SUPPORTED_RELEASES

        if args.checkouts_only and not args.checkout:
            raise ToolError("--checkouts-only needs at least one --checkout DIR")
        if shutil.which(args.python) is None:
            raise ToolError(f"--python {args.python}: no such interpreter")
        releases = [] if args.checkouts_only else args.release or list(SUPPORTED_RELEASES)
        return gate(releases, args.checkout, Patch.load(args.patch), args.python)
    if args.command == "status":
        from mtp_mask_fix.apply import check
        from mtp_mask_fix.targets import resolve

        patch = Patch.load(args.patch)
        print(f"{patch.path.name}: {patch.subject}")
        for key, value in patch.metadata().items():
            print(f"  {key}: {value}")
        verdict = check(resolve(args.target), patch)
        print(f"  on {verdict.message}")
        return 0
    if args.command == "refresh":
        from mtp_mask_fix.refresh import refresh

        path, changed = refresh(args.upstream, args.base)
        print(f"{path.name}: {'rewritten' if changed else 'unchanged (byte-identical)'}")
        return 0
    if args.command == "pr":
        from mtp_mask_fix.pr import render_pr

        print(render_pr(args.figures))
        return 0
    if args.command == "repro":
        from mtp_mask_fix.repro import format_table, run_repro

        figures = run_repro(args.out)
        print(format_table(figures))
        print(f"\nwrote {args.out / 'figures.json'} and {args.out / 'mtp_ce_per_position.png'}")
        return 0
    from mtp_mask_fix.view import write_view

    print(write_view())
    return 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one line on stderr for any refusal, and its exit code."""
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except ToolError as exc:
        print(f"mtp-mask-fix: error: {exc}", file=sys.stderr)
        code = exc.code
    except subprocess.CalledProcessError as exc:  # a git step the tool did not expect to fail
        reason = (exc.stderr or "").strip().splitlines() or [f"exit {exc.returncode}"]
        print(f"mtp-mask-fix: error: {' '.join(exc.cmd[:2])} failed: {reason[-1]}", file=sys.stderr)
        code = FAILED
    except KeyboardInterrupt:
        code = USAGE
    sys.exit(code)
