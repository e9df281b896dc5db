"""The suite's background pytest sessions (red/green's base, the wrong-fix variants), batched into one
`maintain.redgreen.client.run_many` call: one warm process imports the third-party stack once and forks every session, two
at a time, instead of one warm process per module. Where a whole tier runs, tests/conftest.py starts that process
before the suite is collected (it imports the pinned release meanwhile); modules add their jobs in `start_early`, and
tests/conftest.py hands it the batch once every module has added its own."""

from pathlib import Path

from maintain.redgreen.client import Job, run_many, start_runner


class Batch:
    def __init__(self):
        self.jobs: list[Job] = []
        self.future = None
        self.runner = None  # start_runner's, where the batch warms before its jobs are known

    def warm(self, bridge_tree: Path) -> None:
        """Start the runner now, warm from `bridge_tree`, the tree the batch's first job tests."""
        self.runner = start_runner(bridge_tree=bridge_tree)

    def add(self, jobs: list[Job]):
        """Queue the jobs; returns a function that waits for the batch and gives these jobs' runs, in order."""
        part = slice(len(self.jobs), len(self.jobs) + len(jobs))
        self.jobs += jobs
        return lambda: self.future.result()[part]

    def start(self, pool) -> None:
        if self.jobs and self.future is None:
            self.future = pool.submit(run_many, list(self.jobs), runner=self.runner)

    def close(self) -> None:
        """End a runner started early that was given no jobs."""
        if self.runner and self.future is None:
            self.runner.communicate("[]")


BATCH = Batch()
