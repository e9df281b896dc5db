"""The suite's background pytest sessions (red/green's base, the wrong-fix variants), batched into one
`maintain.redgreen.run_many` call: one warm process imports the third-party stack once and forks every session,
two at a time, instead of one warm process per module. Modules add their jobs in `start_early`; tests/conftest.py
starts the batch once every module has added its own."""

from maintain.redgreen import Job, run_many


class Batch:
    def __init__(self):
        self.jobs: list[Job] = []
        self.future = None

    def add(self, jobs: list[Job]):
        """Queue the jobs; returns a function that waits for the batch and gives these jobs' runs, in order."""
        part = slice(len(self.jobs), len(self.jobs) + len(jobs))
        self.jobs += jobs
        return lambda: self.future.result()[part]

    def start(self, pool) -> None:
        if self.jobs and self.future is None:
            self.future = pool.submit(run_many, list(self.jobs))


BATCH = Batch()
