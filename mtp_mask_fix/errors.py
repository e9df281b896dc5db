"""One error type for every refusal, and the exit codes every command shares."""

from enum import IntEnum


class Exit(IntEnum):
    """Exit codes: the same number means the same thing for every command."""

    OK = 0  # check: the patch applies (the bug is present); every other command: done
    USAGE = 2  # bad input: missing path, not Megatron-Bridge, unknown release, corrupted patch, ...
    ALREADY_APPLIED = 3  # the target holds the fix (this patch or an equivalent one): retire the patch there
    DRIFTED = 4  # the patch no longer applies (or local changes sit in its region)
    FAILED = 5  # a gate, a red/green run or a behaviour check failed


class ToolError(Exception):
    """A refusal with a one-line reason and an exit code; raised before any file is changed."""

    def __init__(self, message: str, code: Exit = Exit.USAGE):
        super().__init__(message)
        self.code = code
