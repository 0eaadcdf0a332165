"""Garbage at the replay socket and hundreds of concurrent replay clients: the daemon stays up,
answers well-formed requests correctly afterwards, and its stream keeps the invariants."""

from __future__ import annotations

import os

import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpubd.client import Mirror, replay
from kvpubd.daemon.transports.zmq import REPLAY_CHUNK
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import AllBlocksCleared, decode_batch
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.mirrors import snapshot_blocks
from tests.streams import BLOCK_SIZE, concurrent_replays, prompt

frames_strategy = st.lists(st.binary(max_size=64), min_size=0, max_size=5)


def send_garbage(endpoint: str, messages: list[list[bytes]]) -> None:
    ctx = zmq.Context()
    try:
        for kind in (zmq.DEALER, zmq.REQ):
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            for frames in messages:
                if kind == zmq.REQ:
                    # A REQ sends one request and must read before the next: one only.
                    if frames:
                        sock.send_multipart(frames)
                    break
                sock.send_multipart(frames or [b""])
            sock.close()
    finally:
        ctx.term()


def check_stream(daemon: Daemon, endpoint: str) -> None:
    """Replay from 0 is gap-free and rebuilds the snapshot."""
    with daemon.client() as client:
        snapshot = client.snapshot()
    batches = replay(endpoint, 0, timeout=20)
    # The run's first batch (its start marker) is still retained: replay starts there.
    origin = batches[0][0]
    assert decode_batch(batches[0][1]).events == [AllBlocksCleared()]
    assert [seq for seq, _ in batches] == list(range(origin, snapshot.seq + 1))
    mirror = Mirror(BLOCK_SIZE)
    for _, payload in batches:
        mirror.apply(decode_batch(payload).events)
    # Which blocks, with their parents, tokens and LoRA fields: the stream is the snapshot.
    assert mirror.blocks == snapshot_blocks(snapshot)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=st.lists(frames_strategy, min_size=1, max_size=20))
def test_garbage_at_the_replay_socket(daemon: Daemon, messages: list[list[bytes]]) -> None:
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    messages.append([b"", os.urandom(300)])  # over the socket's size cap: the peer is dropped
    send_garbage(endpoint, messages)
    with daemon.client() as client:
        request_id = f"fence-{len(messages)}-{os.urandom(4).hex()}"
        client.store(request_id, prompt(len(messages), 2))
        client.release(request_id)
    assert daemon.alive()
    check_stream(daemon, endpoint)


def test_hundreds_of_concurrent_replay_clients(start_daemon: DaemonFactory) -> None:
    # 32 replays at once (half the default), each far longer than a turn's share (REPLAY_CHUNK):
    # a replay is still streaming when the next requests are read, so some are refused
    # however the clients' requests happen to arrive.
    daemon = start_daemon(events={"max_replays": 32})
    with daemon.client() as client:
        for i in range(50):
            client.store(f"r{i}", prompt(1000 + i, 2))
            client.release(f"r{i}")
            for _ in range(6):
                client.reset()  # a batch of its own, at once
        last = client.snapshot().seq
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    origin = replay(endpoint, 0, timeout=20)[0][0]
    assert last - origin > 4 * REPLAY_CHUNK
    for got in concurrent_replays(endpoint, 300, attempt_timeout=0.2):
        assert got == list(range(origin, last + 1))
    assert daemon.alive()
    with daemon.client() as client:
        # More clients than max_replays: some were refused, asked again and were served.
        assert client.stats().ranks[0].replays_refused > 0
    check_stream(daemon, endpoint)
