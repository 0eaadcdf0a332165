"""Replays longer than one chunk are streamed across loop turns: complete, in order, end marker
last, also for many clients at once, and the daemon keeps answering meanwhile."""

from __future__ import annotations

import zmq

from kvpubd.client import replay
from kvpubd.config import rank_endpoint
from kvpubd.publisher import REPLAY_CHUNK
from kvpubd.wire import END_SEQ
from tests.conftest import DaemonFactory
from tests.daemon import Daemon

BATCHES = 5 * REPLAY_CHUNK + 17


def publish_batches(daemon: Daemon, count: int) -> int:
    """``count`` one-marker batches (resets of an empty cache); returns the last seq."""
    with daemon.client() as client:
        for _ in range(count):
            (marker,) = client.reset()
        return marker["seq"]


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
    ctx = zmq.Context()
    dealers = []
    try:
        for _ in range(40):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            dealers.append(dealer)
        # While 40 replays stream, control requests are still answered.
        with daemon.client(timeout=10) as client:
            assert client.ping()["epoch"] == daemon.epoch
        poller = zmq.Poller()
        for dealer in dealers:
            poller.register(dealer, zmq.POLLIN)
        seqs: dict[zmq.Socket, list[int]] = {dealer: [] for dealer in dealers}
        finished: set[zmq.Socket] = set()
        while len(finished) < len(dealers):
            ready = dict(poller.poll(20_000))
            assert ready, f"replays stalled: {len(finished)} of {len(dealers)} finished"
            for dealer in ready:
                while dealer.poll(0):
                    frames = dealer.recv_multipart()
                    assert dealer not in finished, "a frame after the end marker"
                    if frames[-2] == END_SEQ:
                        finished.add(dealer)
                    else:
                        seqs[dealer].append(int.from_bytes(frames[-2], "big"))
        for got in seqs.values():
            assert got == list(range(last + 1))
    finally:
        for dealer in dealers:
            dealer.close()
        ctx.term()
