"""Red/green's contract: how each session runs pytest, how a test ended, what a session showed, and what breaks it."""

from dataclasses import dataclass, field
from enum import Enum


GPT_STEP_MODULE = "megatron.bridge.training.gpt_step"  # the module the carried patch changes: its sessions' default
# How each session loads the plugin that records its outcomes, whatever the tree's own configuration.
PYTEST = ("-p", "maintain.redgreen.plugin", "-p", "no:cacheprovider", "-q", "-o", "addopts=", "--strict-markers")


class Outcome(Enum):
    """How a test ended. Only ASSERTION is red (SWE-bench's rule): no other failure proves a test catches the bug."""

    PASSED = "passed"
    ASSERTION = "failed by assertion"
    OTHER_FAILURE = "failed by another exception"
    SETUP_ERROR = "error in setup"
    SKIPPED = "skipped"
    COLLECTION_ERROR = "collection error"
    MISSING = "did not run"  # never recorded: what a run reports for a test it did not see


@dataclass
class Run:
    """A finished session: each test's outcome, those marked `fail_to_pass`, and where its module was imported from."""

    outcomes: dict[str, Outcome]
    marked: set[str]
    module_files: set[str]
    # A collection error's last `E` line; a test's record_property("reason").
    reasons: dict[str, str] = field(default_factory=dict)

    def of(self, nodeid: str) -> Outcome:
        return self.outcomes.get(nodeid, Outcome.MISSING)

    def collection_errors(self) -> list[str]:
        found = [n for n, outcome in self.outcomes.items() if outcome == Outcome.COLLECTION_ERROR]
        return [f"{n}: {self.reasons.get(n, 'collection error')}" for n in found]


def problems(base: Run, patched: Run, fail_to_pass: list[str], pass_to_pass: list[str]) -> list[str]:
    """Everything that breaks the red/green contract; empty means it holds."""
    found = [f"{side}: {e}" for side, run in (("base", base), ("patched", patched)) for e in run.collection_errors()]
    if found:  # every test id would read "did not run"; the collection error says why
        return found

    def unlike(run: Run, side: str, nodeids: list[str], want: Outcome, note: str = "") -> list[str]:
        return [f"{side}: {n} {run.of(n).value}{note}" for n in nodeids if run.of(n) != want]

    return (
        unlike(patched, "patched", fail_to_pass + pass_to_pass, Outcome.PASSED)
        + unlike(base, "base", fail_to_pass, Outcome.ASSERTION, ", not by assertion")
        + unlike(base, "base", pass_to_pass, Outcome.PASSED)
    )
