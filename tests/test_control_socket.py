"""The control socket never goes deaf: a reply sent from outside its reader (a store done in
slices, a snapshot) must not leave requests that arrived meanwhile unread.

ZeroMQ signals a socket's FD once per batch of commands, and any send processes that batch: a
send outside the reader can take the signal of a request that just arrived, and the loop
never wakes for it."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import zmq

from tests.conftest import DaemonFactory
from tests.streams import packed_prompt


def request(op: str, number: int, **fields: Any) -> list[bytes]:
    return [b"", msgpack.packb({"op": op, "id": number, **fields})]


@contextmanager
def two_clients(
    endpoint: str, rcvhwm: int = 1000
) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """Two DEALERs on the control socket, each its own long-lived connection; the first
    queues at most ``rcvhwm`` replies unread (1: one unread reply stops its connection)."""
    context = zmq.Context()
    a, b = (context.socket(zmq.DEALER) for _ in range(2))
    a.setsockopt(zmq.RCVHWM, rcvhwm)
    try:
        for sock in (a, b):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        yield a, b
    finally:
        a.close()
        b.close()
        context.term()


def reply_of(sock: zmq.Socket[bytes], timeout_ms: int = 10_000) -> dict[str, Any]:
    assert sock.poll(timeout_ms), "no reply: the control socket went deaf"
    return dict(msgpack.unpackb(sock.recv_multipart()[-1]))


def test_long_lived_clients_stay_answered_beside_sliced_stores(
    start_daemon: DaemonFactory,
) -> None:
    """The way it was seen: client A stores prompts large enough to be done in slices (each
    answered from the store task) while client B, on its own long-lived connection, sends a
    ping or a reset a moment after each; every request of B is answered, every reset's marker
    seq is new."""
    blocks = 600  # over the 512 a store may cover in one step
    daemon = start_daemon(cache={"num_blocks": 2 * blocks})
    rng = random.Random(7)
    with two_clients(daemon.control_endpoint) as (a, b):
        markers: list[int] = []
        for i in range(60):
            tokens = packed_prompt(blocks, seed=i)
            a.send_multipart(request("store", i, request_id=f"r{i}", token_ids=tokens))
            time.sleep(rng.uniform(0, 0.004))  # B's request lands at a varied point of A's store
            op = "reset" if i % 3 == 0 else "ping"
            b.send_multipart(request(op, i, force=True) if op == "reset" else request(op, i))
            answer = reply_of(b)
            assert answer["ok"], answer
            if op == "reset":
                markers.append(answer["markers"][0]["seq"])
            stored = reply_of(a)
            if stored["ok"]:
                a.send_multipart(request("release", i, request_id=f"r{i}"))
                assert reply_of(a)["id"] == i
        assert len(markers) == 20
        assert markers == sorted(set(markers))


def test_long_lived_clients_stay_answered_beside_snapshots(start_daemon: DaemonFactory) -> None:
    """Snapshot replies are put together across loop turns and sent from outside the reader
    too: B's pings beside A's back-to-back snapshots are all answered."""
    blocks = 8000
    daemon = start_daemon(cache={"num_blocks": blocks})
    rng = random.Random(11)
    with two_clients(daemon.control_endpoint) as (a, b):
        tokens = packed_prompt(blocks // 2, seed=1)
        a.send_multipart(request("store", 0, request_id="held", token_ids=tokens))
        assert reply_of(a)["ok"]
        for i in range(1, 100):
            a.send_multipart(request("snapshot", i))
            time.sleep(rng.uniform(0, 0.004))  # B's ping lands at a varied point of the build
            b.send_multipart(request("ping", i))
            assert reply_of(b)["id"] == i
            snapshot = reply_of(a)
            assert snapshot["id"] == i and snapshot["ok"], snapshot


def test_a_client_that_does_not_read_gets_no_second_snapshot_queued(
    start_daemon: DaemonFactory,
) -> None:
    """A client that asks for snapshots without reading them: its next snapshot waits until
    its last reply has left the daemon, so at most one copy of the state is queued for it (a
    client asking again each time the last one was handed to ZeroMQ grew the daemon by a copy
    a request). Once it reads, the waiting request is answered; one more meanwhile is busy."""
    from tests.test_loop_budget import TINY, fill

    blocks = 20_000  # a reply of megabytes: more than the connection's buffers hold
    daemon = start_daemon(cache={**TINY, "num_blocks": blocks + 1024})
    fill(daemon, blocks)
    with two_clients(daemon.control_endpoint, rcvhwm=1) as (slow, other):
        slow.send_multipart(request("ping", 0))
        assert slow.poll(10_000)  # its reply waits unread: the connection is full from here
        slow.send_multipart(request("snapshot", 1))
        # Another client's snapshot shares the build: once it is answered, slow's reply was
        # handed to ZeroMQ too (it is stuck there, unread).
        other.send_multipart(request("snapshot", 2))
        assert reply_of(other, 30_000)["ok"]
        slow.send_multipart(request("snapshot", 3))  # waits for reply 1 to leave
        slow.send_multipart(request("snapshot", 4))  # refused: 3 is waiting
        answers = [reply_of(slow, 30_000) for _ in range(4)]
        assert [a["id"] for a in answers] == [0, 1, 4, 3]
        assert answers[2]["error"]["code"] == "busy"
        assert answers[1]["ok"] and answers[3]["ok"]
        assert len(answers[3]["events"]) == len(answers[1]["events"]) == blocks


def test_a_client_that_reads_late_gets_every_reply_and_nothing_done_unanswered(
    start_daemon: DaemonFactory,
) -> None:
    """A client pipelines more stores than ZeroMQ queues replies for (1000 per connection,
    about 2000 with its own queue and the socket's buffers) and reads them all only then.
    ZeroMQ dropped the replies past that, of stores carried out: the client never learnt
    their blocks and waited for them for good. Now the daemon keeps them, and refuses the
    client's further requests ``busy`` without carrying them out until it reads: every request
    is answered, and each store answered ok is open, no other."""
    count = 4_000
    daemon = start_daemon(cache={"num_blocks": 2 * count}, control={"max_open_requests": count})
    with two_clients(daemon.control_endpoint) as (late, other):
        for number in range(count):
            late.send_multipart(
                request("store", number, request_id=number, token_ids=[number] * 16)
            )
        answers = [reply_of(late) for _ in range(count)]
        assert [a["id"] for a in answers] == list(range(count))
        stored = sum(a["ok"] for a in answers)
        refused = [a["error"]["code"] for a in answers if not a["ok"]]
        assert set(refused) <= {"busy"} and stored + len(refused) == count
        other.send_multipart(request("stats", count))
        (rank,) = reply_of(other)["ranks"]
        assert rank["requests_open"] == stored
        assert not late.poll(100)  # nothing more: one reply per request


def test_a_client_that_connects_again_under_its_identity_is_answered(
    start_daemon: DaemonFactory,
) -> None:
    """A client that sets its identity (an engine restarted while its old connection still
    lingers) and connects again: ZeroMQ kept the first connection under that identity and
    ignored the second, whose requests were never answered, not even once the first closed."""
    daemon = start_daemon()
    context = zmq.Context()
    first, second = (context.socket(zmq.DEALER) for _ in range(2))
    try:
        for sock in (first, second):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, b"engine-0")
        first.connect(daemon.control_endpoint)
        first.send_multipart(request("ping", 1))
        assert reply_of(first)["id"] == 1
        second.connect(daemon.control_endpoint)
        second.send_multipart(request("ping", 2))
        assert reply_of(second)["id"] == 2
    finally:
        first.close()
        second.close()
        context.term()


async def test_a_message_of_thousands_of_frames_is_dropped_a_slice_per_turn(
    tmp_path: Path,
) -> None:
    """One control message of 100 000 empty frames: read whole, it held the loop as long as
    Python took to copy it (a million frames, seconds), a reset's marker with it. It is read
    and dropped a slice of frames per loop turn, and a request behind it is answered."""
    from kvpubd.daemon.control_server import DISCARD_FRAMES
    from tests.loop_turns import started_service, until

    async with started_service(tmp_path) as service:
        control = service.control
        assert control is not None and control.socket is not None
        context = zmq.Context()
        flood, client = (context.socket(zmq.DEALER) for _ in range(2))
        try:
            flood.connect(control.endpoint)
            flood.send_multipart([b""] * 100_000)
            await until(lambda: control._requests.discarding, "the flood being dropped")
            turns = 0
            while control._requests.discarding:
                await asyncio.sleep(0)
                turns += 1
            assert turns >= 100_000 // DISCARD_FRAMES // 2  # many turns, not one
            client.connect(control.endpoint)
            client.send_multipart(request("ping", 1))
            await until(lambda: client.poll(0), "the ping's reply")
            assert msgpack.unpackb(client.recv_multipart()[-1])["id"] == 1
        finally:
            flood.close(linger=0)
            client.close(linger=0)
            context.term()
