"""The snapshot protocol's bootstrap (``kvpubd.client.bootstrap.SnapshotTracker``) fed with
hand-made frames, encoded here with msgspec as a publisher puts them on the wire; time comes
from a clock the test moves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from kvpubd.client.bootstrap import (
    HELD_MESSAGE_OVERHEAD,
    FetchSnapshot,
    Phase,
    SnapshotTracker,
)
from kvpubd.client.tracker import Callbacks, Received, SubscriberError
from kvpubd.protocol.wire import BlockRemoved, BlockStored, Event, pack_seq, to_array

PID_A = bytes(range(16))
PID_B = bytes(range(100, 116))
BACKOFF = 0.25


def stored(block: int, parent: int | None = None) -> BlockStored:
    return BlockStored([block], parent, [block] * 4, 4, None, "GPU", None)


def events_on_wire(events: Sequence[Event], form: str) -> list[Any]:
    return [to_array(e) for e in events] if form == "array" else list(events)


def live(
    seq: int,
    events: Sequence[Event] = (),
    pid: bytes = PID_A,
    form: str = "map",
    rank: int = 0,
) -> list[bytes]:
    """``[topic, seq, payload]`` with the 4-element payload of a publisher serving snapshots
    (an empty batch is a heartbeat)."""
    payload = msgspec.msgpack.encode((1.0, events_on_wire(events, form), rank, pid))
    return [b"kv", pack_seq(seq), payload]


def reply(seq: int, pid: bytes = PID_A, *chunks: Sequence[Event], form: str = "map") -> list[bytes]:
    """``[seq (signed), publisher_id, chunk...]``, each chunk a ``[ts, events, rank]`` batch."""
    encoded = [msgspec.msgpack.encode((1.0, events_on_wire(c, form), 0)) for c in chunks]
    return [seq.to_bytes(8, "big", signed=True), pid, *encoded]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Record:
    def __init__(self) -> None:
        self.gaps: list[tuple[int, int, int]] = []
        self.resyncs: list[tuple[int, int]] = []
        self.restarts: list[tuple[int, str]] = []
        self.batches: list[int] = []

    def callbacks(self) -> Callbacks:
        return Callbacks(
            on_batch=lambda r: self.batches.append(r.seq),
            on_gap=lambda *args: self.gaps.append(args),
            on_resync=lambda *args: self.resyncs.append(args),
            on_restart=lambda *args: self.restarts.append(args),
        )


def tracker(clock: Clock | None = None, **kwargs: Any) -> SnapshotTracker:
    return SnapshotTracker([0], clock=clock or Clock(), retry_backoff=BACKOFF, **kwargs)


def request(t: SnapshotTracker) -> FetchSnapshot:
    asked = t.next_request()
    assert asked is not None and asked.rank == 0 and t.awaiting(asked)
    return asked


def seqs(batches: list[Received]) -> list[int]:
    return [b.seq for b in batches]


def blocks(t: SnapshotTracker, rank: int = 0) -> set[Any]:
    mirror = t.streams[rank].mirror
    assert mirror is not None
    return set(mirror.blocks)


def ready_at(seq: int, pid: bytes = PID_A, **kwargs: Any) -> tuple[SnapshotTracker, Record]:
    """A tracker bootstrapped from a snapshot at ``seq`` holding blocks 1 <- 2."""
    record = Record()
    t = tracker(callbacks=record.callbacks(), **kwargs)
    t.on_live(0, live(seq, pid=pid))
    t.on_snapshot(request(t), reply(seq, pid, [stored(1), stored(2, 1)]))
    assert t.streams[0].synced and t.next_request() is None
    return t, record


@pytest.mark.parametrize("form", ["map", "array"])
def test_bootstrap_builds_the_snapshot_then_the_buffered_suffix(form: str) -> None:
    """Nothing is asked before a live message; then a snapshot is, while live messages are
    buffered. The reply's chunks and the buffered batches above its seq make a new mirror,
    installed (and delivered from) only then; those at or below its seq are duplicates."""
    record = Record()
    t = tracker(callbacks=record.callbacks())
    assert t.next_request() is None and not t.streams[0].synced
    assert t.on_live(0, live(10, [stored(1)], form=form)) == []
    asked = request(t)
    for seq, events in [(11, [stored(2, 1)]), (12, [stored(3, 2)]), (13, [stored(4, 3)])]:
        assert t.on_live(0, live(seq, events, form=form)) == []
    assert blocks(t) == set() and t.streams[0].last is None  # nothing installed yet
    got = t.on_snapshot(asked, reply(11, PID_A, [stored(1)], [stored(2, 1)], form=form))
    assert seqs(got) == [12, 13] and record.batches == [12, 13]
    assert not any(b.replayed for b in got)
    assert got[0].batch.events == [stored(3, 2)]
    stream = t.streams[0]
    assert stream.synced and stream.last == 13 and stream.publisher_id == PID_A
    assert blocks(t) == {1, 2, 3, 4}
    assert record.resyncs == [(0, 11)]
    assert seqs(t.on_live(0, live(14, [BlockRemoved([4], None)], form=form))) == [14]
    assert t.on_live(0, live(13, [stored(4, 3)], form=form)) == []  # already applied
    assert blocks(t) == {1, 2, 3}
    c = stream.counters
    assert (c.resyncs, c.batches, c.events, c.duplicates) == (1, 3, 3, 3)
    assert (c.gaps, c.restarts, c.malformed, c.snapshots_failed) == (0, 0, 0, 0)
    assert t.next_request() is None


def test_an_empty_cache_and_a_heartbeat_only_stream() -> None:
    """A snapshot without chunks is an empty index at its seq; heartbeats (empty batches)
    consume seqs and are delivered like any batch."""
    t = tracker()
    t.on_live(0, live(5))
    assert t.on_snapshot(request(t), reply(5)) == []
    assert t.streams[0].synced and t.streams[0].last == 5 and blocks(t) == set()
    assert seqs(t.on_live(0, live(6))) == [6]


def test_nothing_published_yet() -> None:
    """Seq -1: an empty index that covers no seq; the buffered messages follow from seq 0."""
    t = tracker()
    t.on_live(0, live(0, [stored(1)]))
    assert seqs(t.on_snapshot(request(t), reply(-1))) == [0]
    assert t.streams[0].last == 0 and blocks(t) == {1}


def test_a_gap_makes_the_rank_unavailable_until_a_new_bootstrap() -> None:
    t, record = ready_at(11)
    assert seqs(t.on_live(0, live(12, [stored(3, 2)]))) == [12]
    assert t.on_live(0, live(14, [stored(5, 4)])) == []  # 13 was lost
    stream = t.streams[0]
    assert record.gaps == [(0, 13, 14)] and stream.counters.gaps == 1
    assert not stream.synced
    assert blocks(t) == {1, 2, 3} and stream.last == 12  # the last installed state, stale
    asked = request(t)
    t.on_live(0, live(15))
    got = t.on_snapshot(asked, reply(14, PID_A, [stored(1), stored(2, 1), stored(4, 2)]))
    assert seqs(got) == [15] and blocks(t) == {1, 2, 4}  # a new mirror: 3 and 5 are not in it
    assert stream.synced and record.resyncs == [(0, 11), (0, 14)]


def test_a_new_publisher_id_is_a_restart() -> None:
    """Another publisher_id while ready: a restart (whatever its seqs); the rank bootstraps
    again, and a reply from the old publisher does not do."""
    t, record = ready_at(11)
    assert t.on_live(0, live(3, pid=PID_B)) == []  # the new lifetime's seqs may be lower
    stream = t.streams[0]
    assert stream.counters.restarts == 1 and [r for r, _ in record.restarts] == [0]
    assert "publisher_id" in record.restarts[0][1]
    assert not stream.synced and stream.publisher_id == PID_A
    t.on_snapshot(request(t), reply(11, PID_A, [stored(1)]))  # not the buffered one's
    assert stream.counters.snapshots_failed == 1 and t.next_request() is None
    assert stream.phase is Phase.WAITING and not stream.synced
    t.on_live(0, live(4, pid=PID_B))
    assert t.on_snapshot(request(t), reply(4, PID_B, [stored(7)])) == []
    assert stream.synced and stream.publisher_id == PID_B and blocks(t) == {7}
    assert stream.last == 4 and stream.counters.restarts == 1


def test_a_restart_while_buffering_drops_the_old_lifetime() -> None:
    """The old publisher's buffered messages can never follow the new one's snapshot: they
    are dropped; the request the old one may have taken is given up and asked again at once
    (it was waited for until snapshot_timeout), and a snapshot of the new publisher completes
    the bootstrap."""
    t = tracker()
    t.on_live(0, live(10))
    asked = request(t)
    t.on_live(0, live(11))
    t.on_live(0, live(20, [stored(1)], pid=PID_B))
    assert t.streams[0].counters.restarts == 1 and not t.awaiting(asked)
    again = request(t)  # at once: no back-off
    assert again.attempt > asked.attempt
    assert seqs(t.on_snapshot(again, reply(19, PID_B))) == [20]
    assert t.streams[0].publisher_id == PID_B and blocks(t) == {1}


def test_the_buffered_suffix_must_follow_the_snapshot() -> None:
    """A hole in the buffer above the snapshot's seq fails the attempt (from waiting again);
    a hole at or below it is covered by the snapshot."""
    t = tracker()
    t.on_live(0, live(10))
    t.on_live(0, live(12))  # 11 lost
    t.on_snapshot(request(t), reply(10))
    stream = t.streams[0]
    assert stream.counters.snapshots_failed == 1 and stream.phase is Phase.WAITING
    t.on_live(0, live(13))
    t.on_live(0, live(15))  # 14 lost
    assert seqs(t.on_snapshot(request(t), reply(14))) == [15]
    assert stream.synced and stream.counters.duplicates == 1


def test_an_unavailable_reply_is_retried_after_a_back_off() -> None:
    """-2: retried on a fresh request once the back-off has passed; the buffer is kept."""
    clock = Clock()
    t = tracker(clock)
    t.on_live(0, live(10, [stored(1)]))
    first = request(t)
    assert t.on_snapshot(first, reply(-2)) == []
    assert t.next_request() is None and t.wake_in() == pytest.approx(BACKOFF)
    t.on_live(0, live(11, [stored(2, 1)]))
    clock.now += BACKOFF
    second = request(t)
    assert second.attempt != first.attempt
    assert seqs(t.on_snapshot(second, reply(10, PID_A, [stored(1)]))) == [11]
    c = t.streams[0].counters
    assert (c.snapshots_failed, c.malformed, c.resyncs) == (1, 0, 1)


MALFORMED_REPLIES = {
    "no frames": [],
    "one frame": [(5).to_bytes(8, "big")],
    "short seq": [b"\x00" * 7, PID_A],
    "short publisher_id": [(5).to_bytes(8, "big"), PID_A[:15]],
    "chunks with -2": reply(-2) + reply(5, PID_A, [stored(1)])[2:],
    "undecodable chunk": [*reply(5), b"\xc1"],
    "another rank's chunk": [*reply(5), msgspec.msgpack.encode((1.0, [], 3))],
}


@pytest.mark.parametrize("frames", MALFORMED_REPLIES.values(), ids=MALFORMED_REPLIES.keys())
def test_a_malformed_reply_is_counted_and_retried(frames: list[bytes]) -> None:
    clock = Clock()
    t = tracker(clock)
    t.on_live(0, live(5))
    assert t.on_snapshot(request(t), frames) == []
    c = t.streams[0].counters
    assert (c.malformed, c.snapshots_failed, c.resyncs) == (1, 1, 0)
    assert not t.streams[0].synced and t.next_request() is None
    clock.now += BACKOFF
    t.on_snapshot(request(t), reply(5))
    assert t.streams[0].synced


def test_chunks_that_break_an_invariant_are_a_violation() -> None:
    """A child before its parent: the chunks do not rebuild an index (retried)."""
    t = tracker()
    t.on_live(0, live(5))
    t.on_snapshot(request(t), reply(5, PID_A, [stored(2, 1), stored(1)]))
    c = t.streams[0].counters
    assert (c.violations, c.snapshots_failed) == (1, 1) and not t.streams[0].synced
    assert blocks(t) == set()


def test_a_live_batch_that_breaks_an_invariant_makes_the_rank_unavailable() -> None:
    t, _ = ready_at(11)
    assert t.on_live(0, live(12, [BlockRemoved([99], None)])) == []
    c = t.streams[0].counters
    assert c.violations == 1 and not t.streams[0].synced
    t.on_snapshot(request(t), reply(12, PID_A, [stored(1)]))  # covers the broken batch
    assert t.streams[0].synced and blocks(t) == {1}


def test_a_timeout_is_asked_again_and_a_late_reply_ignored() -> None:
    t = tracker()
    t.on_live(0, live(5, [stored(1)]))
    first = request(t)
    t.on_snapshot_timeout(first)
    second = request(t)  # at once: the timeout was the wait
    assert second != first and not t.awaiting(first)
    assert t.on_snapshot(first, reply(5, PID_A, [stored(1)])) == []  # answers an old question
    assert not t.streams[0].synced and t.streams[0].counters.snapshots_failed == 1
    t.on_snapshot(second, reply(5, PID_A, [stored(1)]))
    assert t.streams[0].synced


def test_the_buffer_is_bounded() -> None:
    """More buffered bytes than the bound: the attempt is dropped (its reply would not be
    followed) and the bootstrap starts over from the next live message."""
    size = len(live(1, [stored(1)])[2]) + HELD_MESSAGE_OVERHEAD
    t = tracker(buffer_bytes=5 * size + size // 2)
    t.on_live(0, live(1, [stored(1)]))
    asked = request(t)
    seq = 1
    while t.awaiting(asked) and seq < 100:
        seq += 1
        t.on_live(0, live(seq, [stored(seq)]))
    stream = t.streams[0]
    assert stream.counters.snapshots_failed == 1 and stream.phase is Phase.WAITING
    assert stream.buffered_bytes == 0 and t.next_request() is None
    assert seq == 6  # the bound counts payload bytes and what each message costs beside
    t.on_live(0, live(seq + 1))
    t.on_snapshot(request(t), reply(seq + 1))
    assert stream.synced


def test_silence_makes_a_ready_rank_bootstrap_again() -> None:
    """A ready rank that hears nothing for silence_timeout seconds is unavailable (a publisher
    heartbeats within 1 s); a message in time keeps it ready."""
    clock = Clock()
    t, _ = ready_at(11, clock=clock, silence_timeout=5.0)
    clock.now += 4.9
    t.tick()
    assert t.streams[0].synced and t.wake_in() == pytest.approx(0.1)
    t.on_live(0, live(12))  # a heartbeat
    clock.now += 4.9
    t.tick()
    assert t.streams[0].synced
    clock.now += 0.1
    t.tick()
    stream = t.streams[0]
    assert not stream.synced and stream.counters.silences == 1
    assert t.next_request() is None  # waits for a live message first
    t.on_live(0, live(13))
    t.on_snapshot(request(t), reply(13))
    assert stream.synced and stream.last == 13 and stream.counters.resyncs == 2


def test_a_batch_without_publisher_id_says_the_publisher_serves_no_snapshots() -> None:
    t = tracker()
    three = [b"", pack_seq(1), msgspec.msgpack.encode((1.0, [], 0))]
    with pytest.raises(SubscriberError, match="does not serve snapshots"):
        t.on_live(0, three)
    assert t.streams[0].counters.malformed == 1 and t.next_request() is None


MALFORMED_LIVE = {
    "two frames": live(1)[1:],
    "short seq": [b"", b"\x01", live(1)[2]],
    "end marker seq": [b"", b"\xff" * 8, live(1)[2]],
    "not msgpack": [b"", pack_seq(1), b"\xc1"],
    "short publisher_id": live(1, pid=PID_A[:8]),
    "another rank's batch": live(1, rank=1),
}


@pytest.mark.parametrize("frames", MALFORMED_LIVE.values(), ids=MALFORMED_LIVE.keys())
def test_malformed_live_messages_are_counted_and_ignored(frames: list[bytes]) -> None:
    t, _ = ready_at(11)
    assert t.on_live(0, frames) == []
    c = t.streams[0].counters
    assert c.malformed == 1 and t.streams[0].synced and t.streams[0].last == 11
    assert seqs(t.on_live(0, live(12))) == [12]


def test_without_a_mirror_the_seqs_are_still_followed() -> None:
    t = tracker(keep_mirror=False)
    t.on_live(0, live(7, [stored(1)]))
    assert seqs(t.on_snapshot(request(t), reply(6, PID_A, [stored(9)]))) == [7]
    assert t.streams[0].mirror is None and t.streams[0].synced


def test_ranks_bootstrap_independently() -> None:
    t = SnapshotTracker([0, 1], clock=Clock())
    t.on_live(1, live(3, rank=1))
    assert t.next_request() == FetchSnapshot(1, 0)
    t.on_snapshot(FetchSnapshot(1, 0), reply(3))
    assert t.streams[1].synced and not t.streams[0].synced and not t.all_ready()
    t.on_live(0, live(8))
    t.on_snapshot(request(t), reply(8))
    assert t.all_ready() and t.counters().resyncs == 2


def test_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SnapshotTracker([])
    with pytest.raises(ValueError):
        SnapshotTracker([0, 0])
    with pytest.raises(ValueError):
        SnapshotTracker([0], silence_timeout=0)


def test_what_waits_for_the_snapshot_is_bounded_by_what_it_holds_not_only_its_payloads() -> None:
    """Heartbeats (30-byte payloads) buffered while the snapshot is awaited: the bound counted
    their payloads only, and the buffer held 4.7 times its bytes before starting over. Each
    held message now counts what it costs beside its payload."""
    import tracemalloc

    bound = 4 << 20
    tracker = SnapshotTracker([0], buffer_bytes=bound)
    stream = tracker.streams[0]
    heartbeat = msgspec.msgpack.encode((0.0, [], 0, b"P" * 16))
    tracemalloc.start()
    try:
        seq = 0
        while True:
            before = stream.buffered_bytes
            # Each message its own bytes, as a socket gives them.
            tracker.on_live(0, [b"", pack_seq(seq), bytes(bytearray(heartbeat))])
            seq += 1
            if stream.buffered_bytes < before:
                break  # over the bound: started over
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seq > 1_000
    assert peak < 1.5 * bound, f"{peak / bound:.1f} times the bound"
