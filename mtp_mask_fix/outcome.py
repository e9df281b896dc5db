"""How one test ended. Only ASSERTION counts as red (SWE-bench's rule): an import or collection error, a
failed setup, another exception or a skip never proves that a test catches the bug."""

from enum import Enum


class Outcome(Enum):
    """One test's ending, as the recorder plugin saw it."""

    PASSED = "passed"
    ASSERTION = "failed by assertion"
    OTHER_FAILURE = "failed by another exception"
    SETUP_ERROR = "error in setup"
    SKIPPED = "skipped"
    COLLECTION_ERROR = "collection error"
    MISSING = "did not run"
