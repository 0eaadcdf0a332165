"""upstream.reset_url: each reset asks the engine to clear, on one thread per rank, however the
engine's HTTP server behaves; the reset itself is answered, with its marker, every time."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory
from tests.upstream_router import WAIT_S

RESETS = 40


class StuckEngine:
    """A listening socket that takes connections and never answers (a hung engine), or
    answers each with ``reply`` and closes."""

    def __init__(self, reply: bytes | None = None) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/reset_prefix_cache"
        self.reply = reply
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            if self.reply is None:
                self._held.append(conn)
                continue
            conn.recv(65536)
            conn.sendall(self.reply)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        for conn in self._held:
            conn.close()
        self._listener.close()


@pytest.fixture
def stuck_engine() -> Iterator[StuckEngine]:
    engine = StuckEngine()
    yield engine
    engine.close()


def upstream(url: str, tmp_path: Path) -> dict[str, object]:
    return {"flavour": "vllm", "endpoint": f"ipc://{tmp_path}/no-engine", "reset_url": url}


def engine_reset_threads() -> int:
    return sum(t.name == "kvpubd engine reset" for t in threading.enumerate())


def test_resets_of_a_hung_engine_are_each_answered_and_call_it_on_one_thread(
    start_daemon: DaemonFactory, stuck_engine: StuckEngine, tmp_path: Path
) -> None:
    threads_before = engine_reset_threads()  # other daemons' of this process
    daemon = start_daemon(upstream=upstream(stuck_engine.url, tmp_path))
    with daemon.client() as client:
        seqs = [client.reset().markers[0].seq for _ in range(RESETS)]
    assert None not in seqs
    first = int(seqs[0] or 0)
    assert seqs == list(range(first, first + RESETS))  # each marker at once, in order
    assert engine_reset_threads() - threads_before == 1  # was one per reset, each hung
    assert stuck_engine.accepted <= 1
    daemon.cleanup()  # with the engine still hung: its caller never holds the stop


def test_an_engine_reset_answered_with_no_http_is_one_log_line_per_reset(
    start_daemon: DaemonFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = StuckEngine(reply=b"no http here\r\n\r\n")
    try:
        daemon = start_daemon(upstream=upstream(engine.url, tmp_path))
        with caplog.at_level(logging.WARNING, "kvpubd"), daemon.client() as client:
            for _ in range(3):
                client.reset()
            deadline = time.monotonic() + WAIT_S
            while len(failures(caplog)) < 3:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.01)  # polls what was logged
        assert all("BadStatusLine" in r.getMessage() for r in failures(caplog))
        assert not any(r.exc_info for r in caplog.records)  # one line each, no traceback
    finally:
        engine.close()


def failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "the engine's reset" in r.getMessage()]
