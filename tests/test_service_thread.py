"""The in-process daemon of the tests ends as `kvpubd serve` would: a dead background task
makes its stop report a failure, as the process exits non-zero."""

from __future__ import annotations

import pytest

from tests.daemon import wait_for
from tests.service_thread import ServiceThread


def test_a_dead_background_task_makes_stop_report_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = ServiceThread({"events": {"tick_interval_ms": 5}}).start()
    try:
        assert daemon.service is not None
        pipeline = daemon.service.pipelines[0]

        def broken() -> None:
            raise RuntimeError("compaction broke")

        # The drain loop's next tick raises: the service stops, as the daemon process would.
        monkeypatch.setattr(pipeline, "compact", broken)
        wait_for(lambda: not daemon.alive(), what="the service to stop on its own")
        assert daemon.stop() == 1
    finally:
        daemon.cleanup()


def test_a_clean_stop_reports_success() -> None:
    daemon = ServiceThread().start()
    try:
        with daemon.client() as client:
            client.ping()
        assert daemon.stop() == 0
    finally:
        daemon.cleanup()
