"""The client library facing a peer that sends what no kvpubd sends: values nested deeper than
msgspec decodes (it raises RecursionError, not a DecodeError). Each is one unusable message,
counted or ignored; none escapes from the client's calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from kvpubd.client.control import ControlClient
from kvpubd.client.subscriber import MAX_RESTARTS_PER_CALL, Subscriber
from kvpubd.client.tracker import Snapshot, StreamTracker, SubscriberError
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import AllBlocksCleared, BlockStored, Event, EventBatch, pack_seq

WAIT_S = 10.0
# A value nested 2000 arrays deep: past msgspec's limit, a couple of kilobytes.
DEEP = b"\x91" * 2000 + b"\x01"


def store(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, [1, 2], 2, None, "GPU", None)


def test_a_batch_nested_too_deep_is_counted_malformed_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    """A live batch whose event carries ``extra_keys`` nested 2000 deep: it raised
    RecursionError out of ``receive`` (and again at every later repair that replayed it)."""
    endpoint = f"ipc://{tmp_path}/pub"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(rank_endpoint(endpoint, 0))
    good = msgspec.msgpack.encode(EventBatch(1.0, [store(1)], 0))
    # [ts, [{"type": "BlockStored", "extra_keys": DEEP}], rank]
    head = [b"\x93", msgpack.packb(1.0), b"\x91\x82", msgpack.packb("type")]
    tail = [msgpack.packb("BlockStored"), msgpack.packb("extra_keys"), DEEP, msgpack.packb(0)]
    poisoned = b"".join(head + tail)
    subscriber = Subscriber(endpoint, context=context)
    try:
        deadline = time.monotonic() + WAIT_S
        received: list[int] = []
        seq = 0
        while not received:  # joined once a good batch comes through
            assert time.monotonic() < deadline, "never joined"
            pub.send_multipart([b"", pack_seq(seq), good])
            seq += 1
            received += [r.seq for r in subscriber.receive(0.05)]
        pub.send_multipart([b"", pack_seq(seq), poisoned])
        pub.send_multipart([b"", pack_seq(seq + 1), good])
        after: list[int] = []
        while seq + 1 not in after:
            assert time.monotonic() < deadline, "the batch after the poisoned one never came"
            after += [r.seq for r in subscriber.receive(0.05)]
        assert seq not in after
        assert subscriber.tracker.streams[0].counters.malformed == 1
    finally:
        subscriber.close()
        pub.close(linger=0)
        context.term()


@contextmanager
def answering_router(
    tmp_path: Path, answer: Callable[[dict[str, Any]], list[bytes]]
) -> Iterator[str]:
    """A control socket (a ROUTER on its own thread) that answers each request with the frames
    ``answer(request)`` gives, each sent as a reply of its own."""
    endpoint = f"ipc://{tmp_path}/ctl"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(20):
                continue
            identity, _, frame = router.recv_multipart()
            for reply in answer(msgpack.unpackb(frame)):
                router.send_multipart([identity, b"", reply])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        stop.set()
        thread.join(WAIT_S)
        router.close(linger=0)
        context.term()


def deep_then_ping_reply(request: dict[str, Any]) -> list[bytes]:
    """A frame nested too deep, then the real reply to a ping."""
    reply = {"id": request["id"], "ok": True, "version": "0", "epoch": 1, "ranks": 1}
    return [DEEP, msgpack.packb({**reply, "endpoints": []})]


def two_runs(request: dict[str, Any]) -> list[bytes]:
    """Pings of one daemon run (epoch 1) and snapshots of another (epoch 2), every time: a
    buggy daemon, or a proxy in front of two."""
    if request["op"] == "ping":
        return [msgpack.packb({"id": request["id"], "ok": True, "epoch": 1, "ranks": 1})]
    reply = {"id": request["id"], "ok": True, "seq": 10, "epoch": 2, "events": []}
    return [msgpack.packb(reply)]


def test_a_reply_nested_too_deep_is_ignored_by_the_control_client(tmp_path: Path) -> None:
    """Any frame on the client's socket is looked at as a possible reply: one nested too
    deep raised RecursionError out of ``ping`` (and out of store and reset alike)."""
    with (
        answering_router(tmp_path, deep_then_ping_reply) as endpoint,
        ControlClient(endpoint, timeout=WAIT_S) as client,
    ):
        assert client.ping().epoch == 1


def test_answers_that_contradict_each_other_for_good_end_the_call(tmp_path: Path) -> None:
    """Each snapshot of another run than the ping's restarted the subscriber, which pinged
    again: ``catch_up`` spun for ever. It gives up with SubscriberError after a bound."""
    with (
        answering_router(tmp_path, two_runs) as endpoint,
        Subscriber(f"ipc://{tmp_path}/pub", control=endpoint) as subscriber,
    ):
        with pytest.raises(SubscriberError, match="contradict"):
            subscriber.catch_up()
        assert subscriber.tracker.counters().restarts == MAX_RESTARTS_PER_CALL + 1


def batch(*events: Event) -> bytes:
    return msgspec.msgpack.encode(EventBatch(1.0, list(events), 0))


def test_history_proven_lost_leaves_the_stream_unsynced_until_its_snapshot_comes() -> None:
    """Replay shows seqs 102-103 gone; the snapshot that would repair it times out, or comes
    back unusable. ``synced`` said True meanwhile (a router trusting it routed on a mirror
    missing those batches), and the unusable reply dropped the snapshot request for good."""
    for failure in ("timeout", "unusable"):
        tracker = StreamTracker([0], replay=True, control=True)
        tracker.on_ping({"epoch": 7, "ranks": 1})
        tracker.on_replay(0, 0, [(100, batch(AllBlocksCleared())), (101, batch(store(1)))])
        tracker.on_live(0, [b"", pack_seq(105), batch(store(5))])  # 102-104 missing
        tracker.on_ping({"epoch": 7, "ranks": 1})
        tracker.on_replay(0, 101, [(101, batch(store(1))), (104, batch(store(4)))])
        assert tracker.next_request() == Snapshot(0)
        assert not tracker.streams[0].synced
        if failure == "timeout":
            tracker.on_timeout()
        else:
            with pytest.raises(SubscriberError, match="unusable"):
                tracker.on_snapshot(0, {"seq": "x", "epoch": 7, "events": []})
        assert not tracker.streams[0].synced
        if tracker.next_request() != Snapshot(0):  # a timeout: the epoch is checked first
            tracker.on_ping({"epoch": 7, "ranks": 1})
        assert tracker.next_request() == Snapshot(0)  # still asked


def test_a_replay_answer_past_its_byte_budget_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay socket that streams batches with no end marker: the answer was kept whole for
    up to six replay timeouts (a gigabyte in seconds). Past MAX_REPLAY_BYTES it is given up."""
    from kvpubd.client import subscriber as subscriber_module

    monkeypatch.setattr(subscriber_module, "MAX_REPLAY_BYTES", 1 << 20)
    endpoint = f"ipc://{tmp_path}/replay"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(endpoint)
    payload = msgspec.msgpack.encode(EventBatch(1.0, [store(i) for i in range(2_000)], 0))
    stop = threading.Event()

    def stream() -> None:  # 4 MiB of batches, then silence: no end marker
        if not router.poll(int(WAIT_S * 1000)):
            return
        identity = router.recv_multipart()[0]
        sent = seq = 0
        while sent < 4 << 20 and not stop.is_set():
            router.send_multipart([identity, b"", b"", pack_seq(seq), payload])
            sent += len(payload)
            seq += 1

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    try:
        with pytest.raises(subscriber_module.ReplayTooLarge):
            subscriber_module.replay(endpoint, 0, timeout=WAIT_S, context=context)
    finally:
        stop.set()
        thread.join(WAIT_S)
        router.close(linger=0)
        context.term()
