"""The protocol-only snapshot consumer (tests/snapshot_consumer.py) against a publisher built
by hand in the test: a PUB and a ROUTER socket whose every frame the test writes, so each step
of the consumer procedure (buffering, the reply's checks, following, the three reasons to
bootstrap again) is driven exactly. Time is a fake clock the test moves: no sleeps."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from tests.daemon import wait_for
from tests.snapshot_consumer import BOOTSTRAPPING, IDLE, Block, SnapshotConsumer

BLOCK_SIZE = 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(hashes: list[int], parent: int | None, first_token: int = 1) -> dict[str, Any]:
    tokens = list(range(first_token, first_token + BLOCK_SIZE * len(hashes)))
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def chunk(*events: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb([time.time(), list(events), 0])
    return packed


class HandPublisher:
    """One rank's live PUB and snapshot ROUTER; seqs start at 40 (never assume 0)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvc", dir="/tmp")
        self.events_endpoint = f"ipc://{self.dir}/events"
        self.snapshot_endpoint = f"ipc://{self.dir}/snapshot"
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind(self.events_endpoint)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind(self.snapshot_endpoint)
        self.publisher_id = os.urandom(16)
        self.next_seq = 40

    def publish(
        self,
        events: list[Any],
        *,
        seq: int | None = None,
        publisher_id: bytes | None = None,
        with_id: bool = True,
    ) -> int:
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        payload: list[Any] = [time.time(), events, 0]
        if with_id:
            payload.append(publisher_id or self.publisher_id)
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb(payload)])
        return seq

    def request(self, consumer: SnapshotConsumer) -> bytes:
        """The next snapshot request (the consumer stepped meanwhile); its REQ's identity."""

        def arrived() -> bool:
            consumer.step(0.005)
            return bool(self.router.poll(0))

        wait_for(arrived, what="a snapshot request")
        identity, delimiter, body = self.router.recv_multipart()
        assert (delimiter, body) == (b"", b"snapshot")
        return identity

    def reply(self, identity: bytes, *frames: bytes) -> None:
        self.router.send_multipart([identity, b"", *frames])

    def snapshot(
        self, identity: bytes, seq: int, *chunks: bytes, publisher_id: bytes | None = None
    ) -> None:
        seq_frame = seq.to_bytes(8, "big", signed=True)
        self.reply(identity, seq_frame, publisher_id or self.publisher_id, *chunks)

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.context.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def publisher() -> Iterator[HandPublisher]:
    publisher = HandPublisher()
    yield publisher
    publisher.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def consumer(publisher: HandPublisher, clock: FakeClock) -> Iterator[SnapshotConsumer]:
    with SnapshotConsumer(
        publisher.events_endpoint, publisher.snapshot_endpoint, silence_s=5.0, clock=clock
    ) as consumer:
        yield consumer


def hear(publisher: HandPublisher, consumer: SnapshotConsumer) -> int:
    """Heartbeat until the consumer buffered one (the SUB is connected); returns its seq."""
    seqs: list[int] = []

    def heard() -> bool:
        seqs.append(publisher.publish([]))
        consumer.step(0.005)
        return consumer.state != IDLE

    wait_for(heard, what="the consumer to hear a heartbeat")
    return seqs[-1]


def buffer_live(publisher: HandPublisher, consumer: SnapshotConsumer, events: list[Any]) -> int:
    before = consumer.buffered
    seq = publisher.publish(events)
    consumer.run_until(lambda: consumer.buffered > before, what=f"seq {seq} buffered")
    return seq


def follow(
    publisher: HandPublisher, consumer: SnapshotConsumer, *chunks: bytes
) -> tuple[int, bytes]:
    """Bootstrap onto a snapshot made of ``chunks`` at the heard seq; (that seq, REQ id)."""
    seq = hear(publisher, consumer)
    identity = publisher.request(consumer)
    publisher.snapshot(identity, seq, *chunks)
    consumer.run_until(lambda: consumer.ready, what="ready")
    return seq, identity


def live(publisher: HandPublisher, consumer: SnapshotConsumer, events: list[Any]) -> int:
    before = consumer.counters.applied_batches
    seq = publisher.publish(events)
    consumer.run_until(lambda: consumer.counters.applied_batches > before, what=f"seq {seq}")
    return seq


def test_bootstrap_applies_the_snapshot_then_the_buffered_batches_then_live(
    publisher: HandPublisher, consumer: SnapshotConsumer
) -> None:
    heard = hear(publisher, consumer)
    identity = publisher.request(consumer)
    # Published while the request waits: buffered, then applied on top of the snapshot.
    after = buffer_live(publisher, consumer, [stored([3], 2, first_token=5)])
    publisher.snapshot(identity, heard, chunk(stored([1], None)), chunk(stored([2], 1, 3)))
    consumer.run_until(lambda: consumer.ready, what="ready")
    assert consumer.next_seq == after + 1
    assert consumer.parents() == {1: None, 2: 1, 3: 2}
    assert consumer.index[3] == Block(
        parent=2, token_ids=(5, 6), block_size=2, lora_id=None, medium="GPU"
    )
    live(publisher, consumer, [removed([3]), stored([4, 5], 2, first_token=7)])
    assert consumer.parents() == {1: None, 2: 1, 4: 2, 5: 4}
    assert consumer.index[5].token_ids == (9, 10)
    live(publisher, consumer, [{"type": "AllBlocksCleared"}])
    assert consumer.index == {}
    counters = consumer.counters
    assert (counters.bootstraps, counters.last_snapshot_seq) == (1, heard)
    assert (counters.last_snapshot_chunks, counters.applied_batches) == (2, 3)
    assert consumer.violations == []


def test_buffered_batches_the_snapshot_covers_are_dropped(
    publisher: HandPublisher, consumer: SnapshotConsumer
) -> None:
    hear(publisher, consumer)
    identity = publisher.request(consumer)
    covered = buffer_live(publisher, consumer, [stored([1], None)])
    publisher.snapshot(identity, covered, chunk(stored([1], None)))
    consumer.run_until(lambda: consumer.ready, what="ready")
    assert (consumer.parents(), consumer.next_seq) == ({1: None}, covered + 1)
    assert consumer.counters.applied_batches == 0
    assert consumer.violations == []


def test_an_empty_cache_is_a_snapshot_without_chunks(
    publisher: HandPublisher, consumer: SnapshotConsumer
) -> None:
    seq, _ = follow(publisher, consumer)
    assert (consumer.index, consumer.next_seq, consumer.counters.last_snapshot_chunks) == (
        {},
        seq + 1,
        0,
    )


def test_duplicates_are_ignored_and_a_gap_bootstraps_again(
    publisher: HandPublisher, consumer: SnapshotConsumer
) -> None:
    seq, _ = follow(publisher, consumer, chunk(stored([1], None)))
    publisher.publish([stored([9], None)], seq=seq)  # already covered
    live(publisher, consumer, [stored([2], 1)])
    assert consumer.counters.duplicates == 1
    assert consumer.parents() == {1: None, 2: 1}
    publisher.publish([stored([3], 2)], seq=seq + 3)  # seq + 2 never came
    consumer.run_until(lambda: consumer.state == BOOTSTRAPPING, what="a gap")
    assert consumer.counters.resyncs == {"gap": 1}
    assert consumer.index == {}  # unavailable until the next snapshot
    identity = publisher.request(consumer)
    publisher.snapshot(identity, seq + 3, chunk(stored([1], None)), chunk(stored([3], 1)))
    consumer.run_until(lambda: consumer.ready, what="ready again")
    assert consumer.parents() == {1: None, 3: 1}
    assert consumer.counters.bootstraps == 2


def test_a_new_publisher_id_bootstraps_again_from_its_message(
    publisher: HandPublisher, consumer: SnapshotConsumer
) -> None:
    follow(publisher, consumer, chunk(stored([1], None)))
    publisher.publisher_id = os.urandom(16)  # a restart: seqs continue
    restarted = publisher.publish([{"type": "AllBlocksCleared"}])
    consumer.run_until(lambda: consumer.state == BOOTSTRAPPING, what="the new id")
    assert consumer.counters.resyncs == {"identity": 1}
    identity = publisher.request(consumer)
    publisher.snapshot(identity, restarted)
    consumer.run_until(lambda: consumer.ready, what="ready on the new run")
    assert consumer.publisher_id == publisher.publisher_id
    assert (consumer.index, consumer.next_seq) == ({}, restarted + 1)


def test_silence_makes_the_state_unavailable(
    publisher: HandPublisher, consumer: SnapshotConsumer, clock: FakeClock
) -> None:
    follow(publisher, consumer, chunk(stored([1], None)))
    clock.now += 4.9
    consumer.step(0)
    assert consumer.ready
    clock.now += 0.1
    consumer.step(0)
    assert consumer.state == IDLE and consumer.index == {}
    assert consumer.counters.resyncs == {"silence": 1}
    follow(publisher, consumer, chunk(stored([2], None)))  # the next message starts over
    assert consumer.parents() == {2: None}


def failed(consumer: SnapshotConsumer, count: int) -> bool:
    return sum(consumer.counters.bootstrap_failures.values()) == count


def test_unavailable_malformed_and_foreign_replies_are_retried(
    publisher: HandPublisher, consumer: SnapshotConsumer, clock: FakeClock
) -> None:
    heard = hear(publisher, consumer)
    seq_frame = heard.to_bytes(8, "big")
    bad_replies: list[tuple[str, list[bytes]]] = [
        ("unavailable", [(-2).to_bytes(8, "big", signed=True), publisher.publisher_id]),
        ("malformed", [seq_frame]),
        ("malformed", [seq_frame[1:], publisher.publisher_id]),
        ("malformed", [seq_frame, publisher.publisher_id[1:]]),
        ("malformed", [seq_frame, publisher.publisher_id, b"\xc1"]),  # not msgpack
        ("identity", [seq_frame, os.urandom(16)]),
    ]
    for count, (reason, frames) in enumerate(bad_replies, start=1):
        publisher.reply(publisher.request(consumer), *frames)
        consumer.run_until(functools.partial(failed, consumer, count), what=reason)
        assert consumer.counters.bootstrap_failures[reason] > 0
        assert not consumer.ready
        clock.now += consumer.retry_s  # the retry waits on the clock
    publisher.snapshot(publisher.request(consumer), heard, chunk(stored([1], None)))
    consumer.run_until(lambda: consumer.ready, what="ready")
    assert consumer.counters.snapshot_requests == len(bad_replies) + 1
    assert consumer.parents() == {1: None}


def test_an_unanswered_request_times_out_and_is_asked_again(
    publisher: HandPublisher, consumer: SnapshotConsumer, clock: FakeClock
) -> None:
    heard = hear(publisher, consumer)
    publisher.request(consumer)  # never answered
    clock.now += consumer.request_timeout_s
    consumer.step(0)
    assert consumer.counters.bootstrap_failures == {"timeout": 1}
    clock.now += consumer.retry_s
    publisher.snapshot(publisher.request(consumer), heard)
    consumer.run_until(lambda: consumer.ready, what="ready")


def test_buffered_batches_must_follow_the_snapshot_seq(
    publisher: HandPublisher, consumer: SnapshotConsumer, clock: FakeClock
) -> None:
    heard = hear(publisher, consumer)
    identity = publisher.request(consumer)
    publisher.next_seq += 1  # heard + 1 lost on the way
    later = buffer_live(publisher, consumer, [stored([2], None)])
    publisher.snapshot(identity, heard)
    consumer.run_until(lambda: consumer.counters.bootstrap_failures["sequence"] == 1, what="it")
    clock.now += consumer.retry_s
    publisher.snapshot(publisher.request(consumer), later, chunk(stored([2], None)))
    consumer.run_until(lambda: consumer.ready, what="ready")
    assert (consumer.parents(), consumer.next_seq) == ({2: None}, later + 1)


def test_a_payload_without_publisher_id_means_no_snapshots(
    publisher: HandPublisher, consumer: SnapshotConsumer
) -> None:
    def heard() -> bool:
        publisher.publish([], with_id=False)
        consumer.step(0.005)
        return consumer.counters.without_publisher_id > 0

    wait_for(heard, what="a 3-element batch")
    assert consumer.snapshots_served is False
    assert (consumer.state, consumer.counters.snapshot_requests) == (IDLE, 0)
    follow(publisher, consumer)
    publisher.publish([], with_id=False)
    consumer.run_until(lambda: not consumer.ready, what="the id to go")
    assert consumer.counters.resyncs == {"no publisher_id": 1}


def test_the_array_form_is_read_too(publisher: HandPublisher, consumer: SnapshotConsumer) -> None:
    array_store = ["BlockStored", [7, 8], None, [1, 2, 3, 4], BLOCK_SIZE, None, "GPU", None]
    follow(publisher, consumer, chunk(stored([1], None)))
    live(publisher, consumer, [array_store, ["BlockRemoved", [1], "GPU"]])
    assert consumer.parents() == {7: None, 8: 7}
    assert consumer.index[8].token_ids == (3, 4)
    live(publisher, consumer, [["AllBlocksCleared"]])
    assert consumer.index == {}
    assert consumer.violations == []


def test_protocol_violations_are_recorded(
    publisher: HandPublisher, consumer: SnapshotConsumer
) -> None:
    """What the index cannot accept is reported (tests of the daemon assert none came)."""
    follow(
        publisher,
        consumer,
        chunk(stored([2], 1)),  # child before its parent
        chunk({"type": "AllBlocksCleared"}),
        chunk(stored([3, 4], None)),  # a snapshot's stores are of one block
    )
    live(publisher, consumer, [removed([99])])
    assert len(consumer.violations) == 4, consumer.violations
