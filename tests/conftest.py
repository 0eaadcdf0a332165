from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.garbage import gc as zmq_garbage

from tests.daemon import Daemon

DaemonFactory = Callable[..., Daemon]


@pytest.fixture(scope="session", autouse=True)
def private_state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Daemons that tests start with a config of their own keep their seq state files in the
    default directory: a private one, not the user's (daemon subprocesses inherit it)."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = before


@pytest.fixture
def start_daemon() -> Iterator[DaemonFactory]:
    """``start_daemon(events={...}, cache={...})`` starts a real daemon subprocess."""
    started: list[Daemon] = []

    def start(**overrides: dict[str, Any]) -> Daemon:
        daemon = Daemon(overrides)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.cleanup()


@pytest.fixture
def daemon(start_daemon: DaemonFactory) -> Daemon:
    return start_daemon()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close every ZeroMQ context a test left open, its sockets with linger 0: a leaked socket
    with an unsent message would otherwise block the interpreter's exit for ever (a context's
    finaliser waits for its sockets' linger). pyzmq's own garbage-collector thread (which
    frees messages sent without a copy) is stopped first, the way it stops itself: its
    context destroyed under it, the thread aborts the process."""
    zmq_garbage.stop()
    for obj in gc.get_objects():
        if isinstance(obj, zmq.Context) and not obj.closed:
            obj.destroy(linger=0)
