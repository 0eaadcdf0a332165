"""The decisions of a subscriber, without any I/O: ``StreamTracker`` takes what arrived (live
messages, replay replies, snapshots, pings) and says what to deliver and what to ask for next.

The sync and asyncio subscribers (``kvpubd.client.subscriber``) are thin shells around it: they read
sockets, feed the tracker, and carry out ``next_request()`` until it returns None.

Per rank it keeps a ``Mirror`` of the published cache and the last seq applied. The rules:

- seq ``last + 1`` is applied; ``<= last`` is a duplicate (ignored) unless its payload differs
  from the one applied at that seq, which means another daemon run is talking (a restart);
- a higher seq is a gap: the missing seqs are replayed (with a control endpoint, a ping first
  checks the daemon's epoch). Every repair replays from ``last``, not ``last + 1``: the batch
  at ``last`` must come back with the payload that was applied, or another daemon run is
  talking (without control that overlap is the only witness of a restart whose seqs already
  passed the old run's);
- a replay that skips seqs lands either on a batch holding ``AllBlocksCleared`` (a new run's
  start-up marker, or a daemon's answer to a request for history it no longer holds), from
  which the mirror is rebuilt exactly, or on an ordinary batch: the history is gone and the
  rank is resynchronised from the control ``snapshot`` (without control, the hole is counted
  as lost and the mirror waits for the next ``AllBlocksCleared``, which makes it exact again);
- live seqs of one daemon run only grow, so a live seq at or below the last live seq, a new
  epoch, a replayed ``last`` with another payload, or a replay that ends before a seq already
  applied or received live is a restart: the rank's state is dropped, its SUB socket is
  reconnected (dropping the old run's queued messages) and it starts again from a replay of
  everything the new run retains.

A daemon's seqs do not start at 0 (by default they start at the wall clock in microseconds,
so each run's are above the last run's): the tracker never assumes a first seq.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from kvpubd.client.mirror import Mirror, MirrorError
from kvpubd.protocol.wire import (
    AllBlocksCleared,
    EventBatch,
    decode_batch,
    event_from_wire,
    split_live,
)

# The largest jump of seqs counted as that many lost batches: far more than any publisher keeps
# for replay. A larger one is another run's seqs (a clock origin) or a forged seq: one loss.
MAX_COUNTED_GAP = 1 << 20
# Payload fingerprints kept per rank, to tell a duplicate from another run's batch.
FINGERPRINT_WINDOW = 4096


@dataclass(slots=True)
class Received:
    """One batch as a subscriber sees it."""

    rank: int
    seq: int
    batch: EventBatch
    payload: bytes
    replayed: bool


class SubscriberError(RuntimeError):
    """The daemon answered something a subscriber cannot work with."""


@dataclass
class Counters:
    """What happened on one rank's stream (or, summed, on all of them)."""

    batches: int = 0  # batches applied and delivered
    events: int = 0  # events in them
    replayed: int = 0  # of the batches, those that came through replay
    gaps: int = 0  # holes seen in the live stream
    gaps_repaired: int = 0  # ... filled by replay
    # Mirror replaced: by a snapshot, rebuilt from a reset marker after a jump, or rebuilt from
    # a new run after a restart; the same count with or without control for the same events.
    resyncs: int = 0
    # Daemon restarts proven (state dropped): a seq going back, a batch with another payload,
    # a new epoch (only with control: without it, a run that jumps forward is one resync), or
    # (snapshot protocol) another publisher_id on the live stream.
    restarts: int = 0
    duplicates: int = 0  # batches ignored: already applied, or covered by a snapshot
    lost: int = 0  # seqs that could be neither replayed nor resynchronised
    violations: int = 0  # batches (or snapshot chunks) that broke the stream's invariants
    malformed: int = 0  # messages (or snapshot replies and chunks) that could not be decoded
    # Snapshot protocol only: bootstrap attempts that failed and were retried (a -2, malformed
    # or late reply, another publisher_id, a hole after the snapshot's seq, a buffer overflow).
    snapshots_failed: int = 0
    silences: int = 0  # snapshot protocol only: ready ranks silent too long, bootstrapped again

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @classmethod
    def total(cls, each: Iterable[Counters]) -> Counters:
        """The counters summed (of every rank followed)."""
        summed = cls()
        for counters in each:
            summed = summed + counters
        return summed


def check_ranks(ranks: Sequence[int]) -> None:
    """ValueError unless ``ranks`` are some ranks to follow: distinct, none negative."""
    if not ranks:
        raise ValueError("ranks: follow at least one rank")
    if len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise ValueError(f"ranks: {list(ranks)} must be distinct and >= 0")


# What the tracker asks its shell to do next.
@dataclass(frozen=True, slots=True)
class Reconnect:
    """Close the rank's SUB socket and open a fresh one (drops another run's queued batches)."""

    rank: int


@dataclass(frozen=True, slots=True)
class Ping:
    """Ask the control socket for the daemon's epoch."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Ask the control socket for the rank's snapshot."""

    rank: int


@dataclass(frozen=True, slots=True)
class Replay:
    """Replay the rank's batches from ``start``."""

    rank: int
    start: int


Request = Reconnect | Ping | Snapshot | Replay


@dataclass
class Callbacks:
    on_batch: Callable[[Received], None] | None = None
    on_gap: Callable[[int, int, int], None] | None = None  # rank, first missing, first seen
    on_resync: Callable[[int, int], None] | None = None  # rank, snapshot seq
    on_restart: Callable[[int, str], None] | None = None  # rank, reason


class RankStream:
    """One rank's view: mirror, seqs, and what it still needs."""

    def __init__(self, rank: int, keep_mirror: bool, host_medium: str | None = None) -> None:
        self.rank = rank
        self.keep_mirror = keep_mirror
        self.host_medium = host_medium
        self.counters = Counters()
        self.epoch: int | None = None  # the daemon run this state belongs to, when known
        self.rebuilding = False  # state dropped by a restart, the new run's not applied yet
        self.clear()
        self.need_reconnect = False
        self.need_replay = False
        self.need_snapshot = False

    def new_mirror(self) -> Mirror | None:
        return Mirror(host_medium=self.host_medium) if self.keep_mirror else None

    def clear(self) -> None:
        self.mirror: Mirror | None = self.new_mirror()
        self.synced = True  # False: the mirror misses something until the next reset marker
        self.last: int | None = None  # last seq applied
        self.last_live: int | None = None  # last seq received on the SUB socket
        self.fingerprints: dict[int, int] = {}
        self.trigger: tuple[int, bytes] | None = None  # the live batch that revealed a gap
        self.gap_counted = False

    @property
    def next_seq(self) -> int:
        return 0 if self.last is None else self.last + 1

    @property
    def replay_start(self) -> int:
        """Where a repair replays from: ``last`` itself, the overlap that proves the same run
        (everything the daemon retains before anything was applied)."""
        return 0 if self.last is None else self.last

    def remember(self, seq: int, payload: bytes) -> None:
        prints = self.fingerprints
        prints[seq] = hash(payload)
        if len(prints) > 2 * FINGERPRINT_WINDOW:
            floor = seq - FINGERPRINT_WINDOW
            self.fingerprints = {s: h for s, h in prints.items() if s > floor}

    def same_batch(self, seq: int, payload: bytes) -> bool | None:
        """Whether ``payload`` is what was applied at ``seq``; None when no longer known."""
        known = self.fingerprints.get(seq)
        return None if known is None else known == hash(payload)


class StreamTracker:
    """Pure state machine of a subscriber following ``ranks`` of one daemon.

    ``replay``/``control``: whether the shell can replay and reach the control socket.
    Feed it with ``on_live``, ``on_replay`` and ``on_snapshot`` (each returns the batches to
    deliver), ``on_ping``, ``on_reconnected`` and ``on_timeout``. ``next_request()`` says what
    the shell must do next (None: nothing until the next live message). Not thread-safe: one
    shell drives it from one thread (or one event loop)."""

    def __init__(
        self,
        ranks: Sequence[int],
        *,
        replay: bool,
        control: bool,
        keep_mirror: bool = True,
        callbacks: Callbacks | None = None,
        host_medium: str | None = None,
    ) -> None:
        check_ranks(ranks)
        self.replay = replay
        self.control = control
        self.callbacks = callbacks or Callbacks()
        self.streams = {rank: RankStream(rank, keep_mirror, host_medium) for rank in ranks}
        self.epoch: int | None = None
        self.need_ping = control
        for stream in self.streams.values():
            self._resync_from_start(stream)

    # -- what to do next -----------------------------------------------------------------

    def next_request(self) -> Request | None:
        streams = self.streams.values()
        for stream in streams:
            if stream.need_reconnect:
                return Reconnect(stream.rank)
        if self.need_ping:
            return Ping()
        for stream in streams:
            if stream.need_snapshot:
                return Snapshot(stream.rank)
            if stream.need_replay:
                return Replay(stream.rank, stream.replay_start)
        return None

    def catch_up(self, ranks: Iterable[int] | None = None) -> None:
        """Ask for everything published since the last seq (finds a lost tail)."""
        self.need_ping = self.control  # the replay must come from the same daemon run
        for rank in self.streams if ranks is None else ranks:
            stream = self.streams[rank]
            if self.replay:
                stream.need_replay = True
            elif self.control:
                stream.need_snapshot = True

    def counters(self) -> Counters:
        return Counters.total(stream.counters for stream in self.streams.values())

    # -- inputs --------------------------------------------------------------------------

    def on_live(self, rank: int, frames: list[bytes]) -> list[Received]:
        """A message from the rank's SUB socket: ``[topic, seq, payload]``."""
        stream = self.streams[rank]
        try:
            seq, payload = split_live(frames)
        except ValueError:
            stream.counters.malformed += 1
            return []
        previous_live, stream.last_live = stream.last_live, seq
        if previous_live is not None and seq <= previous_live:
            self._restart(stream, f"live seq went back from {previous_live} to {seq}")
            return []
        if stream.last is not None and seq <= stream.last:
            return self._known(stream, seq, payload, "live")
        if seq == stream.next_seq:
            return self._apply(stream, seq, payload, replayed=False)
        # A gap (or, before the first replay answered, a start mid-stream).
        missing_from = stream.next_seq
        if stream.last is not None:
            stream.counters.gaps += 1
            stream.gap_counted = True
            if self.callbacks.on_gap:
                self.callbacks.on_gap(rank, missing_from, seq)
        stream.trigger = (seq, payload)
        if self.replay:
            stream.need_replay = True
            # Another daemon run could hold the same seqs: check the epoch before replaying.
            self.need_ping = self.control
            return []
        if self.control:
            stream.need_snapshot = True
            return []
        stream.trigger = None
        self._unrecoverable(stream, missing_from, seq)
        return self._apply(stream, seq, payload, replayed=False)

    def on_replay(self, rank: int, start: int, batches: list[tuple[int, bytes]]) -> list[Received]:
        """The reply to ``Replay(rank, start)``: (seq, payload) in the order received."""
        stream = self.streams[rank]
        stream.need_replay = False
        if start != stream.replay_start:  # answers a question no longer asked
            stream.need_replay = True
            return []
        if stream.last is not None:
            if not self._overlap_holds(stream, batches):
                return []
            batches = batches[1:] if batches[0][0] == stream.last else batches
        out: list[Received] = []
        for seq, payload in batches:
            if stream.need_snapshot or stream.need_reconnect:
                break  # the snapshot (or the restart) covers the rest
            if stream.last is not None and seq <= stream.last:
                out.extend(self._known(stream, seq, payload, "replayed"))
            elif seq == stream.next_seq:
                out.extend(self._apply(stream, seq, payload, replayed=True))
            else:
                out.extend(self._jump(stream, seq, payload))
        out.extend(self._settle_trigger(stream))
        return out

    def on_snapshot(self, rank: int, reply: Mapping[str, Any]) -> list[Received]:
        """The reply to ``Snapshot(rank)``: ``{seq, epoch, events}``; the mirror becomes it."""
        stream = self.streams[rank]
        try:
            seq, epoch = int(reply["seq"]), int(reply["epoch"])
            events = [event_from_wire(e) for e in reply["events"]]
        except (KeyError, TypeError, ValueError) as exc:
            # Still asked: the next call asks again (an unusable reply answered nothing).
            raise SubscriberError(f"rank {rank}: unusable snapshot reply: {exc}") from None
        stream.need_snapshot = False
        if (self.epoch is not None and epoch != self.epoch) or (
            stream.last is not None and seq < stream.last
        ):
            self._restart(stream, "the snapshot belongs to another daemon run")
            return []
        if stream.keep_mirror:
            mirror = Mirror(host_medium=stream.host_medium)
            try:
                mirror.apply(events)
            except MirrorError as exc:
                raise SubscriberError(f"rank {rank}: snapshot breaks an invariant: {exc}") from None
            stream.mirror = mirror
        self.epoch = stream.epoch = epoch
        stream.rebuilding = False  # counted here, as the resync it is
        stream.synced = True
        stream.last = seq if seq >= 0 else None
        stream.trigger = None  # published before the snapshot was taken: covered
        stream.gap_counted = False
        stream.need_replay = False
        stream.counters.resyncs += 1
        if self.callbacks.on_resync:
            self.callbacks.on_resync(rank, seq)
        return []

    def on_ping(self, reply: Mapping[str, Any]) -> None:
        """The reply to ``Ping()``: a new epoch means the daemon restarted."""
        try:
            epoch, served = int(reply["epoch"]), int(reply["ranks"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SubscriberError(f"unusable ping reply: {exc}") from None
        missing = [r for r in self.streams if r >= served]
        if missing:
            raise SubscriberError(f"the daemon serves {served} rank(s); rank {missing[0]} is not")
        self.epoch = epoch
        for stream in self.streams.values():
            if stream.epoch is None:
                stream.epoch = epoch  # its state is (re)built after this ping
            elif stream.epoch != epoch:
                self._restart(stream, "the daemon's epoch changed")
                stream.epoch = epoch
        self.need_ping = False

    def on_reconnected(self, rank: int) -> None:
        self.streams[rank].need_reconnect = False

    def on_timeout(self) -> None:
        """A request got no answer (it stays asked): the daemon may come back as another run,
        so its epoch is checked before anything else is asked of it."""
        self.need_ping = self.control

    # -- internals -----------------------------------------------------------------------

    def _known(self, stream: RankStream, seq: int, payload: bytes, how: str) -> list[Received]:
        """A seq already applied: a duplicate, unless it is another run's batch."""
        if stream.same_batch(seq, payload) is False:
            self._restart(stream, f"{how} seq {seq} came again with another payload")
        else:
            stream.counters.duplicates += 1
        return []

    def _overlap_holds(self, stream: RankStream, batches: list[tuple[int, bytes]]) -> bool:
        """A repair replays from ``last``: one run's replay holds at least its latest batch,
        and gives ``last`` back as it was applied. Nothing at all, or ``last`` with another
        payload, is another daemon run (one whose seqs start at or below the old run's)."""
        if not batches:
            self._restart(stream, f"replay from {stream.last} returned nothing: another run")
            return False
        seq, payload = batches[0]
        if seq == stream.last and stream.same_batch(seq, payload) is False:
            self._restart(stream, f"replayed seq {seq} has another payload than the one applied")
            return False
        return True

    def _jump(self, stream: RankStream, seq: int, payload: bytes) -> list[Received]:
        """The replay skipped from ``next_seq`` to ``seq``. A batch holding AllBlocksCleared
        makes the mirror exact whatever was skipped (a new run's start-up marker, or the
        daemon's answer to a request for history it no longer holds): it is rebuilt from
        there. Any other batch means the skipped history is gone."""
        if _holds_marker(payload):
            if stream.last is not None:
                stream.counters.resyncs += 1
                if self.callbacks.on_resync:
                    self.callbacks.on_resync(stream.rank, seq)
            stream.synced = False  # _apply rebuilds the mirror from the marker
            stream.gap_counted = False
            # A history answer shares its seq with a live batch of another payload: no
            # fingerprint for it, or that live batch would look like another run's.
            return self._apply(stream, seq, payload, replayed=True, fingerprint=False)
        self._history_gone(stream, stream.next_seq, seq)
        if stream.need_snapshot:
            return []
        return self._apply(stream, seq, payload, replayed=True)

    def _settle_trigger(self, stream: RankStream) -> list[Received]:
        """After a replay: the live batch that revealed the gap is now next, or known."""
        trigger, stream.trigger = stream.trigger, None
        if trigger is None or stream.need_snapshot or stream.need_reconnect:
            return []
        seq, payload = trigger
        out: list[Received] = []
        if stream.last is not None and seq <= stream.last:
            out = self._known(stream, seq, payload, "live")
        elif seq == stream.next_seq:
            out = self._apply(stream, seq, payload, replayed=False)
        else:
            # One run's replay always reaches a seq it already sent live.
            self._restart(stream, f"replay ended at {stream.last} before live seq {seq}")
            return []
        if stream.gap_counted and not stream.need_reconnect:
            stream.counters.gaps_repaired += 1
        stream.gap_counted = False
        return out

    def _history_gone(self, stream: RankStream, missing_from: int, seq: int) -> None:
        if self.control:
            stream.need_snapshot = True
            stream.synced = False  # until the snapshot comes (it may not: a timeout)
        else:
            self._unrecoverable(stream, missing_from, seq)

    def _unrecoverable(self, stream: RankStream, missing_from: int, seq: int) -> None:
        """Seqs [missing_from, seq) are gone for good: the mirror waits for a reset marker.
        (Before anything was applied, how many seqs came before ``seq`` is unknown: the
        daemon's first seq is not 0; it is counted as one. So is a jump no publisher's history
        spans, over MAX_COUNTED_GAP seqs: another run's seqs, or a forged one.)"""
        gap = seq - missing_from
        stream.counters.lost += gap if stream.last is not None and gap <= MAX_COUNTED_GAP else 1
        stream.synced = False
        stream.gap_counted = False

    def _apply(
        self,
        stream: RankStream,
        seq: int,
        payload: bytes,
        replayed: bool,
        fingerprint: bool = True,
    ) -> list[Received]:
        try:
            batch = decode_batch(payload)
            named = batch.data_parallel_rank
            if named is not None and named != stream.rank:
                # Another rank's batch (a misrouted socket, a forged replay): its events
                # would land in this rank's mirror.
                raise ValueError(f"a batch of rank {named} on rank {stream.rank}'s stream")
        except ValueError:
            stream.counters.malformed += 1
            self._history_gone(stream, seq, seq + 1)
            if not stream.need_snapshot:
                stream.last = seq
            return []
        stream.last = seq
        if fingerprint:
            stream.remember(seq, payload)
        if stream.rebuilding:
            # The new run's first batch: the mirror is rebuilt from it, a resync as it is
            # without control (where the repair jumps onto that batch).
            stream.rebuilding = False
            stream.counters.resyncs += 1
            if self.callbacks.on_resync:
                self.callbacks.on_resync(stream.rank, seq)
        events = batch.events
        if not stream.synced:
            markers = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
            if markers:  # a reset: from here on the mirror is exact again
                stream.synced = True
                stream.mirror = stream.new_mirror()
                events = events[markers[-1] :]
        if stream.synced and stream.mirror is not None:
            try:
                stream.mirror.apply(events)
            except MirrorError:
                stream.counters.violations += 1
                self._history_gone(stream, seq, seq)
        stream.counters.batches += 1
        stream.counters.events += len(batch.events)
        stream.counters.replayed += replayed
        received = Received(stream.rank, seq, batch, payload, replayed)
        if self.callbacks.on_batch:
            self.callbacks.on_batch(received)
        return [received]

    def _restart(self, stream: RankStream, reason: str) -> None:
        stream.counters.restarts += 1
        stream.rebuilding = stream.rebuilding or stream.last is not None
        stream.clear()
        stream.epoch = None
        stream.need_reconnect = True
        stream.need_snapshot = False
        self._resync_from_start(stream)
        self.need_ping = self.control  # learn the new run's epoch
        if self.callbacks.on_restart:
            self.callbacks.on_restart(stream.rank, reason)

    def _resync_from_start(self, stream: RankStream) -> None:
        stream.need_replay = self.replay
        stream.need_snapshot = not self.replay and self.control


def _holds_marker(payload: bytes) -> bool:
    try:
        events = decode_batch(payload).events
    except ValueError:
        return False
    return any(isinstance(e, AllBlocksCleared) for e in events)
