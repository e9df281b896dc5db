"""tests/conftest.py starts the background sessions once the suite is collected. A module whose start fails (the
patch drifted, no network) fails its own tests; it must not end the whole session with an INTERNALERROR, nor keep
the other modules' sessions from starting. A runner started before collection ends with the session."""

from types import ModuleType, SimpleNamespace

import pytest

from maintain.repo import pins, release
from tests import conftest
from tests.support import sessions


def _item(name: str, start_early) -> SimpleNamespace:
    module = ModuleType(name)
    module.start_early = start_early
    return SimpleNamespace(module=module)


def test_a_failing_start_leaves_the_session_and_the_other_starts(monkeypatch):
    monkeypatch.setattr(sessions, "BATCH", sessions.Batch())
    started = []

    def drifted(session):
        raise RuntimeError("the patch does not apply")

    items = [_item("tests.test_a", drifted), _item("tests.test_b", lambda session: started.append("b"))]
    conftest.pytest_collection_finish(SimpleNamespace(items=items, config=None))
    assert started == ["b"]


@pytest.mark.slow  # the runner imports the pinned release first
def test_a_runner_started_early_and_given_no_jobs_ends_with_the_session():
    """A whole tier starts the runner before it collects; a session that then queues no job (red/green deselected)
    still ends it, and it ends cleanly."""
    batch = sessions.Batch()
    batch.warm(release(pins()["megatron-bridge"]).root)
    batch.close()
    assert batch.runner.returncode == 0
