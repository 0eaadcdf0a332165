"""Replays longer than one chunk are streamed across loop turns: complete, in order, end marker
last, also for many clients at once, and the daemon answers control requests after."""

from __future__ import annotations

from kvpubd.client import replay
from kvpubd.daemon.publisher import REPLAY_CHUNK
from kvpubd.protocol.config import rank_endpoint
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.streams import concurrent_replays

BATCHES = 5 * REPLAY_CHUNK + 17


def publish_batches(daemon: Daemon, count: int) -> int:
    """``count`` one-marker batches (resets of an empty cache); returns the last seq."""
    with daemon.client() as client:
        for _ in range(count):
            (marker,) = client.reset().markers
        return marker.seq


def test_long_replay_is_complete_and_ordered(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(events={"buffer_steps": 2 * BATCHES})
    last = publish_batches(daemon, BATCHES)
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    got = replay(endpoint, 0, timeout=20)
    assert [seq for seq, _ in got] == list(range(last + 1))
    # From the middle, too.
    middle = replay(endpoint, last // 2, timeout=20)
    assert [seq for seq, _ in middle] == list(range(last // 2, last + 1))


def test_many_concurrent_replays_all_complete(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(events={"buffer_steps": 2 * BATCHES})
    last = publish_batches(daemon, BATCHES)
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    with daemon.client(timeout=10) as client:
        replays = concurrent_replays(endpoint, 40)
        # After 40 concurrent replays, control requests are still answered.
        assert client.ping().epoch == daemon.epoch
    for got in replays:
        assert got == list(range(last + 1))
