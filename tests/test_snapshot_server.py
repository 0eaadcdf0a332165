"""The snapshot endpoint's own rules, on real ZeroMQ sockets in this test's loop, with
snapshots the test hands it (when each build finishes, and what it holds, is the test's to
choose): which snapshot answers which request, what a failed build or a client that never
reads costs, and a message of thousands of frames read a slice per turn."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import zmq

from kvpubd.daemon import snapshot as snapshot_module
from kvpubd.daemon.history import History
from kvpubd.daemon.snapshot import Snapshot
from kvpubd.daemon.transports import zmq_snapshot
from kvpubd.daemon.transports.zmq_snapshot import SnapshotEndpoint
from kvpubd.protocol.snapshot_wire import UNAVAILABLE
from tests.loop_turns import until
from tests.streams import asking_process

PUBLISHER_ID = bytes(range(16))
DEADLINE_S = 10.0
_names = itertools.count()


@dataclass
class Job:
    result: asyncio.Future[Snapshot]


@dataclass
class Builds:
    """The rank's snapshot jobs as the test runs them, shared as the pipeline shares them: the
    last one while it builds, or while it holds the state at the last seq published."""

    history: History
    jobs: list[Job] = field(default_factory=list)

    def __call__(self) -> Job:
        last = self.jobs[-1].result if self.jobs else None
        if last is None or (
            last.done()
            and (last.cancelled() or last.exception() or last.result().seq != self.history.last_seq)
        ):
            self.jobs.append(Job(asyncio.get_running_loop().create_future()))
        return self.jobs[-1]


def snapshot_at(seq: int, blocks: int = 1) -> Snapshot:
    """A snapshot of ``blocks`` one-block stores, one chunk per block."""
    chunks = [
        msgspec.msgpack.encode(
            (time.time(), [{"type": "BlockStored", "block_hashes": [seq * 1000 + b]}], 0)
        )
        for b in range(blocks)
    ]
    return Snapshot(seq, blocks, chunks, [memoryview(c) for c in chunks], sum(map(len, chunks)))


@dataclass
class Rig:
    context: zmq.Context[zmq.Socket[bytes]]
    history: History
    builds: Builds
    endpoint: SnapshotEndpoint

    def client(self, kind: int = zmq.REQ) -> zmq.Socket[bytes]:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint.endpoint)
        return sock


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    history = History(publisher_id=PUBLISHER_ID)
    history.send = lambda seq_frame, payload: None
    history.publish([])  # seq 0: something published
    builds = Builds(history)
    # inproc: a reply stays in ZeroMQ's hands until its client reads it.
    endpoint = SnapshotEndpoint(context, history, builds, f"inproc://snapshots-{next(_names)}")
    endpoint.start()
    try:
        yield Rig(context, history, builds, endpoint)
    finally:
        endpoint.close()
        context.destroy(linger=0)


async def reply_of(sock: zmq.Socket[bytes]) -> list[bytes]:
    await until(lambda: sock.poll(0), "a snapshot reply")
    return sock.recv_multipart()


def seq_of(reply: list[bytes]) -> int:
    return int.from_bytes(reply[0], "big", signed=True)


async def test_a_request_is_answered_from_a_snapshot_that_reaches_what_it_saw(rig: Rig) -> None:
    """A build already under way when a request comes may predate the live batch its client
    saw: that request waits for the next build; one the build reaches is answered by it."""
    early = rig.client()
    early.send(b"snapshot")
    await until(lambda: rig.builds.jobs, "a build")  # begun at seq 0
    rig.history.publish([])  # seq 1 goes out while it builds; a client sees it and asks
    late = rig.client()
    late.send(b"snapshot")
    await until(lambda: rig.endpoint.requests == 2, "both requests")

    rig.builds.jobs[0].result.set_result(snapshot_at(0))
    first = await reply_of(early)
    assert (seq_of(first), first[1], len(first)) == (0, PUBLISHER_ID, 3)
    await until(lambda: len(rig.builds.jobs) == 2, "a newer build for the late request")
    assert not late.poll(0)

    rig.builds.jobs[1].result.set_result(snapshot_at(1, blocks=3))
    second = await reply_of(late)
    assert seq_of(second) == 1
    events = [msgspec.msgpack.decode(chunk)[1][0]["block_hashes"] for chunk in second[2:]]
    assert events == [[1000], [1001], [1002]]


async def test_requests_waiting_together_share_one_build(rig: Rig) -> None:
    clients = [rig.client() for _ in range(5)]
    for sock in clients:
        sock.send(b"snapshot")
    await until(lambda: rig.endpoint.requests == 5, "every request")
    rig.builds.jobs[0].result.set_result(snapshot_at(0, blocks=2))
    replies = [await reply_of(sock) for sock in clients]
    assert len(rig.builds.jobs) == 1
    assert {(seq_of(r), len(r)) for r in replies} == {(0, 4)}


async def test_a_snapshot_retired_before_its_waiters_were_answered_is_not_served(
    rig: Rig,
) -> None:
    """The state moves on (seq 1) just as a build finishes, and the snapshot is retired (its
    chunks let go of, as the reaper does) before the endpoint's pump, a loop turn or two
    behind the build's end, reads it: the waiting request is answered from a newer build,
    never with what is left of the retired one."""
    sock = rig.client()
    sock.send(b"snapshot")
    await until(lambda: rig.builds.jobs, "a build")
    rig.history.publish([])  # seq 1 (for the test's builds: the state moved on)
    retired = snapshot_at(0, blocks=2)
    rig.builds.jobs[0].result.set_result(retired)
    while not retired.free_some():  # in this turn: before the pump can run
        pass
    await until(lambda: len(rig.builds.jobs) == 2 or sock.poll(0), "a newer build")
    assert not sock.poll(0), f"answered from a retired snapshot: {sock.recv_multipart()}"
    rig.builds.jobs[1].result.set_result(snapshot_at(1, blocks=3))
    reply = await reply_of(sock)
    assert (seq_of(reply), len(reply)) == (1, 5)


async def test_a_failed_build_answers_unavailable_and_the_next_request_gets_a_new_one(
    rig: Rig,
) -> None:
    sock = rig.client()
    sock.send(b"snapshot")
    await until(lambda: rig.builds.jobs, "a build")
    rig.builds.jobs[0].result.set_exception(RuntimeError("a bug"))
    reply = await reply_of(sock)
    assert (seq_of(reply), reply[1:]) == (UNAVAILABLE, [PUBLISHER_ID])
    assert rig.endpoint.unavailable == 1

    sock.send(b"snapshot")
    await until(lambda: len(rig.builds.jobs) == 2, "a new build")
    rig.builds.jobs[1].result.set_result(snapshot_at(0))
    assert seq_of(await reply_of(sock)) == 0


async def test_clients_that_never_read_cannot_keep_old_snapshots_alive_without_bound(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply in ZeroMQ's hands keeps its snapshot's chunks alive; past PINNED_BYTES of
    those, a request that needs a newer snapshot is told -2 until the old replies are read."""
    old = snapshot_at(0, blocks=4)
    monkeypatch.setattr(zmq_snapshot, "PINNED_BYTES", old.nbytes)
    stalled = rig.client(zmq.DEALER)
    stalled.send_multipart([b"", b"snapshot"])  # and never reads
    await until(lambda: rig.builds.jobs, "a build")
    rig.builds.jobs[0].result.set_result(old)
    await until(lambda: not rig.endpoint._replies, "the stalled client's reply sent")

    rig.history.publish([])  # the state moves on: the next request needs a newer snapshot
    fresh = rig.client()
    fresh.send(b"snapshot")
    await until(lambda: len(rig.builds.jobs) == 2, "a newer build")
    rig.builds.jobs[1].result.set_result(snapshot_at(1))
    refused = await reply_of(fresh)
    assert seq_of(refused) == UNAVAILABLE

    assert seq_of((await reply_of(stalled))[1:]) == 0  # read at last: the old one is let go
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the reply's memory is released by ZeroMQ's own thread, soon after the read
        fresh.send(b"snapshot")
        reply = await reply_of(fresh)
        if seq_of(reply) == 1 or time.monotonic() > deadline:
            break
    assert seq_of(reply) == 1


async def test_a_peer_that_asks_again_and_again_waits_in_one_place(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's new request replaces its request still waiting: one that asks over and over
    while a build runs (a flood, never reading) holds one of the MAX_WAITING places, and a
    client asking after it is answered by the build. It once filled them all, and every
    other request was ignored until its client's timeout."""
    monkeypatch.setattr(zmq_snapshot, "MAX_WAITING", 4)
    flood = rig.client(zmq.DEALER)
    for _ in range(10):
        flood.send_multipart([b"", b"snapshot"])
    sock = rig.client()
    sock.send(b"snapshot")
    endpoint = rig.endpoint
    await until(lambda: endpoint.requests + endpoint.ignored == 11, "every request")
    assert endpoint.ignored == 0
    rig.builds.jobs[0].result.set_result(snapshot_at(0))
    assert seq_of(await reply_of(sock)) == 0
    assert seq_of((await reply_of(flood))[1:]) == 0  # its last request's answer
    await until(lambda: not endpoint._replies, "every reply sent")
    assert not flood.poll(0)  # and no other


@pytest.mark.process
async def test_many_connections_of_one_process_wait_in_a_share_of_the_places(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One address (a host over tcp, a process over ipc) waits in at most a quarter of the
    MAX_WAITING places, however many connections it opens: another client's request waits
    and is answered. Ten connections of one process once took all eight places."""
    monkeypatch.setattr(zmq_snapshot, "MAX_WAITING", 8)
    endpoint = SnapshotEndpoint(rig.context, rig.history, rig.builds, f"ipc://{tmp_path}/snap")
    endpoint.start()
    flood = asking_process(endpoint.endpoint, 10, b"snapshot")
    try:
        sock = rig.context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint.endpoint)
        sock.send(b"snapshot")
        await until(lambda: endpoint.requests + endpoint.ignored == 11, "every request")
        assert (endpoint.requests, endpoint.ignored) == (3, 8)
        rig.builds.jobs[0].result.set_result(snapshot_at(0))
        assert seq_of(await reply_of(sock)) == 0
    finally:
        flood.kill()
        flood.wait()
        endpoint.close()


async def test_a_message_of_thousands_of_frames_is_dropped_a_slice_per_turn(rig: Rig) -> None:
    rig.endpoint.stop()  # pumped by hand below
    flood = rig.client(zmq.DEALER)
    flood.send_multipart([b""] + [b"snapshot"] * 5000)
    sock = rig.client()
    sock.send(b"snapshot")
    server = rig.endpoint.socket
    assert server is not None
    await until(lambda: server.poll(0), "the flood to arrive")

    rig.endpoint._pump()
    assert rig.endpoint._requests.discarding, "one turn read the whole message"
    turns = 1
    while rig.endpoint._requests.discarding:
        rig.endpoint._pump()
        turns += 1
    assert turns >= 5000 // zmq_snapshot.ACCEPT_FRAMES
    while rig.endpoint.requests == 0:
        await until(lambda: server.poll(0), "the request")
        rig.endpoint._pump()
    assert rig.endpoint.ignored == 1
    rig.endpoint.start()
    rig.builds.jobs[0].result.set_result(snapshot_at(0))
    assert seq_of(await reply_of(sock)) == 0


async def test_a_req_that_correlates_its_requests_gets_its_reply(rig: Rig) -> None:
    """REQ_CORRELATE puts a request id before the empty frame, and a REQ behind a proxy has
    the proxy's ids there: the envelope comes back as it came, as ROUTERs answer REQs."""
    sock = rig.client()
    sock.setsockopt(zmq.REQ_CORRELATE, 1)
    sock.setsockopt(zmq.REQ_RELAXED, 1)
    sock.send(b"snapshot")
    await until(lambda: rig.builds.jobs, "a build")
    rig.builds.jobs[0].result.set_result(snapshot_at(0))
    reply = await reply_of(sock)
    assert (seq_of(reply), reply[1]) == (0, PUBLISHER_ID)


def test_a_snapshot_frees_its_chunks_a_step_at_a_time() -> None:
    size = snapshot_module.FREE_STEP_BYTES // 4 + 1  # four of them make one step and a bit
    chunks = [bytes(size) for _ in range(10)]
    snapshot = Snapshot(5, 10, chunks, [memoryview(c)[1:] for c in chunks], 10 * size)
    left = []
    while not snapshot.free_some():
        left.append(len(snapshot.chunks))
        assert len(snapshot.bodies) == len(snapshot.chunks)
    assert left == [6, 2] and snapshot.nbytes == 10 * size  # as built, whatever is left
