"""The daemon's log at the default level: one line per lifecycle step, none per request or
event, however much traffic there is."""

from __future__ import annotations

import re
from collections.abc import Callable

from kvpubd.tools.launcher import free_tcp_ports
from tests.daemon import Daemon
from tests.streams import prompt

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
        r"INFO kvpubd: rank 0: events on ipc://\S+_dp0, replay on ipc://\S+_dp0",
        rf"INFO kvpubd: metrics on http://127\.0\.0\.1:{port}/metrics",
        r"INFO kvpubd: ready: 1 rank\(s\), 256 blocks of \d+ bytes each, control on ipc://\S+",
        r"INFO kvpubd: reset rank\(s\) 0 in \d+ us: markers 0:\d+",
        r"INFO kvpubd: periodic drain paused",
        r"INFO kvpubd: periodic drain resumed",
        r"INFO kvpubd: shutdown requested",
        r"INFO kvpubd: stopped",
    ]
    assert len(lines) == len(expected), "\n".join(lines)
    for line, pattern in zip(lines, expected, strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)
