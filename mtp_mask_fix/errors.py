"""The exit codes every command of the tool shares, and the one error type for every refusal."""

from enum import IntEnum


class Exit(IntEnum):
    """Exit codes, each with its one meaning for every command (`--help` and README's table come from here)."""

    def __new__(cls, code: int, meaning: str):
        member = int.__new__(cls, code)
        member._value_, member.meaning = code, meaning
        return member

    OK = 0, "done; `check`, `status`: the patch applies (the bug is present); `apply`: fixed (and verified)"
    USAGE = 2, "bad input or environment, refused before any work (read-only, local edits, what check can't tell, ...)"
    ALREADY_APPLIED = 3, "`check`, `status`: already fixed, by this patch or another way; nothing to apply"
    DRIFTED = 4, "the patch no longer applies, or not where the model call gets its arguments: upstream's text changed"
    FAILED = 5, "the probe failed or could not run, an OS error, a killed run's files; `watch` judged no MTP loss call"
    BUSY = 6, "the target's lock was not free within the wait (another process held it): nothing changed"
    UNMASKED = 7, "`watch`: MTP loss trained against its contract: no mask, not the loss's positions, labels shifted"
    JOB_FAILED = 8, "`watch`: the command exited non-zero (its code on the line); no call was against the contract"
    INTERRUPTED = 128, "128 + n: signal n to the tool or `watch`'s command (130 SIGINT, 143 SIGTERM, 137 SIGKILL)"


class ToolError(Exception):
    """A refusal with a one-line reason and an exit code; raised before any file is changed, or saying what was."""

    def __init__(self, message: str, code: Exit = Exit.USAGE):
        super().__init__(message)
        self.code = code
