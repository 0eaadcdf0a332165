"""The subscriber: the pure ``StreamTracker`` fed with hand-made messages (each rule on its
own), then both subscriber forms and ``kvpubd subscribe`` against a real daemon. The
faults (stalls, lost history, kill -9, SIGTERM, soak) are in test_faults.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from kvpubd.client import Mirror, MirrorError, Received
from kvpubd.client.subscriber import AsyncSubscriber, Subscriber, parse_replay_message
from kvpubd.client.tracker import (
    Ping,
    Reconnect,
    Replay,
    Snapshot,
    StreamTracker,
    SubscriberError,
)
from kvpubd.protocol.wire import (
    END_SEQ,
    AllBlocksCleared,
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    Event,
    event_to_wire,
    pack_seq,
)
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.mirrors import (
    FORMS,
    Record,
    assert_mirror_is_snapshot,
    go_live,
    pump,
    snapshot_blocks,
    store_released,
    subscriber,
    unique_prompt,
)

# -- the tracker, fed by hand ------------------------------------------------------------------

ENCODER = BatchEncoder("map", 0)


def stored(block: int, parent: int | None = None) -> BlockStored:
    return BlockStored([block], parent, [block] * 4, 4, None, "CPU", None)


def payload(events: list[Event], ts: float = 1.0) -> bytes:
    return ENCODER.encode(ts, events)


def live(seq: int, events: list[Event], ts: float = 1.0) -> list[bytes]:
    return [b"", pack_seq(seq), payload(events, ts)]


STREAM: list[list[Event]] = [
    [AllBlocksCleared()],
    [stored(1)],
    [stored(2, 1)],
    [BlockRemoved([2], None)],
    [stored(3, 1)],
    [stored(4, 3)],
]


def replayed(first: int, last: int, ts: float = 1.0) -> list[tuple[int, bytes]]:
    return [(seq, payload(STREAM[seq], ts)) for seq in range(first, last + 1)]


def connected(control: bool = True, epoch: int = 7, upto: int = 2, **kw: Any) -> StreamTracker:
    """A tracker on rank 0 that has replayed STREAM[0..upto] from a daemon of ``epoch``."""
    tracker = StreamTracker([0], replay=True, control=control, **kw)
    if control:
        assert tracker.next_request() == Ping()
        tracker.on_ping({"epoch": epoch, "ranks": 1})
    assert tracker.next_request() == Replay(0, 0)
    tracker.on_replay(0, 0, replayed(0, upto))
    assert tracker.next_request() is None
    return tracker


def seqs(batches: list[Received]) -> list[int]:
    return [b.seq for b in batches]


def test_tracker_applies_in_order_and_ignores_duplicates() -> None:
    """Seq last+1 is applied to the mirror; a seq already applied with the same payload is
    counted as a duplicate and changes nothing."""
    tracker = connected(upto=1)
    assert seqs(tracker.on_live(0, live(2, STREAM[2]))) == [2]
    assert tracker.on_live(0, live(3, STREAM[3])) and tracker.next_request() is None
    stream = tracker.streams[0]
    assert stream.mirror is not None and set(stream.mirror.blocks) == {1}
    # A replay overlapping what arrived live: the overlap is ignored.
    tracker.catch_up()
    assert tracker.next_request() == Ping()
    tracker.on_ping({"epoch": 7, "ranks": 1})
    assert tracker.next_request() == Replay(0, 3)  # from last: the overlap proves the same run
    assert seqs(tracker.on_replay(0, 3, replayed(3, 4))) == [4]
    assert tracker.on_live(0, live(4, STREAM[4])) == []
    c = stream.counters
    assert (c.batches, c.duplicates, c.gaps, c.restarts) == (5, 1, 0, 0)
    assert set(stream.mirror.blocks) == {1, 3}


def test_tracker_repairs_a_gap_by_replay_after_an_epoch_check() -> None:
    """A live seq above last+1 is a gap: the tracker asks for a ping (same daemon run?) and
    then a replay from last (the overlap); the replayed batches and the live one are applied
    in order."""
    gaps: list[tuple[int, int, int]] = []
    tracker = connected(upto=1)
    tracker.callbacks.on_gap = lambda *args: gaps.append(args)
    assert tracker.on_live(0, live(4, STREAM[4])) == []
    assert gaps == [(0, 2, 4)]
    assert tracker.next_request() == Ping()
    tracker.on_ping({"epoch": 7, "ranks": 1})
    assert tracker.next_request() == Replay(0, 1)
    got = tracker.on_replay(0, 1, replayed(1, 3))
    assert [(b.seq, b.replayed) for b in got] == [(2, True), (3, True), (4, False)]
    c = tracker.streams[0].counters
    assert (c.gaps, c.gaps_repaired, c.replayed, c.lost) == (1, 1, 4, 0)


def test_tracker_resyncs_from_the_snapshot_when_history_is_gone() -> None:
    """A replay that starts above the seq asked for: the tracker asks for the snapshot; the
    mirror becomes exactly the snapshot, batches up to its seq are ignored, the next applies."""
    resyncs: list[tuple[int, int]] = []
    tracker = connected(upto=1)
    tracker.callbacks.on_resync = lambda *args: resyncs.append(args)
    tracker.on_live(0, live(5, STREAM[5]))
    tracker.on_ping({"epoch": 7, "ranks": 1})
    assert tracker.next_request() == Replay(0, 1)
    assert tracker.on_replay(0, 1, replayed(4, 5)) == []
    assert tracker.next_request() == Snapshot(0)
    # Meanwhile the daemon published seq 6, storing block 9: the snapshot is taken after it.
    state = (stored(1), stored(3, 1), stored(4, 3), stored(9, 4))
    snap = [event_to_wire(e, "map") for e in state]
    tracker.on_snapshot(0, {"rank": 0, "seq": 6, "epoch": 7, "events": snap})
    assert tracker.next_request() is None and resyncs == [(0, 6)]
    stream = tracker.streams[0]
    assert stream.mirror is not None and set(stream.mirror.blocks) == {1, 3, 4, 9}
    assert tracker.on_live(0, live(6, [stored(9, 4)])) == []  # covered by the snapshot
    assert seqs(tracker.on_live(0, live(7, [BlockRemoved([9], None)]))) == [7]
    assert set(stream.mirror.blocks) == {1, 3, 4}
    c = stream.counters
    assert (c.resyncs, c.gaps_repaired, c.lost, c.restarts, c.duplicates) == (1, 0, 0, 0, 1)


def test_tracker_live_seq_going_back_is_a_restart() -> None:
    """Live seqs of one run only grow: a lower one drops the rank's state, reconnects its SUB,
    checks the epoch and replays from 0."""
    restarts: list[tuple[int, str]] = []
    tracker = connected(upto=2)
    tracker.callbacks.on_restart = lambda *args: restarts.append(args)
    tracker.on_live(0, live(3, STREAM[3]))
    assert tracker.on_live(0, live(0, [AllBlocksCleared()], ts=2.0)) == []
    assert [r for r, _ in restarts] == [0] and "went back" in restarts[0][1]
    assert tracker.next_request() == Reconnect(0)
    tracker.on_reconnected(0)
    assert tracker.next_request() == Ping()
    tracker.on_ping({"epoch": 8, "ranks": 1})  # the new run's epoch: no second restart
    assert tracker.next_request() == Replay(0, 0)
    tracker.on_replay(0, 0, replayed(0, 1, ts=2.0))
    stream = tracker.streams[0]
    assert stream.last == 1 and stream.mirror is not None and set(stream.mirror.blocks) == {1}
    assert stream.counters.restarts == 1 and tracker.epoch == 8


def test_tracker_same_seq_with_another_payload_is_a_restart() -> None:
    """A seq already applied arriving with a different payload (another run's batch, e.g.
    before the first live message was seen) is a restart, not a duplicate."""
    same = connected(upto=2)
    assert same.on_live(0, live(1, STREAM[1], ts=1.0)) == []  # the same batch
    assert same.streams[0].counters.duplicates == 1 and same.streams[0].counters.restarts == 0
    restarts: list[tuple[int, str]] = []
    other = connected(upto=2)
    other.callbacks.on_restart = lambda *args: restarts.append(args)
    assert other.on_live(0, live(0, [AllBlocksCleared()], ts=9.0)) == []
    assert other.streams[0].counters.restarts == 1
    assert "another payload" in restarts[0][1]
    assert other.next_request() == Reconnect(0)


def test_tracker_new_epoch_restarts_every_rank() -> None:
    """A ping answering another epoch drops the state of every rank, once each."""
    tracker = StreamTracker([0, 1], replay=True, control=True)
    tracker.on_ping({"epoch": 7, "ranks": 2})
    for rank in (0, 1):
        assert tracker.next_request() == Replay(rank, 0)
        tracker.on_replay(rank, 0, replayed(0, 2))
    tracker.catch_up()
    assert tracker.next_request() == Ping()
    tracker.on_ping({"epoch": 8, "ranks": 2})
    for rank in (0, 1):
        assert tracker.next_request() == Reconnect(rank)
        tracker.on_reconnected(rank)
    assert tracker.next_request() == Replay(0, 0)  # no second ping: the epoch is known
    assert [tracker.streams[r].counters.restarts for r in (0, 1)] == [1, 1]
    assert all(s.last is None and s.epoch == 8 for s in tracker.streams.values())


def test_tracker_counts_a_forward_restart_alike_with_and_without_control() -> None:
    """A new run whose seqs start above the old run's (the clock origin): its first live
    batch is a gap, and the mirror is rebuilt from its start-up marker. With control the
    epoch also proves the restart; otherwise the counters say the same."""
    new_run = [(100, payload([AllBlocksCleared()])), (101, payload([stored(9)]))]
    results = {}
    for control in (False, True):
        resyncs: list[tuple[int, int]] = []
        tracker = connected(control=control, upto=2)
        tracker.callbacks.on_resync = lambda *args, seen=resyncs: seen.append(args)
        assert tracker.on_live(0, [b"", pack_seq(101), new_run[1][1]]) == []
        if control:
            assert tracker.next_request() == Ping()
            tracker.on_ping({"epoch": 8, "ranks": 1})
            assert tracker.next_request() == Reconnect(0)
            tracker.on_reconnected(0)
        start = tracker.streams[0].replay_start
        assert tracker.next_request() == Replay(0, start)
        tracker.on_replay(0, start, new_run)
        stream = tracker.streams[0]
        assert stream.mirror is not None and set(stream.mirror.blocks) == {9}
        c = stream.counters
        results[control] = (c.gaps, c.resyncs, c.lost, c.violations, resyncs)
        assert c.restarts == (1 if control else 0)
    assert results[True] == results[False] == (1, 1, 0, 0, [(0, 100)])


def test_tracker_snapshot_of_another_run_is_a_restart() -> None:
    tracker = connected(upto=1)
    tracker.on_live(0, live(5, STREAM[5]))
    tracker.on_ping({"epoch": 7, "ranks": 1})
    tracker.on_replay(0, 1, replayed(4, 5))
    tracker.on_snapshot(0, {"rank": 0, "seq": 9, "epoch": 8, "events": []})
    assert tracker.streams[0].counters.restarts == 1
    assert tracker.streams[0].counters.resyncs == 0
    assert tracker.next_request() == Reconnect(0)


def test_tracker_replay_that_ends_before_a_live_seq_is_a_restart() -> None:
    """One run's replay always reaches a seq it already sent live; if it ends before, the
    replay came from another run (e.g. without control, no epoch to check)."""
    tracker = connected(control=False, upto=1)
    tracker.on_live(0, live(5, STREAM[5]))
    assert tracker.next_request() == Replay(0, 1)
    tracker.on_replay(0, 1, replayed(1, 3))
    assert tracker.streams[0].counters.restarts == 1
    assert tracker.next_request() == Reconnect(0)


def test_tracker_overlap_with_another_payload_is_a_restart() -> None:
    """Without control, cut off while the daemon restarted (zero origin) until the new run's
    seqs passed the old run's last: the repair replays from ``last`` and the batch there is
    not the one applied. The state is dropped and rebuilt from the new run."""
    restarts: list[tuple[int, str]] = []
    tracker = connected(control=False, upto=2)
    tracker.callbacks.on_restart = lambda *args: restarts.append(args)
    tracker.on_live(0, live(5, STREAM[5], ts=9.0))  # the new run's batch
    assert tracker.next_request() == Replay(0, 2)
    assert tracker.on_replay(0, 2, replayed(2, 5, ts=9.0)) == []
    assert "another payload" in restarts[0][1]
    assert tracker.next_request() == Reconnect(0)
    tracker.on_reconnected(0)
    assert tracker.next_request() == Replay(0, 0)
    assert seqs(tracker.on_replay(0, 0, replayed(0, 5, ts=9.0))) == [0, 1, 2, 3, 4, 5]
    stream = tracker.streams[0]
    assert stream.mirror is not None and set(stream.mirror.blocks) == {1, 3, 4}
    assert (stream.counters.restarts, stream.counters.lost) == (1, 0)


def test_tracker_empty_replay_from_last_is_a_restart() -> None:
    """One run's replay holds at least its latest batch: nothing from ``last`` means the
    daemon now answering has not got that far (another run)."""
    tracker = connected(control=False, upto=2)
    tracker.catch_up()
    assert tracker.next_request() == Replay(0, 2)
    assert tracker.on_replay(0, 2, []) == []
    assert tracker.streams[0].counters.restarts == 1
    assert tracker.next_request() == Reconnect(0)


@pytest.mark.parametrize("control", [True, False], ids=["control", "no-control"])
def test_tracker_jump_onto_a_reset_marker_rebuilds_the_mirror(control: bool) -> None:
    """A repair whose replay jumps past the seqs asked for onto a batch holding
    AllBlocksCleared (a restarted daemon's first batch at a later seq origin, or a daemon's
    answer to a request for lost history): the mirror is rebuilt from that marker, exact,
    with nothing counted as lost and no snapshot needed."""
    tracker = connected(control=control, upto=2)
    origin = 1_700_000_000_000_000  # the new run's clock origin
    new_run = [(origin, payload([AllBlocksCleared()], 5.0)), (origin + 1, payload([stored(7)]))]
    tracker.on_live(0, [b"", pack_seq(origin + 1), new_run[1][1]])
    if control:
        assert tracker.next_request() == Ping()
        tracker.on_ping({"epoch": 7, "ranks": 1})  # e.g. lost history of the same run
    assert tracker.next_request() == Replay(0, 2)
    assert seqs(tracker.on_replay(0, 2, new_run)) == [origin, origin + 1]
    stream = tracker.streams[0]
    assert tracker.next_request() is None
    assert stream.synced and stream.mirror is not None and set(stream.mirror.blocks) == {7}
    c = stream.counters
    assert (c.resyncs, c.lost, c.restarts, c.violations) == (1, 0, 0, 0)


def test_tracker_first_replay_at_a_clock_origin() -> None:
    """A daemon's seqs need not start at 0: a fresh tracker's replay from 0 that starts at the
    run's first batch (its start-up marker) is the whole history, nothing lost or resynced."""
    tracker = StreamTracker([0], replay=True, control=False)
    origin = 1_700_000_000_000_000
    history = [(origin + i, payload(events)) for i, events in enumerate(STREAM)]
    assert tracker.next_request() == Replay(0, 0)
    assert seqs(tracker.on_replay(0, 0, history)) == [origin + i for i in range(len(STREAM))]
    stream = tracker.streams[0]
    assert stream.mirror is not None and set(stream.mirror.blocks) == {1, 3, 4}
    c = stream.counters
    assert (c.resyncs, c.lost, c.restarts) == (0, 0, 0) and stream.synced


def test_tracker_without_control_lost_history_waits_for_a_reset_marker() -> None:
    """Without control, a hole replay cannot fill is counted as lost and the mirror is
    unsynced (not updated) until an AllBlocksCleared makes it exact again."""
    tracker = connected(control=False, upto=1)
    tracker.on_live(0, live(5, STREAM[5]))
    assert seqs(tracker.on_replay(0, 1, replayed(4, 5))) == [4, 5]
    stream = tracker.streams[0]
    assert stream.counters.lost == 2 and not stream.synced
    tracker.on_live(0, live(6, [BlockRemoved([99], None), AllBlocksCleared(), stored(7)]))
    assert stream.synced and stream.mirror is not None and set(stream.mirror.blocks) == {7}
    assert stream.counters.violations == 0


@pytest.mark.parametrize("control", [True, False], ids=["control", "no-control"])
def test_tracker_invariant_violation(control: bool) -> None:
    """A batch that breaks an invariant (removing an unknown block) is counted; with control
    the rank resyncs from the snapshot, without it waits for a reset marker."""
    tracker = connected(control=control, upto=2)
    tracker.on_live(0, live(3, [BlockRemoved([42], None)]))
    stream = tracker.streams[0]
    assert stream.counters.violations == 1
    if control:
        assert tracker.next_request() == Snapshot(0)
    else:
        assert tracker.next_request() is None and not stream.synced


def test_tracker_malformed_live_messages_change_nothing() -> None:
    tracker = connected(upto=2)
    stream = tracker.streams[0]
    before = (stream.last, dict(stream.mirror.blocks) if stream.mirror else None)
    for frames in ([b"", pack_seq(3)], [b"", b"\x00" * 7, b""], [b"", END_SEQ, b""]):
        assert tracker.on_live(0, frames) == []
    assert stream.counters.malformed == 3
    assert tracker.next_request() is None
    # An undecodable payload at the next seq: that seq must be fetched again (snapshot).
    assert tracker.on_live(0, [b"", pack_seq(3), b"\xc1"]) == []
    assert stream.counters.malformed == 4 and tracker.next_request() == Snapshot(0)
    assert (stream.last, dict(stream.mirror.blocks) if stream.mirror else None) == before


def test_tracker_refuses_bad_ranks_and_unusable_replies() -> None:
    with pytest.raises(ValueError, match="ranks"):
        StreamTracker([], replay=True, control=False)
    with pytest.raises(ValueError, match="distinct"):
        StreamTracker([0, 0], replay=True, control=False)
    tracker = StreamTracker([0, 2], replay=True, control=True)
    with pytest.raises(SubscriberError, match="rank 2"):
        tracker.on_ping({"epoch": 1, "ranks": 2})
    with pytest.raises(SubscriberError, match="ping"):
        tracker.on_ping({"epoch": "x"})
    with pytest.raises(SubscriberError, match="snapshot"):
        tracker.on_snapshot(0, {"seq": 1})


def test_subscriber_refuses_bad_arguments() -> None:
    """Bad arguments are refused before any socket is made."""
    for kwargs in ({"ranks": 0}, {"ranks": [1, 1]}, {"replay_timeout": 0}, {"idle_check": -1}):
        with pytest.raises(ValueError):
            Subscriber("ipc:///nonexistent/events", "ipc:///nonexistent/replay", **kwargs)


def test_parse_replay_message_both_framings() -> None:
    assert parse_replay_message([b"", b"topic", pack_seq(3), b"p"]) == (3, b"p")
    assert parse_replay_message([b"", pack_seq(3), b"p"]) == (3, b"p")
    assert parse_replay_message([b"", b"", END_SEQ, b""]) is None
    assert parse_replay_message([b"", END_SEQ, b""]) is None
    with pytest.raises(ValueError):
        parse_replay_message([b"x"])


# -- against a real daemon ---------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_connect_replays_from_zero(daemon: Daemon, form: str) -> None:
    """A subscriber connecting to a daemon with history replays everything from seq 0: every
    batch of the run, from its first (at the run's seq origin), once, flagged replayed; its
    mirror equals the snapshot."""
    with daemon.client() as client:
        for _ in range(5):
            store_released(client, unique_prompt(3))
        snap = client.snapshot()
        record = Record()
        sub = subscriber(form, daemon, record)
        try:
            got = sub.catch_up()
            every = range(daemon.first_seq(), snap.seq + 1)
            assert [(b.seq, b.replayed) for b in got] == [(s, True) for s in every]
            assert isinstance(got[0].batch.events[0], AllBlocksCleared)
            assert_mirror_is_snapshot(sub, client, [0])
            assert sub.epoch == daemon.epoch
        finally:
            sub.close()


def test_live_batches_already_replayed_are_duplicates(daemon: Daemon) -> None:
    """Batches that arrive live after a replay already delivered them are ignored (counted as
    duplicates): every seq is delivered exactly once."""
    record = Record()
    with (
        daemon.client() as client,
        Subscriber(daemon.events_endpoint, daemon.replay_endpoint, **record.callbacks()) as sub,
    ):
        go_live(sub, client, [0])
        before = sub.last_seq(0)
        assert before is not None
        for _ in range(5):
            store_released(client, unique_prompt(1))
        last = client.snapshot().seq
        sub.catch_up()  # replays them while their live copies are on the way
        assert sub.last_seq(0) == last
        pump(sub, lambda: sub.counters.duplicates >= last - before, what="the live copies")
        assert record.seqs(0) == record.run_seqs(0, last)
        assert sub.counters.duplicates == last - before
        assert sub.counters.gaps == 0
        assert_mirror_is_snapshot(sub, client, [0])


@pytest.mark.parametrize("form", FORMS)
def test_connect_after_history_is_gone_resyncs(start_daemon: DaemonFactory, form: str) -> None:
    """When the replay buffer no longer holds seq 0 (and replay sends no snapshot batch), the
    first replay starts above it: the subscriber loads the snapshot instead, and follows live
    from there."""
    daemon = start_daemon(events={"buffer_steps": 4, "replay_snapshot": False})
    record = Record()
    with daemon.client() as client:
        for _ in range(10):
            store_released(client, unique_prompt(2))
            client.snapshot()  # publishes each store as its own batch
        sub = subscriber(form, daemon, record)
        try:
            assert sub.catch_up() == []
            assert record.resyncs == [(0, client.snapshot().seq)]
            assert sub.rank_counters(0).lost == 0
            store_released(client, unique_prompt(2))
            assert_mirror_is_snapshot(sub, client, [0])
        finally:
            sub.close()


@pytest.mark.parametrize("form", FORMS)
def test_connect_after_history_is_gone_replays_the_snapshot_batch(
    start_daemon: DaemonFactory, form: str
) -> None:
    """By default the replay itself answers with the whole state: one batch at the last seq,
    the marker then every cached block, parents first; no control snapshot is needed."""
    daemon = start_daemon(events={"buffer_steps": 4})
    record = Record()
    with daemon.client() as client:
        for _ in range(10):
            store_released(client, unique_prompt(2))
            last = client.snapshot().seq
        sub = subscriber(form, daemon, record, control=None)
        try:
            (batch,) = sub.catch_up()
            assert batch.seq == last and batch.replayed
            assert isinstance(batch.batch.events[0], AllBlocksCleared)
            assert sub.rank_counters(0).lost == 0
            assert_mirror_is_snapshot(sub, client, [0])
            store_released(client, unique_prompt(2))
            assert_mirror_is_snapshot(sub, client, [0])
        finally:
            sub.close()


def test_legacy_replay_framing(start_daemon: DaemonFactory) -> None:
    """Replay without the topic frame (vLLM <= 0.25) is read the same way."""
    daemon = start_daemon(events={"replay_framing": "legacy", "topic": "kv@pod@m"})
    with (
        daemon.client() as client,
        Subscriber(daemon.events_endpoint, daemon.replay_endpoint, topic="kv@pod@m") as sub,
    ):
        store_released(client, unique_prompt(2))
        go_live(sub, client, [0])
        assert_mirror_is_snapshot(sub, client, [0])


def test_idle_check_finds_a_tail_the_pub_dropped(start_daemon: DaemonFactory) -> None:
    """A stalled consumer loses the last batches at the PUB and nothing later reveals the
    hole; with idle_check the subscriber replays a silent rank and gets them anyway."""
    daemon = start_daemon(events={"hwm": 2, "tick_interval_ms": 1}, cache={"num_blocks": 4096})
    with (
        daemon.client() as client,
        Subscriber(daemon.events_endpoint, daemon.replay_endpoint, rcvhwm=2, idle_check=0.2) as sub,
    ):
        go_live(sub, client, [0])
        for _ in range(1500):
            store_released(client, unique_prompt(8))
        last = client.snapshot().seq
        pump(sub, lambda: sub.last_seq(0) == last, what="the tail")
        assert sub.counters.replayed > 1  # the tail came through replay
        # Batches still queued at the PUB when reading resumes may reveal part of the hole
        # live (timing); whatever they revealed was repaired, and the tail is there.
        assert sub.counters.gaps == sub.counters.gaps_repaired
        assert_mirror_is_snapshot(sub, client, [0])


async def test_async_subscriber_iterates(daemon: Daemon) -> None:
    """``async for`` over an AsyncSubscriber yields the replayed history then live batches,
    gap-free, while stores happen in a thread; its mirror then equals the snapshot."""
    target: list[int] = []

    def load() -> None:
        with daemon.client() as client:
            for _ in range(20):
                store_released(client, unique_prompt(2))
            target.append(client.snapshot().seq + 1)
            store_released(client, unique_prompt(1))  # published once the target is known

    seen: list[Received] = []
    async with AsyncSubscriber(
        daemon.events_endpoint, daemon.replay_endpoint, control=daemon.control_endpoint
    ) as sub:

        async def follow() -> None:
            async for received in sub:
                seen.append(received)
                if target and received.seq >= target[0]:
                    return

        await asyncio.gather(asyncio.to_thread(load), asyncio.wait_for(follow(), timeout=20))
        with daemon.client() as client:
            snap = client.snapshot()
        assert sub.last_seq(0) == snap.seq == target[0]
        mirror = sub.mirror(0)
        assert mirror is not None and mirror.blocks == snapshot_blocks(snap)
    first = daemon.first_seq()
    assert [b.seq for b in seen] == list(range(first, first + len(seen)))
    assert any(not b.replayed for b in seen)


# -- kvpubd subscribe --------------------------------------------------------------------------

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}


def cli_subscribe(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvpubd", "subscribe", "--json", "--timeout", "5"]
    command += ["--endpoint", daemon.events_endpoint, "--replay", daemon.replay_endpoint]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60, env=ENV)


def history_beyond_the_buffer(daemon: Daemon) -> int:
    """Publish 10 batches into a 4-batch replay buffer; returns the last seq."""
    with daemon.client() as client:
        for _ in range(10):
            store_released(client, unique_prompt(2))
            seq = client.snapshot().seq
    return seq


@pytest.mark.process
def test_cli_subscribe_with_control_resyncs_and_says_so(start_daemon: DaemonFactory) -> None:
    """`subscribe --control` against a daemon whose history is gone reports the resync on
    stderr, then prints what follows the snapshot's seq (a daemon whose replay does not answer
    with a snapshot batch)."""
    daemon = start_daemon(events={"buffer_steps": 4, "replay_snapshot": False})
    last = history_beyond_the_buffer(daemon)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpubd",
            "subscribe",
            "--json",
            "--count",
            "1",
            "--endpoint",
            daemon.events_endpoint,
            "--replay",
            daemon.replay_endpoint,
            "--control",
            daemon.control_endpoint,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stderr is not None
        note = proc.stderr.readline()  # the resync happens on connect
        assert f"history gone; mirror rebuilt (snapshot or reset marker) at seq {last}" in note
        with daemon.client() as client:
            store_released(client, unique_prompt(1))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    (line,) = [json.loads(x) for x in out.splitlines()]
    assert line["seq"] == last + 1 and line["type"] == "BlockStored"


@pytest.mark.process
def test_cli_subscribe_without_control_reports_the_loss(start_daemon: DaemonFactory) -> None:
    """Without --control the same hole is reported as lost, and the retained batches print."""
    daemon = start_daemon(events={"buffer_steps": 4, "replay_snapshot": False})
    last = history_beyond_the_buffer(daemon)
    result = cli_subscribe(daemon, "--count", "4")
    assert result.returncode == 0, result.stderr
    # How many seqs came before the retained ones is unknown (the run's first is not 0).
    assert "1 batch(es) lost" in result.stderr, result.stderr
    printed = [json.loads(x)["seq"] for x in result.stdout.splitlines()]
    assert printed == list(range(last - 3, last + 1))


@pytest.mark.process
def test_cli_subscribe_late_join_prints_the_whole_cache(start_daemon: DaemonFactory) -> None:
    """Joining after the buffer wrapped, without --control: the replay's snapshot batch (seq
    of the last batch) prints the marker and every cached block; nothing is reported lost."""
    daemon = start_daemon(events={"buffer_steps": 4})
    last = history_beyond_the_buffer(daemon)
    with daemon.client() as client:
        cached = len(snapshot_blocks(client.snapshot()))
    result = cli_subscribe(daemon, "--count", str(1 + cached))
    assert result.returncode == 0, result.stderr
    assert "lost" not in result.stderr, result.stderr
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert {line["seq"] for line in lines} == {last}
    assert lines[0]["type"] == "AllBlocksCleared"
    assert all(line["type"] == "BlockStored" for line in lines[1:])


@pytest.mark.process
def test_cli_subscribe_help_names_control() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpubd", "subscribe", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=ENV,
    )
    assert result.returncode == 0
    assert "--control" in result.stdout and "snapshot" in result.stdout


def test_subscriber_without_a_daemon_times_out_clearly() -> None:
    """Nobody at the endpoints: catch_up raises TimeoutError naming the replay endpoint, and
    the next call asks again (and times out again) rather than breaking."""
    directory = tempfile.mkdtemp(prefix="kvpsub", dir="/tmp")
    base = f"ipc://{directory}/nobody"
    try:
        with Subscriber(f"{base}-events", f"{base}-replay", replay_timeout=0.2) as sub:
            for _ in range(2):
                with pytest.raises(TimeoutError, match="replay"):
                    sub.catch_up()
            assert sub.counters.batches == 0
    finally:
        os.rmdir(directory)


def test_a_mirror_holds_a_stream_to_one_block_size_until_it_is_cleared() -> None:
    """A mirror made without a block size takes the first store's: a later store of another
    size breaks the stream (it was applied without complaint: the check never ran). A clear
    (a restart's marker, which may bring a new size) forgets it; a size given stays."""
    first = BlockStored([1], None, list(range(16)), 16, None, "GPU", None)
    other = BlockStored([2], None, list(range(32)), 32, None, "GPU", None)
    mirror = Mirror()
    mirror.apply([first])
    with pytest.raises(MirrorError, match="block_size 32 != 16"):
        mirror.apply([other])
    assert set(mirror.blocks) == {1}
    mirror.apply([AllBlocksCleared(), other])
    assert mirror.block_size == 32 and set(mirror.blocks) == {2}
    fixed = Mirror(16)
    with pytest.raises(MirrorError):
        fixed.apply([AllBlocksCleared(), other])


def test_the_client_exports_what_a_batch_holds(daemon: Daemon) -> None:
    """A consumer needs no import beyond ``kvpubd.client`` to tell events apart."""
    import kvpubd.client as client

    batches: list[Any] = []

    def events() -> list[Any]:
        return [event for batch in batches for event in batch.events]

    with daemon.subscriber(on_batch=lambda received: batches.append(received.batch)) as sub:
        sub.catch_up()
        with daemon.client() as control:
            store_released(control, unique_prompt(2))
        pump(sub, lambda: any(isinstance(e, client.BlockStored) for e in events()), what="a store")
    assert all(isinstance(batch, client.EventBatch) for batch in batches)
    assert isinstance(events()[0], client.AllBlocksCleared)  # the start-up marker


def test_tracker_refuses_a_batch_that_names_another_rank() -> None:
    """A replayed or live batch whose payload names another rank never reaches this rank's
    mirror: it is malformed, and the hole it leaves is repaired like any other."""
    other_rank = BatchEncoder("map", 1)
    tracker = connected(upto=1)
    foreign = other_rank.encode(1.0, [stored(9)])
    assert tracker.on_live(0, [b"", pack_seq(2), foreign]) == []
    stream = tracker.streams[0]
    assert stream.counters.malformed == 1
    assert stream.mirror is not None and 9 not in stream.mirror.blocks
    tracker = StreamTracker([0], replay=True, control=False)
    assert tracker.next_request() == Replay(0, 0)
    got = tracker.on_replay(0, 0, [(0, payload(STREAM[0])), (1, foreign)])
    assert seqs(got) == [0] and tracker.streams[0].counters.malformed == 1
    mirror = tracker.streams[0].mirror
    assert mirror is not None and 9 not in mirror.blocks


def test_tracker_counts_an_implausible_jump_as_one_loss() -> None:
    """Live-only, a forged seq near the top of the seq space is one loss, not 1.8e19; an
    ordinary gap still counts its missing seqs."""
    tracker = StreamTracker([0], replay=False, control=False)
    tracker.on_live(0, live(0, STREAM[0]))
    tracker.on_live(0, live(3, STREAM[1]))
    assert tracker.streams[0].counters.lost == 2
    tracker.on_live(0, live(2**64 - 2, STREAM[2]))
    assert tracker.streams[0].counters.lost == 3


def test_a_replay_that_trickles_ends_within_its_total_bound(tmp_path: Any) -> None:
    """A replay socket that sends one batch just before each silence timeout would hold
    ``catch_up`` for ever: the whole replay is bounded too, and it ends as a timeout."""
    import threading

    import zmq

    from kvpubd.client.subscriber import SubscriberTimeout, replay

    timeout = 0.2
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/replay"
    router.bind(endpoint)
    stop = threading.Event()

    def trickle() -> None:
        identity = router.recv_multipart()[0]
        seq = 0
        while not stop.is_set():
            router.send_multipart([identity, b"", b"", pack_seq(seq), payload([])])
            seq += 1
            stop.wait(timeout / 2)

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    try:
        # Bounded by the total, not by a silence (there never is one): without the bound
        # this never returns.
        with pytest.raises(SubscriberTimeout):
            replay(endpoint, 0, timeout=timeout, context=ctx)
    finally:
        stop.set()
        server.join(5)
        router.close(linger=0)
        ctx.term()
