"""The daemon's log at the default level: one line per lifecycle step, none per request or
event, however much traffic there is."""

from __future__ import annotations

import re
import signal
from collections.abc import Callable

import msgpack
import pytest
import zmq

from kvpubd.tools.launcher import free_tcp_ports
from tests.daemon import Daemon, wait_for, write_config
from tests.streams import prompt

# The daemon's own log lines and journal priorities: a process.
pytestmark = pytest.mark.daemon_process

StartDaemon = Callable[..., Daemon]


def test_one_line_per_lifecycle_step(start_daemon: StartDaemon) -> None:
    port = free_tcp_ports(1)[0]
    daemon = start_daemon(service={"log_level": "info"}, metrics={"port": port})
    with daemon.client() as client:
        for i in range(200):
            client.store(f"r{i}", prompt(i, 2))
            client.release(f"r{i}")
        client.reset()
        client.pause()
        client.resume()
    assert daemon.stop() == 0
    lines = [re.sub(r"^\S+ \S+ ", "", line) for line in daemon.log().splitlines()]
    expected = [
        r"INFO kvpubd: kvpubd \S+: config \S+kvpubd\.toml",
        r"INFO kvpubd: rank 0: no earlier run in \S+\.seq: seqs start at 0",
        r"INFO kvpubd: rank 0: events on ipc://\S+_dp0, replay on ipc://\S+_dp0",
        rf"INFO kvpubd: metrics on http://127\.0\.0\.1:{port}/metrics",
        r"INFO kvpubd: ready: 1 rank\(s\), 256 blocks of \d+ bytes each, "
        r"control on ipc://\S+, fd limit \d+",
        r"INFO kvpubd: reset rank\(s\) 0 in \d+ us: markers 0:\d+",
        r"INFO kvpubd: periodic drain paused",
        r"INFO kvpubd: periodic drain resumed",
        r"INFO kvpubd: shutdown requested",
        r"INFO kvpubd: stopped",
    ]
    assert len(lines) == len(expected), "\n".join(lines)
    for line, pattern in zip(lines, expected, strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)


def test_journal_priorities_and_sighup_reload(
    start_daemon: StartDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under systemd (JOURNAL_STREAM set) every line starts with its syslog priority, so
    `journalctl -p warning` can filter. SIGHUP re-reads the config: the log level applies at
    once, other changes are named as needing a restart, a broken config changes nothing; the
    daemon keeps running (before, SIGHUP killed it without a word)."""
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    daemon = start_daemon(service={"log_level": "info"})
    assert daemon.proc is not None

    def dropped_a_message() -> None:  # a line the daemon logs at debug only
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.control_endpoint)
        try:
            sock.send(b"no delimiter")
            # On the same connection, so served after the message above (messages on two
            # connections may be read in either order): its reply means that one was handled.
            sock.send_multipart([b"", msgpack.packb({"op": "ping", "id": 1})])
            assert sock.poll(10_000), "no reply to the ping behind the dropped message"
            assert msgpack.unpackb(sock.recv_multipart()[-1])["ok"]
        finally:
            sock.close()

    dropped_a_message()
    settings = {section: dict(values) for section, values in daemon.settings.items()}
    settings["service"]["log_level"] = "debug"
    settings["events"]["hwm"] = 7
    write_config(daemon.config_path, settings)
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "restart the daemon to apply" in daemon.log(), what="the reload's lines")
    dropped_a_message()
    wait_for(lambda: "dropped a message" in daemon.log(), what="a debug line")

    daemon.config_path.write_text("[service\n")
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "nothing reloaded" in daemon.log(), what="the refused reload")
    assert daemon.alive()
    assert daemon.stop() == 0

    lines = daemon.log().splitlines()
    assert all(re.match(r"<[2-7]>[A-Z]+ ", line) for line in lines), lines
    assert "<6>INFO kvpubd: SIGHUP: reloaded log level debug" in lines
    assert "<4>WARNING kvpubd: SIGHUP: events.hwm changed; restart the daemon to apply" in lines
    assert any(
        re.fullmatch(r"<3>ERROR kvpubd: SIGHUP: config error: .*; nothing reloaded", line)
        for line in lines
    ), lines
    debug = [line for line in lines if "dropped a message" in line]
    assert len(debug) == 1 and debug[0].startswith("<7>DEBUG "), debug  # after the reload only
    assert lines[-1] == "<6>INFO kvpubd: stopped"
