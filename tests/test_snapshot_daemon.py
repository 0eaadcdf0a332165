"""Both subscriber forms with ``snapshot_endpoint`` against the real daemon serving the snapshot
protocol (``events.snapshot_endpoint``): a late join, a restart, an idle rank, several ranks,
and a daemon that serves no snapshots."""

from __future__ import annotations

from typing import Any

import pytest

from kvpubd.client import Subscriber, SubscriberError
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.mirrors import (
    FORMS,
    AnySubscriber,
    AsyncDriven,
    Record,
    assert_mirror_is_snapshot,
    pump,
    store_released,
    unique_prompt,
)

SNAPSHOTS = {"snapshot_endpoint": True}  # a private snapshot endpoint, as for the others


def follow(form: str, daemon: Daemon, record: Record | None = None, **kwargs: Any) -> AnySubscriber:
    kwargs.setdefault("ranks", daemon.ranks)
    kwargs.setdefault("snapshot_timeout", 5.0)
    if record is not None:
        kwargs.update(record.callbacks())
    if form == "async":
        return AsyncDriven(
            daemon.events_endpoint, snapshot_endpoint=daemon.snapshot_endpoint, **kwargs
        )
    return Subscriber(daemon.events_endpoint, snapshot_endpoint=daemon.snapshot_endpoint, **kwargs)


def sync(daemon: Daemon, record: Record | None = None, **kwargs: Any) -> Subscriber:
    sub = follow("sync", daemon, record, **kwargs)
    assert isinstance(sub, Subscriber)
    return sub


def publisher_ids(daemon: Daemon) -> list[bytes]:
    with daemon.client() as client:
        return [rank.publisher_id for rank in client.ping().endpoints]


@pytest.mark.parametrize("form", FORMS)
def test_late_join_after_stores(start_daemon: DaemonFactory, form: str) -> None:
    """Stores made before the subscriber connects reach its mirror through the snapshot (no
    batch delivered for them); what follows arrives live; the mirror stays the daemon's."""
    daemon = start_daemon(events=SNAPSHOTS)
    record = Record()
    with daemon.client() as client:
        for _ in range(8):
            store_released(client, unique_prompt(3))
        before = client.snapshot()
        sub = follow(form, daemon, record)
        try:
            sub.catch_up()
            assert sub.synced(0) and sub.publisher_id(0) == publisher_ids(daemon)[0]
            ((rank, snapshot_seq),) = record.resyncs
            assert rank == 0 and snapshot_seq >= before.seq
            assert all(b.seq > snapshot_seq for b in record.batches[0])
            mirror = sub.mirror(0)
            assert mirror is not None and len(mirror.blocks) == 8 * 3
            for _ in range(4):
                store_released(client, unique_prompt(2))
            assert_mirror_is_snapshot(sub, client, [0])
            delivered = record.seqs(0)
            assert delivered == list(range(snapshot_seq + 1, delivered[-1] + 1))
            c = sub.counters
            assert (c.resyncs, c.restarts, c.gaps, c.malformed, c.snapshots_failed) == (
                1,
                0,
                0,
                0,
                0,
            )
        finally:
            sub.close()


@pytest.mark.parametrize("form", FORMS)
def test_a_daemon_restart_bootstraps_again(start_daemon: DaemonFactory, form: str) -> None:
    """A daemon restarted on the same endpoints has a new publisher_id: the subscriber proves
    the restart and bootstraps from the new run's snapshot."""
    daemon = start_daemon(events=SNAPSHOTS)
    record = Record()
    with daemon.client() as client:
        store_released(client, unique_prompt(2))
    sub = follow(form, daemon, record)
    try:
        sub.catch_up()
        (old_id,) = publisher_ids(daemon)
        assert sub.publisher_id(0) == old_id
        daemon.stop()
        daemon.start()
        (new_id,) = publisher_ids(daemon)
        assert new_id != old_id
        with daemon.client() as client:
            store_released(client, unique_prompt(3))
            pump(sub, lambda: sub.publisher_id(0) == new_id and sub.synced(0), what="the new run")
            assert_mirror_is_snapshot(sub, client, [0])
        assert sub.counters.restarts == 1 and [r for r, _ in record.restarts] == [0]
        assert sub.counters.resyncs >= 2
    finally:
        sub.close()


def test_an_idle_daemon_heartbeats_and_the_rank_stays_ready(start_daemon: DaemonFactory) -> None:
    """Nothing stored: the daemon heartbeats (empty batches, one seq each) within 1 s, well
    inside the subscriber's silence timeout, so the rank stays ready on one bootstrap."""
    daemon = start_daemon(events=SNAPSHOTS)
    record = Record()
    with sync(daemon, record) as sub:
        sub.catch_up()
        pump(sub, lambda: len(record.batches[0]) >= 3, what="three heartbeats")
        assert all(b.batch.events == [] for b in record.batches[0])
        delivered = record.seqs(0)
        assert delivered == list(range(delivered[0], delivered[0] + len(delivered)))
        assert sub.synced(0)
        c = sub.counters
        assert (c.resyncs, c.silences, c.gaps, c.snapshots_failed) == (1, 0, 0, 0)


def test_every_rank_bootstraps_from_its_own_endpoint(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(events=SNAPSHOTS, cache={"data_parallel_size": 2})
    with daemon.client() as client:
        for rank in (0, 1):
            for _ in range(rank + 2):
                store_released(client, unique_prompt(2), rank)
        with sync(daemon) as sub:
            sub.catch_up()
            assert [sub.publisher_id(r) for r in (0, 1)] == publisher_ids(daemon)
            assert_mirror_is_snapshot(sub, client, [0, 1])


def test_a_daemon_without_snapshots_is_named(start_daemon: DaemonFactory) -> None:
    """Its batches carry no publisher_id: the call that reads one says the daemon serves no
    snapshots."""
    daemon = start_daemon(events={"heartbeat_ms": 100})
    sub = Subscriber(daemon.events_endpoint, snapshot_endpoint="ipc:///tmp/kvpubd-no-snapshots")
    try:
        with pytest.raises(SubscriberError, match="does not serve snapshots"):
            pump(sub, lambda: False, what="a batch")
    finally:
        sub.close()


def test_the_replay_subscriber_reads_the_four_element_batches(start_daemon: DaemonFactory) -> None:
    """Serving snapshots adds a 4th element to every batch; a subscriber that repairs by
    replay (no snapshot_endpoint) follows that daemon as any other."""
    daemon = start_daemon(events=SNAPSHOTS)
    with daemon.client() as client:
        for _ in range(3):
            store_released(client, unique_prompt(2))
        with Subscriber(daemon.events_endpoint, daemon.replay_endpoint, control=client) as sub:
            assert sub.catch_up()
            assert_mirror_is_snapshot(sub, client, [0])
            assert sub.publisher_id(0) is None and sub.counters.malformed == 0
