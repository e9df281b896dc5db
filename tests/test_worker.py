"""tinymodel.worker's launcher: the ranks of a run meet, whatever ports the runs started beside it take."""

import socket

import pytest

from maintain.repo import VIEW
from tinymodel import worker


pytestmark = pytest.mark.slow


def test_ranks_meet_though_the_port_a_launcher_would_pick_is_taken(tmp_path, monkeypatch):
    """Another process holds the port a free-port probe returns before rank 0 can bind it (it imports for seconds)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # raising=False: a launcher that picks no free port has none to patch, and passes
        monkeypatch.setattr(worker, "_free_port", lambda: taken.getsockname()[1], raising=False)
        argv = ["call", "--ranks", "2", "--out", str(tmp_path), "--function", "tests.support.meet:ranks", "--arg", ""]
        error = worker._wait(worker._spawn(VIEW, argv, 2, tmp_path), tmp_path, 600)
    assert error is None, error
