"""systemd's notify protocol: the real daemon subprocess against a test that plays systemd's
NOTIFY_SOCKET with a real unix datagram socket (a path, or an abstract '@' name)."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpubd.client import replay
from kvpubd.daemon.notify import Notifier, watchdog_interval
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import AllBlocksCleared, decode_batch
from tests.daemon import Daemon, wait_for

WATCHDOG_USEC = 100_000  # pings every 50 ms


class FakeSystemd:
    """The receiving end of NOTIFY_SOCKET: every datagram, parsed into KEY=VALUE maps."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address  # what NOTIFY_SOCKET says
        self.messages: list[dict[str, str]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, BlockingIOError):
            return None
        message = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append(message)
        return message

    def until(
        self, key: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 20.0
    ) -> dict[str, str]:
        """Receive until a message sets ``key``; fail if the daemon exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.receive(0.1)
            if message is not None and key in message:
                return message
            if message is None and proc.poll() is not None:
                break
        raise AssertionError(f"no {key} from the daemon:\n{log.read_text(errors='replace')}")

    def drain(self) -> None:
        while self.receive(0) is not None:
            pass


@pytest.fixture(params=["path", "abstract"])
def fake_systemd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FakeSystemd]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        path = str(tmp_path / "notify")
        sock.bind(path)
        address = path
    else:
        name = f"kvpubd-test-{secrets.token_hex(8)}"
        sock.bind("\0" + name)
        address = "@" + name
    try:
        yield FakeSystemd(sock, address)
    finally:
        sock.close()


def start_serve(daemon: Daemon, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start ``kvpubd serve`` without waiting for it (the test waits for READY=1 instead)."""
    with open(daemon.log_path, "wb") as log:
        daemon.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpubd", "serve", "--config", str(daemon.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return daemon.proc


@pytest.mark.process
def test_ready_watchdog_stopping_in_order(fake_systemd: FakeSystemd) -> None:
    """READY=1 once every socket is bound and the startup marker (the run's first seq) is
    published, then WATCHDOG=1 from the loop every WATCHDOG_USEC / 2, then STOPPING=1 on
    SIGTERM, last."""
    daemon = Daemon()
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_PID", "WATCHDOG_USEC")}
    env.update(NOTIFY_SOCKET=fake_systemd.address, WATCHDOG_USEC=str(WATCHDOG_USEC))
    try:
        proc = start_serve(daemon, env)
        ready = fake_systemd.until("READY", proc, daemon.log_path)
        # At READY every socket is bound: their ipc files exist at this very moment.
        for endpoint in (
            daemon.control_endpoint,
            rank_endpoint(daemon.events_endpoint, 0),
            rank_endpoint(daemon.replay_endpoint, 0),
        ):
            assert Path(endpoint.removeprefix("ipc://")).exists(), endpoint
        assert ready["READY"] == "1"
        assert daemon.control_endpoint in ready["STATUS"]
        with daemon.client() as client:
            assert client.ping().ranks == 1
            first_seq = client.stats().ranks[0].first_seq
        first = replay(rank_endpoint(daemon.replay_endpoint, 0), 0)[0]
        assert first[0] == first_seq
        assert decode_batch(first[1]).events == [AllBlocksCleared()]

        # Watchdog pings keep coming while the daemon runs.
        for _ in range(3):
            assert fake_systemd.until("WATCHDOG", proc, daemon.log_path)["WATCHDOG"] == "1"

        proc.send_signal(signal.SIGTERM)
        assert fake_systemd.until("STOPPING", proc, daemon.log_path)["STOPPING"] == "1"
        assert proc.wait(20) == 0
        fake_systemd.drain()  # the daemon is gone: everything it sent is queued
    finally:
        daemon.cleanup()

    kinds = [
        next(k for k in ("READY", "WATCHDOG", "STOPPING") if k in m) for m in fake_systemd.messages
    ]
    assert kinds[0] == "READY" and kinds[-1] == "STOPPING", kinds
    assert kinds.count("READY") == 1 and kinds.count("STOPPING") == 1, kinds
    assert set(kinds[1:-1]) == {"WATCHDOG"} and len(kinds) >= 5, kinds


@pytest.mark.process
def test_ready_counts_the_ranks_of_worker_processes(fake_systemd: FakeSystemd) -> None:
    """With ranks in worker processes the service holds no pipeline of its own: systemd was
    told "serving 0 rank(s)"."""
    daemon = Daemon({"cache": {"data_parallel_size": 2}, "service": {"rank_processes": "on"}})
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_PID", "WATCHDOG_USEC")}
    env.update(NOTIFY_SOCKET=fake_systemd.address)
    try:
        proc = start_serve(daemon, env)
        ready = fake_systemd.until("READY", proc, daemon.log_path)
        assert ready["STATUS"].startswith("serving 2 rank(s)"), ready
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        daemon.cleanup()


@pytest.mark.process
def test_a_ready_that_could_not_be_sent_is_not_logged_as_sent(tmp_path: Path) -> None:
    """NOTIFY_SOCKET names a path nobody listens on: the daemon warned it cannot notify, and
    then logged "notified systemd: ready" all the same."""
    daemon = Daemon()
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_PID", "WATCHDOG_USEC")}
    env.update(NOTIFY_SOCKET=str(tmp_path / "nobody"))
    try:
        proc = start_serve(daemon, env)
        wait_for(lambda: "ready" in daemon.log(), 20, "the daemon's ready line")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        log = daemon.log()
        assert "cannot notify systemd" in log and "notified systemd: ready" not in log, log
        assert "systemd not told it is ready" in log
    finally:
        daemon.cleanup()


@pytest.mark.process
def test_a_reload_says_reloading_then_ready(fake_systemd: FakeSystemd) -> None:
    """SIGHUP (`systemctl reload`) sent systemd nothing: a reload returned before it was done
    or had failed. RELOADING=1 with the monotonic clock as systemd wants it, then READY=1 once
    the reload is applied."""
    daemon = Daemon()
    env = {k: v for k, v in os.environ.items() if k not in ("WATCHDOG_PID", "WATCHDOG_USEC")}
    env.update(NOTIFY_SOCKET=fake_systemd.address)
    try:
        proc = start_serve(daemon, env)
        fake_systemd.until("READY", proc, daemon.log_path)
        sent = time.monotonic_ns() // 1000
        proc.send_signal(signal.SIGHUP)
        reloading = fake_systemd.until("RELOADING", proc, daemon.log_path)
        assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) >= sent
        ready = fake_systemd.until("READY", proc, daemon.log_path)
        assert ready["READY"] == "1"
        assert "SIGHUP: reloaded" in daemon.log()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        daemon.cleanup()


# -- the protocol pieces, in-process ----------------------------------------------------------


def test_notifier_sends_one_datagram_per_message(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        notifier = Notifier(str(path))
        assert notifier.enabled
        assert notifier.ready("serving")
        assert notifier.watchdog()
        assert notifier.stopping()
        notifier.close()
        sock.settimeout(1)
        assert [sock.recv(4096) for _ in range(3)] == [
            b"READY=1\nSTATUS=serving",
            b"WATCHDOG=1",
            b"STOPPING=1",
        ]


@pytest.mark.parametrize("value", ["", "relative/path", "vsock:2:1234"])
def test_notifier_without_a_usable_socket_does_nothing(value: str) -> None:
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": value} if value else {})
    assert not notifier.enabled
    assert not notifier.ready()


def test_notifier_survives_a_missing_listener(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nobody listens: sending fails, is logged once, and never raises."""
    notifier = Notifier(str(tmp_path / "nobody"))
    with caplog.at_level(logging.WARNING, logger="kvpubd.daemon.notify"):
        assert not notifier.watchdog()
        assert not notifier.watchdog()
    assert len([r for r in caplog.records if "cannot notify" in r.message]) == 1
    notifier.close()


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),  # pid 4242 is us
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4243"}, None),  # another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(
    environ: dict[str, str], expected: float | None
) -> None:
    assert watchdog_interval(environ, pid=4242) == expected
