from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.daemon import Daemon

DaemonFactory = Callable[..., Daemon]


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
