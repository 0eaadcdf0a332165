"""Both subscriber forms with ``snapshot_endpoint``, against a real publisher of the snapshot
protocol (tests/snapshot_publisher.py: real ZeroMQ sockets, real msgpack): bootstrap, what
makes a rank bootstrap again, and what a publisher's failures look like to the caller."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from kvpubd.client import Subscriber, SubscriberError, SubscriberTimeout
from kvpubd.protocol.wire import BlockStored
from tests.mirrors import FORMS, AnySubscriber, AsyncDriven, Record, pump
from tests.snapshot_publisher import SnapshotPublisher, block

Endpoints = tuple[str, str]


@pytest.fixture
def endpoints() -> Iterator[Endpoints]:
    where = tempfile.mkdtemp(prefix="kvsnap-", dir="/tmp")  # ipc paths must stay short
    yield f"ipc://{where}/events", f"ipc://{where}/snapshot"
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def publisher(endpoints: Endpoints) -> Iterator[SnapshotPublisher]:
    pub = SnapshotPublisher(*endpoints)
    yield pub
    pub.close()


def follow(
    form: str, endpoints: Endpoints, record: Record | None = None, **kwargs: Any
) -> AnySubscriber:
    kwargs.setdefault("snapshot_timeout", 2.0)
    if record is not None:
        kwargs.update(record.callbacks())
    events, snapshot = endpoints
    if form == "async":
        return AsyncDriven(events, snapshot_endpoint=snapshot, **kwargs)
    return Subscriber(events, snapshot_endpoint=snapshot, **kwargs)


def sync(endpoints: Endpoints, record: Record | None = None, **kwargs: Any) -> Subscriber:
    sub = follow("sync", endpoints, record, **kwargs)
    assert isinstance(sub, Subscriber)
    return sub


def state(pub: SnapshotPublisher) -> dict[Any, BlockStored]:
    return pub.call(lambda: dict(pub.state))


def store_chain(pub: SnapshotPublisher, first: int, count: int) -> int:
    """``count`` batches, each storing a child of the previous block; the last seq."""
    seq = 0
    for number in range(first, first + count):
        seq = pub.store(block(number, None if number == first else number - 1))
    return seq


def caught_up(sub: AnySubscriber, pub: SnapshotPublisher, rank: int = 0) -> bool:
    """Synced, at the publisher's last seq, with its publisher_id and exactly its blocks."""
    seq, publisher_id, blocks = pub.call(lambda: (pub.seq, pub.publisher_id, dict(pub.state)))
    mirror = sub.mirror(rank)
    return (
        sub.synced(rank)
        and sub.last_seq(rank) == seq
        and sub.publisher_id(rank) == publisher_id
        and mirror is not None
        and mirror.blocks == blocks
    )


def follow_until_caught_up(sub: AnySubscriber, pub: SnapshotPublisher, rank: int = 0) -> None:
    """Receive until the rank follows the publisher's current lifetime, then still the stream
    (no heartbeat: the publisher's last seq stays put) until the mirror is its state."""
    publisher_id = pub.call(lambda: pub.publisher_id)
    pump(sub, lambda: sub.synced(rank) and sub.publisher_id(rank) == publisher_id)
    pub.set(heartbeat=None)
    pump(sub, lambda: caught_up(sub, pub, rank), what="the publisher's state")
    pub.set(heartbeat=0.05)


@pytest.mark.parametrize("form", FORMS)
def test_late_join_bootstraps_then_follows_live(
    publisher: SnapshotPublisher, endpoints: Endpoints, form: str
) -> None:
    """A subscriber joining after stores gets them from the snapshot (nothing delivered for
    them: one resync at the snapshot's seq), then every live batch in seq order."""
    store_chain(publisher, 1, 10)
    record = Record()
    sub = follow(form, endpoints, record)
    try:
        assert sub.catch_up() is not None
        assert sub.synced(0) and sub.publisher_id(0) == publisher.publisher_id
        mirror = sub.mirror(0)
        assert mirror is not None and set(range(1, 11)) <= set(mirror.blocks)
        ((rank, snapshot_seq),) = record.resyncs
        assert rank == 0 and snapshot_seq >= 1009  # the 10 stores came through the snapshot
        last = store_chain(publisher, 11, 5)
        pump(sub, lambda: sub.last_seq(0) == last, what="the live stores")
        follow_until_caught_up(sub, publisher)
        delivered = record.seqs(0)
        assert delivered == list(range(snapshot_seq + 1, delivered[-1] + 1))
        c = sub.counters
        assert (c.resyncs, c.gaps, c.restarts, c.malformed, c.replayed) == (1, 0, 0, 0, 0)
    finally:
        sub.close()


@pytest.mark.parametrize("form", FORMS)
def test_batches_published_during_the_snapshot_follow_it(
    publisher: SnapshotPublisher, endpoints: Endpoints, form: str
) -> None:
    """Batches the publisher sends after taking the snapshot and before replying are applied
    on top of it (buffered meanwhile, or received live after it): none is missing."""
    store_chain(publisher, 1, 4)
    publisher.set(publish_during_snapshot=5)
    record = Record()
    sub = follow(form, endpoints, record)
    try:
        sub.catch_up()
        ((_, snapshot_seq),) = record.resyncs
        pump(sub, lambda: set(range(snapshot_seq + 1, snapshot_seq + 6)) <= set(record.seqs()))
        follow_until_caught_up(sub, publisher)
        assert sub.counters.snapshots_failed == 0 and sub.counters.gaps == 0
    finally:
        sub.close()


@pytest.mark.parametrize("form", FORMS)
def test_a_publisher_restart_bootstraps_again(
    publisher: SnapshotPublisher, endpoints: Endpoints, form: str
) -> None:
    """A new lifetime on the same endpoints (another publisher_id, an empty cache): proven a
    restart, the rank is bootstrapped from the new lifetime's snapshot."""
    store_chain(publisher, 1, 5)
    record = Record()
    sub = follow(form, endpoints, record)
    try:
        sub.catch_up()
        old_id = sub.publisher_id(0)
        new_id = publisher.restart()
        store_chain(publisher, 100, 3)
        pump(sub, lambda: sub.publisher_id(0) == new_id and sub.synced(0), what="the new run")
        follow_until_caught_up(sub, publisher)
        mirror = sub.mirror(0)
        assert mirror is not None and set(mirror.blocks) == {100, 101, 102}
        assert old_id != new_id and sub.counters.restarts == 1
        assert [rank for rank, _ in record.restarts] == [0]
        assert sub.counters.resyncs == 2
    finally:
        sub.close()


def test_a_restart_whose_seqs_start_lower(
    publisher: SnapshotPublisher, endpoints: Endpoints
) -> None:
    """Seqs are compared within one publisher_id only: a new lifetime starting at 0 is
    followed like any other."""
    store_chain(publisher, 1, 3)
    with sync(endpoints) as sub:
        sub.catch_up()
        publisher.restart(first_seq=0)
        store_chain(publisher, 50, 2)
        follow_until_caught_up(sub, publisher)
        last = sub.last_seq(0)
        assert last is not None and last < 1000
        assert sub.counters.restarts == 1


def test_a_gap_bootstraps_again(publisher: SnapshotPublisher, endpoints: Endpoints) -> None:
    record = Record()
    with sync(endpoints, record) as sub:
        sub.catch_up()
        publisher.skip()
        store_chain(publisher, 1, 2)
        follow_until_caught_up(sub, publisher)
        ((rank, first_missing, seen),) = record.gaps
        assert rank == 0 and seen == first_missing + 1
        assert (sub.counters.gaps, sub.counters.resyncs) == (1, 2)


def test_unavailable_replies_are_retried(
    publisher: SnapshotPublisher, endpoints: Endpoints
) -> None:
    publisher.set(unavailable=2)
    store_chain(publisher, 1, 2)
    with sync(endpoints) as sub:
        sub.catch_up()
        follow_until_caught_up(sub, publisher)
        assert (
            sub.counters.snapshots_failed == 2 and publisher.call(lambda: publisher.requests) == 3
        )


@pytest.mark.parametrize("form", FORMS)
def test_an_unanswered_request_times_out_and_is_asked_again(
    publisher: SnapshotPublisher, endpoints: Endpoints, form: str
) -> None:
    """No reply within snapshot_timeout raises SubscriberTimeout from the call; the next call
    asks again on a fresh socket."""
    publisher.set(answering=False)
    sub = follow(form, endpoints, snapshot_timeout=0.3)
    try:
        with pytest.raises(SubscriberTimeout, match="no snapshot"):
            sub.catch_up()
        assert not sub.synced(0) and sub.counters.snapshots_failed == 1
        publisher.set(answering=True)
        sub.catch_up()
        follow_until_caught_up(sub, publisher)
    finally:
        sub.close()


def test_catch_up_without_a_publisher_times_out(endpoints: Endpoints) -> None:
    """No live message at all: catch_up gives up after snapshot_timeout, naming the rank."""
    with sync(endpoints, snapshot_timeout=0.3) as sub:
        with pytest.raises(SubscriberTimeout, match=r"rank\(s\) \[0\] not bootstrapped"):
            sub.catch_up()
        assert sub.counters.snapshots_failed == 0 and not sub.synced(0)


def test_silence_bootstraps_again(publisher: SnapshotPublisher, endpoints: Endpoints) -> None:
    """A ready rank that hears nothing for silence_timeout (no heartbeat) is unavailable until
    the publisher speaks again and a new bootstrap completes."""
    with sync(endpoints, silence_timeout=0.3) as sub:
        sub.catch_up()
        publisher.set(heartbeat=None)
        pump(sub, lambda: not sub.synced(0), what="the silence")
        assert sub.counters.silences >= 1
        publisher.set(heartbeat=0.05)
        sub.catch_up()
        assert sub.synced(0) and sub.counters.resyncs >= 2


@pytest.mark.parametrize("form", FORMS)
def test_a_publisher_without_snapshots_is_named(endpoints: Endpoints, form: str) -> None:
    """3-element batches: the publisher serves no snapshot; the call says so."""
    pub = SnapshotPublisher(*endpoints, with_publisher_id=False)
    sub = follow(form, endpoints)
    try:
        with pytest.raises(SubscriberError, match="does not serve snapshots"):
            sub.catch_up()
        assert sub.counters.malformed >= 1 and not sub.synced(0)
    finally:
        sub.close()
        pub.close()


def test_two_ranks_bootstrap_from_their_own_publishers(endpoints: Endpoints) -> None:
    """Per-rank endpoints derive from the base ones (ipc: suffix _dp<rank>)."""
    ranks = [SnapshotPublisher(*endpoints, rank=r, first_seq=10 * (r + 1)) for r in (0, 1)]
    try:
        for r, pub in enumerate(ranks):
            store_chain(pub, 100 * (r + 1), 3)
        with sync(endpoints, ranks=2) as sub:
            sub.catch_up()
            for r, pub in enumerate(ranks):
                follow_until_caught_up(sub, pub, r)
                assert sub.publisher_id(r) == pub.publisher_id
            assert sub.publisher_id(0) != sub.publisher_id(1)
    finally:
        for pub in ranks:
            pub.close()


def test_refuses_arguments_of_the_other_repair(endpoints: Endpoints) -> None:
    events, snapshot = endpoints
    for extra in ({"control": "ipc:///tmp/x"}, {"idle_check": 1.0}, {"snapshot_timeout": 0}):
        with pytest.raises(ValueError):
            Subscriber(events, snapshot_endpoint=snapshot, **extra)
    with pytest.raises(ValueError, match="replay_endpoint"):
        Subscriber(events, "ipc:///tmp/replay", snapshot_endpoint=snapshot)
    with pytest.raises(ValueError):
        Subscriber(events, snapshot_endpoint="nowhere")
    with Subscriber(events) as plain:
        assert plain.publisher_id(0) is None  # the replay protocol knows no publisher_id
