"""One error type for every refusal: the CLI prints its message as one line and exits with its code."""

USAGE = 2  # bad input: missing path, not Megatron-Bridge, unsupported version, corrupted patch, ...
ALREADY_APPLIED = 3  # check/apply: the target already holds the fix
DRIFTED = 4  # check/apply: the patch no longer applies (or local changes sit in its region)
FAILED = 5  # gate/apply verification: the fix did not behave as required


class ToolError(Exception):
    """A refusal with a one-line reason and an exit code; raised before any file is changed."""

    def __init__(self, message: str, code: int = USAGE):
        super().__init__(message)
        self.code = code
