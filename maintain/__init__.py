"""This repo's upkeep, never installed with the tool: the view src/ (`./run view`), the patch as a commit on a branch
of an upstream checkout (`./run branch`) and patches/ rewritten from it (`./run refresh`). Each writes this checkout
or serves only this repo's patch queue, so they run only from it."""

from mtp_mask_fix.signals import say


def printed(run):
    """The command of `run`, which returns what to print and the exit code: it prints that and returns the code."""

    def command(args) -> int:
        text, code = run(args)
        say(text)
        return code

    return command
