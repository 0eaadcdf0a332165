"""Replays longer than one chunk are streamed across loop turns: complete, in order, end marker
last, also for many clients at once, and the daemon answers control requests after."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from kvpubd.client import replay
from kvpubd.daemon.publisher import Publisher
from kvpubd.daemon.transports.zmq import REPLAY_CHUNK, ZmqTransport
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import END_SEQ, pack_seq
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.streams import asking_process, concurrent_replays, seq_of

BATCHES = 5 * REPLAY_CHUNK + 17
RING_STORES = 600
# Blocks of 4 tokens, 1100 a store: each store goes out at once (FLUSH_BLOCKS) as a batch of
# about 35 kB, under the size pyzmq would send without a copy anyway (about 21 MB in all).
RING_BLOCK_SIZE, RING_STORE_BLOCKS = 4, 1100
IDLE_REPLAYS = 5


def publish_batches(daemon: Daemon, count: int) -> int:
    """``count`` one-marker batches (resets of an empty cache); returns the last seq."""
    with daemon.client() as client:
        for _ in range(count):
            (marker,) = client.reset().markers
        return seq_of(marker)


def local_publisher(
    context: zmq.Context[zmq.Socket[bytes]],
    directory: Path,
    buffer_steps: int,
    max_replays: int = 64,
) -> Publisher[ZmqTransport]:
    """A publisher in this process (no loop runs it unless the test starts one), on ipc."""
    return Publisher.over_zmq(
        context,
        endpoint=f"ipc://{directory}/ev",
        replay_endpoint=f"ipc://{directory}/replay",
        buffer_steps=buffer_steps,
        max_replays=max_replays,
    )


def replayed(publisher: Publisher[ZmqTransport], dealer: zmq.Socket[bytes]) -> list[int]:
    """Pump the publisher (no loop runs here) until the replay's end marker reaches
    ``dealer``; the seqs it got before it."""
    seqs: list[int] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        publisher.transport.handle_replay()
        while dealer.poll(10):
            frames = dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                return seqs
            seqs.append(int.from_bytes(frames[-2], "big"))
    raise AssertionError(f"the replay did not end; got {seqs}")


def test_long_replay_is_complete_and_ordered(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(events={"buffer_steps": 2 * BATCHES})
    last = publish_batches(daemon, BATCHES)
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    got = replay(endpoint, 0, timeout=20)
    first = daemon.first_seq()
    assert [seq for seq, _ in got] == list(range(first, last + 1))
    # From the middle, too.
    half = (first + last) // 2
    middle = replay(endpoint, half, timeout=20)
    assert [seq for seq, _ in middle] == list(range(half, last + 1))


def test_many_concurrent_replays_all_complete(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(events={"buffer_steps": 2 * BATCHES})
    last = publish_batches(daemon, BATCHES)
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    with daemon.client(timeout=10) as client:
        replays = concurrent_replays(endpoint, 40)
        # After 40 concurrent replays, control requests are still answered.
        assert client.ping().epoch == daemon.epoch
    every = list(range(daemon.first_seq(), last + 1))
    for got in replays:
        assert got == every


def test_the_ring_keeps_what_a_replay_in_progress_needs_then_shrinks_back(
    tmp_path: Path,
) -> None:
    """A replay still streaming keeps the batches it has yet to send, beyond buffer_steps;
    once it ended, the next publish brings the ring back to buffer_steps (a replay from 0
    then starts buffer_steps batches back)."""
    context = zmq.Context()
    publisher = local_publisher(context, tmp_path, buffer_steps=4)
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    try:
        for _ in range(4):
            publisher.publish([])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while not publisher.transport.replays_in_progress:  # accepted; no time given to stream it
            publisher.transport.handle_replay(slice_s=0)
        for _ in range(20):
            publisher.publish([])
        assert replayed(publisher, dealer) == list(range(24))  # nothing still needed dropped
        last = publisher.publish([])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert replayed(publisher, dealer) == list(range(last - 3, last + 1))
    finally:
        dealer.close(linger=0)
        publisher.close()
        context.term()


def publish_long_ring(publisher: Publisher[ZmqTransport]) -> None:
    """Batches 0.. of a replay longer than one turn's share (REPLAY_CHUNK): one stays in
    progress across turns."""
    for _ in range(4 * REPLAY_CHUNK):
        publisher.publish([])


def served_beside(
    publisher: Publisher[ZmqTransport],
    reader: zmq.Socket[bytes],
    asked: int,
    held: int,
    refused: int,
) -> None:
    """A flood's ``asked`` requests are read (nothing streamed yet): ``held`` replays in
    progress, ``refused`` requests refused; then ``reader``'s replay from 0 is served whole,
    nothing more refused."""
    transport = publisher.transport
    while transport.replay_requests + transport.replays_refused < asked:
        transport.handle_replay(slice_s=0)  # accepts only
    assert (transport.replays_in_progress, transport.replays_refused) == (held, refused)
    reader.send_multipart([b"", pack_seq(0)])
    assert replayed(publisher, reader) == list(range(4 * REPLAY_CHUNK))
    assert transport.replays_refused == refused


def test_a_peer_that_asks_again_and_again_holds_one_replay_slot(tmp_path: Path) -> None:
    """A peer's new request replaces its replay in progress: one that asks over and over and
    never reads (a flood, or a client retrying) takes one of the max_replays slots, not all,
    and another client is served at once. It once took them all: every other client was
    refused, heard nothing, and waited its whole replay timeout (the soak's follower, 30 s)."""
    context = zmq.Context()
    publisher = local_publisher(context, tmp_path, buffer_steps=8 * REPLAY_CHUNK, max_replays=8)
    flood = context.socket(zmq.DEALER)
    flood.connect(publisher.replay_endpoint)
    reader = context.socket(zmq.DEALER)
    reader.connect(publisher.replay_endpoint)
    try:
        publish_long_ring(publisher)
        for _ in range(10):
            flood.send_multipart([b"", pack_seq(0)])
        served_beside(publisher, reader, asked=10, held=1, refused=0)
    finally:
        flood.close(linger=0)
        reader.close(linger=0)
        publisher.close()
        context.term()


@pytest.mark.process
def test_many_connections_of_one_process_hold_a_share_of_the_replay_slots(
    tmp_path: Path,
) -> None:
    """One address (a host over tcp, a process over ipc) holds at most a quarter of
    max_replays, however many connections it opens: another client is served. Ten
    connections of one process once took all eight slots."""
    context = zmq.Context()
    publisher = local_publisher(context, tmp_path, buffer_steps=8 * REPLAY_CHUNK, max_replays=8)
    flood = asking_process(publisher.replay_endpoint, 10, pack_seq(0))
    reader = context.socket(zmq.DEALER)
    reader.connect(publisher.replay_endpoint)
    try:
        publish_long_ring(publisher)
        served_beside(publisher, reader, asked=10, held=2, refused=8)
    finally:
        flood.kill()
        flood.wait()
        reader.close(linger=0)
        publisher.close()
        context.term()


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.daemon_process
def test_replays_nobody_reads_share_the_rings_memory(start_daemon: DaemonFactory) -> None:
    """Clients that ask for the whole ring and never read: the batches queued for them are the
    ring's own bytes, not a copy each (each such client held a ring's worth of daemon memory,
    and nothing but the connection cap bounded how many there were)."""
    daemon = start_daemon(
        cache={"num_blocks": 4096, "block_size": RING_BLOCK_SIZE},
        events={"buffer_steps": 4096},
    )
    assert daemon.proc is not None
    rng = np.random.default_rng(0)
    with daemon.client() as client:
        for i in range(RING_STORES):
            tokens = rng.integers(1, 60_000, RING_BLOCK_SIZE * RING_STORE_BLOCKS, dtype="<u4")
            client.store(f"r{i}", tokens.tobytes())
            client.release(f"r{i}")
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    ring = sum(len(payload) for _, payload in replay(endpoint, 0, timeout=20))
    before = resident_bytes(daemon.proc.pid)
    context = zmq.Context()
    idle = []
    try:
        for _ in range(IDLE_REPLAYS):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)  # what it is sent stays queued in the daemon
            sock.setsockopt(zmq.RCVBUF, 4096)
            sock.connect(endpoint)
            sock.send_multipart([b"", pack_seq(0)])
            idle.append(sock)
        # Replays take turns: once one that reads has all of it, so have the others.
        assert sum(len(payload) for _, payload in replay(endpoint, 0, timeout=20)) == ring
        grown = resident_bytes(daemon.proc.pid) - before
        assert grown < ring, (grown, ring)
    finally:
        for sock in idle:
            sock.close()
        context.term()


async def test_a_replay_waiting_for_its_snapshot_ends_quietly_when_the_publisher_closes(
    tmp_path: Path,
) -> None:
    """Shutdown while a replay of lost history waits for its snapshot batch: when the batch
    then settles, nothing runs against the closed replay socket (a pump scheduled then raised
    ZMQError tracebacks after the daemon said it had stopped)."""
    loop = asyncio.get_running_loop()
    failures: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: failures.append(context))
    snapshot: asyncio.Future[object] = loop.create_future()  # never built
    context = zmq.Context()
    publisher = local_publisher(context, tmp_path, buffer_steps=2)
    publisher.history.lost_history = lambda: SimpleNamespace(result=snapshot)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        publisher.start()
        for _ in range(5):
            publisher.publish([])  # the ring keeps the last two: seq 0 is lost history
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart([b"", pack_seq(0)])
        deadline = time.monotonic() + 10
        while not publisher.transport.replays_in_progress:
            assert time.monotonic() < deadline, "the replay was never accepted"
            await asyncio.sleep(0.001)
        publisher.close()
        snapshot.cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert failures == []
        assert publisher.transport.replays_in_progress == 0
    finally:
        dealer.close()
        publisher.close()
        context.term()


@pytest.mark.parametrize("framing", ["v026", "legacy"])
async def test_a_replay_from_past_the_last_seq_gets_exactly_the_end_marker(
    tmp_path: Path, framing: str
) -> None:
    """Nothing to send is still answered: the end marker alone, in the framing asked for (a
    client waiting for it would otherwise wait for ever). Asked twice on one connection: the
    second answer comes right after the first, so nothing else was sent in between."""
    context = zmq.Context()
    publisher = Publisher.over_zmq(
        context,
        endpoint=f"ipc://{tmp_path}/ev",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        replay_framing=framing,
        topic="kv@pod@model",
    )
    dealer = context.socket(zmq.DEALER)
    try:
        for _ in range(3):
            publisher.publish([])
        publisher.start()
        dealer.connect(publisher.replay_endpoint)
        end = [b"", END_SEQ, b""] if framing == "legacy" else [b"", b"", END_SEQ, b""]
        for _ in range(2):
            dealer.send_multipart([b"", pack_seq(publisher.last_seq + 1)])
            for _ in range(10_000):  # the loop serves the replay between polls
                if dealer.poll(0):
                    break
                await asyncio.sleep(0.001)
            assert dealer.recv_multipart(zmq.NOBLOCK) == end
    finally:
        dealer.close(linger=0)
        publisher.close()
        context.term()


def test_a_client_with_the_longest_routing_id_is_answered(start_daemon: DaemonFactory) -> None:
    """ZeroMQ allows routing ids of up to 255 bytes; the replay ROUTER's message size limit
    also bounds the handshake that carries the id, so it must leave room for the longest."""
    daemon = start_daemon()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, b"r" * 255)
        sock.connect(rank_endpoint(daemon.replay_endpoint, 0))
        sock.send_multipart([b"", pack_seq(0)])
        assert sock.poll(10_000), "no replay reply"
        frames = sock.recv_multipart()
        while frames[-2] != END_SEQ:
            assert sock.poll(10_000), "the replay stopped before its end marker"
            frames = sock.recv_multipart()
    finally:
        context.destroy(linger=0)


def test_a_request_of_thousands_of_frames_is_dropped_a_slice_per_turn(tmp_path: Path) -> None:
    """One message of 100 000 empty frames to the replay ROUTER: read as one list, it held the
    loop for as long as libzmq took to hand it over and Python to copy it (a million frames,
    2.5 s; a reset waited that long). It is read and dropped a slice of frames per turn, and
    a request behind it is served."""
    from kvpubd.daemon.transports.zmq import REPLAY_ACCEPT, REPLAY_FRAMES

    context = zmq.Context()
    publisher = local_publisher(context, tmp_path, buffer_steps=64)
    flood = context.socket(zmq.DEALER)
    flood.connect(publisher.replay_endpoint)
    reader = context.socket(zmq.DEALER)
    reader.connect(publisher.replay_endpoint)
    try:
        for _ in range(3):
            publisher.publish([])
        flood.send_multipart([b""] * 100_000)
        transport = publisher.transport
        sock = transport.replay
        assert sock is not None
        deadline = time.monotonic() + 10
        while not sock.poll(10):  # the whole message is there (libzmq hands over no part)
            assert time.monotonic() < deadline, "the flood never arrived"
        transport.handle_replay(slice_s=0)
        assert transport._requests.discarding, "one turn read the whole message"
        turns = 1
        while transport._requests.discarding:
            transport.handle_replay(slice_s=0)
            turns += 1
        assert turns >= 100_000 // (REPLAY_ACCEPT * REPLAY_FRAMES)
        reader.send_multipart([b"", pack_seq(0)])
        assert replayed(publisher, reader) == [0, 1, 2]
    finally:
        flood.close(linger=0)
        reader.close(linger=0)
        publisher.close()
        context.term()
