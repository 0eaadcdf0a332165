from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.garbage import gc as zmq_garbage

from tests.daemon import Daemon
from tests.service_thread import ServiceThread

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


def _starter(kind: Callable[[dict[str, dict[str, Any]]], Daemon]) -> Iterator[DaemonFactory]:
    started: list[Daemon] = []

    def start(**overrides: dict[str, Any]) -> Daemon:
        daemon = kind(overrides)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.cleanup()


@pytest.fixture
def start_daemon(request: pytest.FixtureRequest) -> Iterator[DaemonFactory]:
    """``start_daemon(events={...}, cache={...})`` starts a daemon: its service on a thread
    of this process (real sockets, no start-up of a process: tests/service_thread.py), or, for
    a test marked ``daemon_process``, a real ``kvpubd serve`` subprocess (for what only a
    process shows: exit statuses, signals, its log, kill -9, resource limits)."""
    process = request.node.get_closest_marker("daemon_process") is not None
    yield from _starter(Daemon if process else ServiceThread)


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


class _ProcessStarted(AssertionError):
    pass


@pytest.fixture(autouse=True)
def processes_only_where_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that starts a process carries the ``process`` marker, so that the unit loop
    (``pytest -m "not process"``) really starts none: an unmarked one fails at its first."""
    if request.node.get_closest_marker("process") is not None:
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise _ProcessStarted(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.process"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


NOT_UNIT = ("process", "slow", "bench", "long")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("daemon_process") is not None:
            item.add_marker(pytest.mark.process)
        if not any(item.get_closest_marker(name) for name in NOT_UNIT):
            item.add_marker(pytest.mark.unit)
