"""Stopping the daemon: SIGTERM/SIGINT exit 0 after publishing every captured event, and leave
no process and no control socket behind."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest

from kvpubd.client import Mirror, Received, Subscriber
from kvpubd.protocol.wire import BlockStored
from tests.daemon import Daemon
from tests.streams import chain_hashes

# Exit statuses on signals: a process.
pytestmark = pytest.mark.daemon_process

BLOCK_SIZE = 16


def control_path(daemon: Daemon) -> Path:
    assert daemon.control_endpoint.startswith("ipc://")
    return Path(daemon.control_endpoint.removeprefix("ipc://"))


def processes_using(config_path: Path) -> list[int]:
    """Pids of live processes whose command line names this daemon's config file."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            status = (entry / "status").read_text()
        except OSError:
            continue
        zombie = any(line.startswith("State:") and "Z" in line for line in status.splitlines())
        if str(config_path).encode() in cmdline.split(b"\0") and not zombie:
            pids.append(int(entry.name))
    return pids


def connect_live(daemon: Daemon, sub: Subscriber) -> list[Received]:
    """Catch up, then store fresh prompts until one batch arrives live (not replayed): from
    then on the SUB socket is connected and subscribed."""
    client = daemon.client()
    received = sub.catch_up()
    deadline = time.monotonic() + 10.0
    try:
        for n in itertools.count():
            assert time.monotonic() < deadline, "the subscriber never received a live batch"
            request_id = f"warm-{n}"
            client.store(request_id, [50_000 + n] * BLOCK_SIZE)
            client.release(request_id)
            batches = sub.receive(0.2)
            received.extend(batches)
            if any(not b.replayed for b in batches):
                return received
    finally:
        client.close()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_publishes_pending_events_and_exits_0(daemon: Daemon, sig: int) -> None:
    """Events captured but not yet published (drain paused) all reach a connected subscriber
    in the last batch before the stream ends; the daemon exits 0 and removes its control
    socket file."""
    prompts = [[i + 1] * (2 * BLOCK_SIZE + 3) for i in range(3)]
    sub = daemon.subscriber(replay_timeout=2.0)
    mirror = Mirror(block_size=BLOCK_SIZE)
    try:
        seen = connect_live(daemon, sub)
        with daemon.client() as client:
            client.pause()
            before = client.stats().ranks[0]
            for i, tokens in enumerate(prompts):
                client.store(f"pending-{i}", tokens)
            after = client.stats().ranks[0]
        # Captured (pending, counted as published blocks) but not sent: seq did not move.
        assert after.seq == before.seq
        assert after.events_pending == len(prompts)
        assert after.blocks_published == before.blocks_published + 2 * len(prompts)
        assert control_path(daemon).exists()

        assert daemon.stop(sig) == 0

        wanted = [chain_hashes(tokens) for tokens in prompts]
        deadline = time.monotonic() + 10.0
        while not seen or seen[-1].seq < before.seq + 1:
            assert time.monotonic() < deadline, "the pending events never arrived"
            seen.extend(sub.receive(0.05))
        # Nothing else arrives after the last batch: the stream has ended.
        assert sub.receive(0.2) == []
    finally:
        sub.close()

    first = before.first_seq  # the run's first batch, its start-up marker
    assert [b.seq for b in seen] == list(range(first, first + len(seen)))
    for received in seen:
        mirror.apply(received.batch.events)
    last = seen[-1]
    assert last.seq == before.seq + 1
    stored = [e.block_hashes for e in last.batch.events if isinstance(e, BlockStored)]
    assert stored == wanted
    assert not control_path(daemon).exists()
    assert processes_using(daemon.config_path) == []


def test_idle_stop_leaves_nothing_behind(daemon: Daemon) -> None:
    """An idle daemon stops with 0 on SIGTERM; afterwards no process of it remains and the
    ipc control socket path is gone."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    assert processes_using(daemon.config_path) == [pid]
    assert control_path(daemon).exists()
    assert daemon.stop(signal.SIGTERM) == 0
    assert processes_using(daemon.config_path) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not control_path(daemon).exists()
