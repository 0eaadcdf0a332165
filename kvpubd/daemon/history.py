"""What one rank published, whatever carries it: the seqs, the ring of sent batches kept for
replay, heartbeat timing and the snapshot batch that stands in for history the ring lost.

``publish(events)`` numbers and encodes one batch, keeps it in the ring and hands it to
``send`` (its transport's, see ``transports``); it is in the transport's hands when this
returns its seq. Seqs start at ``first_seq`` (see ``seq_origin``) and grow by one per batch.
``record_seq`` is told each seq before its batch goes out (the seq state file of
``seq_origin = "continue"``). Readers of the ring (replays) ``hold`` the history they have
yet to read, so that trimming the ring leaves it to them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Protocol

from kvpubd.daemon.snapshot import Buffer, Snapshot
from kvpubd.protocol.wire import (
    MAX_SEQ,
    PUBLISHER_ID_BYTES,
    BatchEncoder,
    Event,
    WireFormat,
    pack_seq,
)

# Batches the ring may keep beyond buffer_steps for the readers holding it (buffer_steps if
# larger): what goes out while a snapshot batch of lost history is put together.
REPLAY_EXTRA_BATCHES = 4096
# Empty batches a run that continues an earlier run's seqs keeps for replay just below its
# first seq: a consumer that lost the old run's last batches in flight (a kill -9 drops what
# ZeroMQ still queued) replays from its own last seq + 1 and must find exactly that seq.
# Empty is right: the run's first batch, AllBlocksCleared, follows them.
RESTART_OVERLAP = 1024
# Bytes of payload the ring keeps at most, whatever buffer_steps says: batches are bounded in
# blocks, not in bytes (an engine followed in upstream mode names its own block size, so a
# block's tokens may be many), and the ring must not grow the daemon without bound.
DEFAULT_BUFFER_BYTES = 512 << 20

SnapshotBatch = tuple[int, Buffer]  # (seq, payload) of a replay batch holding the whole state
Send = Callable[[bytes, bytes], None]  # (seq frame, payload) of one batch, to its transport


class SnapshotSupply(Protocol):
    """What the history asks for when a reader wants history it no longer holds."""

    @property
    def result(self) -> asyncio.Future[Snapshot]: ...


# The rank's current snapshot job, shared by whoever asks (a new one once the last is stale).
Snapshots = Callable[[], SnapshotSupply]


class Reader(Protocol):
    """A reader of the ring (a replay) holding back the history it has yet to read."""

    @property
    def needs_from(self) -> int:
        """The oldest seq it may still read from the ring."""
        ...


def seq_origin(mode: str, last_seq: int | None = None, max_seq: int = MAX_SEQ) -> int:
    """The first seq of a run. "continue": the previous run's ``last_seq`` + 1 (0 for a first
    run, and after the last seq there is), so every consumer applies the new run's first batch
    in order. "clock": the wall clock in microseconds, so every run's seqs lie above the last
    run's (a run would have to average a million batches a second to overtake the clock) and a
    restart looks like a forward jump to consumers that keep the last seq they applied. "zero":
    every run starts again at 0. ``max_seq``: the last seq "continue" goes on from (the
    snapshot protocol numbers seqs as signed: ``MAX_SIGNED_SEQ`` while it is served)."""
    if mode == "continue":
        return 0 if last_seq is None or last_seq >= max_seq else last_seq + 1
    if mode == "zero":
        return 0
    if mode == "clock":
        return time.time_ns() // 1000
    raise ValueError(f"seq origin {mode!r}: use 'continue', 'clock' or 'zero'")


def _nowhere(seq_frame: bytes, payload: bytes) -> None:
    raise RuntimeError("this history has no transport to send its batches (see Publisher)")


class History:
    def __init__(
        self,
        *,
        wire_format: WireFormat = "map",
        rank: int = 0,
        buffer_steps: int = 10_000,
        first_seq: int = 0,
        heartbeat_ms: int = 0,
        overlap: int = 0,
        record_seq: Callable[[int], None] | None = None,
        lost_history: Snapshots | None = None,
        publisher_id: bytes | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> None:
        if not 0 <= first_seq <= MAX_SEQ:
            raise ValueError(f"first_seq: {first_seq} is not a seq (0..{MAX_SEQ})")
        if publisher_id is not None and len(publisher_id) != PUBLISHER_ID_BYTES:
            raise ValueError(f"publisher_id: {len(publisher_id)} bytes, not {PUBLISHER_ID_BYTES}")
        self.rank = rank
        self.wire_format = wire_format
        # The snapshot protocol's identity of this run: every batch carries it (None: off).
        self.publisher_id = publisher_id
        self._encoder = BatchEncoder(wire_format, rank, publisher_id)
        self.first_seq = first_seq
        self._next_seq = first_seq
        self.heartbeat_s = heartbeat_ms / 1000
        self._last_sent = time.monotonic()
        self.send: Send = _nowhere
        # (seq frame, payload) of the last buffer_steps batches, oldest first; up to
        # max_retained while a reader still needs the older ones (see _trim).
        self._ring: deque[tuple[bytes, bytes]] = deque()
        self.buffer_steps = buffer_steps
        self.buffer_bytes = buffer_bytes
        self._ring_bytes = 0  # of the payloads the ring holds
        self._record_seq = record_seq
        # ``overlap`` empty batches below first_seq, for replay only (see RESTART_OVERLAP).
        overlap = min(overlap, first_seq, buffer_steps)
        if overlap:
            empty = self._encoder.encode(time.time(), [])
            self._ring.extend((pack_seq(s), empty) for s in range(first_seq - overlap, first_seq))
            self._ring_bytes = overlap * len(empty)
        self.max_retained = buffer_steps + max(buffer_steps, REPLAY_EXTRA_BATCHES)
        self.batches = 0
        self.events = 0
        # The last batch that held events: the state published at any later seq is the same.
        self.last_event_seq = first_seq - 1
        self._holds: list[Reader] = []
        # The snapshot of the current state, for readers of history the ring lost (the rank's
        # pipeline's); without it such a reader gets what the ring holds.
        self.lost_history = lost_history
        self._snapshot_batches: (
            tuple[asyncio.Future[Snapshot], asyncio.Future[SnapshotBatch]] | None
        ) = None

    @property
    def next_seq(self) -> int:
        """The seq the next batch gets."""
        return self._next_seq

    @property
    def last_seq(self) -> int:
        """The seq of the last batch sent, ``first_seq - 1`` before the first."""
        return self._next_seq - 1

    def publish(self, events: list[Event], ts: float | None = None) -> int:
        """Encode, number and send one batch; it is in the transport's hands when this
        returns its seq."""
        seq = self._next_seq
        if seq > MAX_SEQ:
            raise OverflowError("sequence space exhausted")
        self._next_seq = seq + 1
        payload = self._encoder.encode(time.time() if ts is None else ts, events)
        seq_frame = pack_seq(seq)
        record = self._record_seq
        if record is not None:  # before the send: a seq that may be out is never reused
            record(seq)
        ring = self._ring
        ring.append((seq_frame, payload))
        self._ring_bytes += len(payload)
        if len(ring) > self.buffer_steps:
            if self._holds:
                self._trim()
            else:  # back to buffer_steps, also after readers had it keep more
                while len(ring) > self.buffer_steps:
                    self._drop_oldest()
        # Whatever readers still need (one that falls behind starts over from a snapshot
        # batch, as past max_retained); the newest batch stays.
        while self._ring_bytes > self.buffer_bytes and len(ring) > 1:
            self._drop_oldest()
        self.send(seq_frame, payload)
        self._last_sent = time.monotonic()
        self.batches += 1
        self.events += len(events)
        if events:
            self.last_event_seq = seq
        return seq

    def _trim(self) -> None:
        """Drop batches beyond buffer_steps that no reader holding the ring still needs: a
        replay of lost history waits for its snapshot batch and then sends what followed it,
        so under load the ring must not move past that while the batch is put together (it
        would never catch up). At most max_retained batches: past that a reader that fell
        behind starts over from a newer snapshot batch."""
        ring = self._ring
        first = self._next_seq - len(ring)
        needed = min(reader.needs_from for reader in self._holds)
        keep = self._next_seq - max(needed, first)
        target = max(self.buffer_steps, min(keep, self.max_retained))
        while len(ring) > target:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        self._ring_bytes -= len(self._ring.popleft()[1])

    def heartbeat(self) -> int | None:
        """Publish an empty batch (``[ts, [], rank]``, and the publisher id while snapshots are
        served) if nothing went out for the heartbeat interval; returns its seq, or None. An
        ordinary batch (numbered, kept for replay): a consumer that missed the last batch sees
        the gap, and one that joined an idle daemon hears of it, within one interval."""
        if not self.heartbeat_s or time.monotonic() - self._last_sent < self.heartbeat_s:
            return None
        return self.publish([])

    # -- readers ------------------------------------------------------------------------------

    def hold(self, reader: Reader) -> None:
        """Keep what ``reader`` has yet to read (up to max_retained) until it is released."""
        self._holds.append(reader)

    def release(self, reader: Reader) -> None:
        if reader in self._holds:
            self._holds.remove(reader)

    def read(self, start: int, limit: int) -> tuple[int, Iterator[tuple[bytes, bytes]]]:
        """Up to ``limit`` retained batches (seq frame, payload) from seq ``start``, or from
        the oldest retained if that is later; and the seq of the first of them. Clamped: a
        start far past the last seq (up to 2^64 - 1) reads nothing."""
        ring = self._ring
        first = self._next_seq - len(ring)
        skip = min(max(0, start - first), len(ring))
        return first + skip, islice(ring, skip, skip + limit)

    def lost(self, seq: int) -> bool:
        """Whether ``seq`` is history the ring no longer holds, which a snapshot batch stands
        in for (see ``snapshot_batch``). (The ring starts at or below first_seq while it holds
        all of this run.)"""
        first = self._next_seq - len(self._ring)
        return seq < first and first > self.first_seq and self.lost_history is not None

    def snapshot_batch(self) -> asyncio.Future[SnapshotBatch]:
        """A replay batch of the current state (``lost_history`` must be set), put together
        once for every reader that sends it."""
        assert self.lost_history is not None
        job = self.lost_history().result
        cached = self._snapshot_batches
        if cached is None or cached[0] is not job:
            batch = asyncio.ensure_future(self._put_together(job))
            cached = self._snapshot_batches = (job, batch)
        return cached[1]

    def forget_snapshot_batch(self) -> None:
        """Let go of the last snapshot batch once put together (the rank's state moved on: a
        later reader of lost history gets a newer one); one still being put together stays."""
        cached = self._snapshot_batches
        if cached is not None and cached[1].done():
            self._snapshot_batches = None

    async def _put_together(self, job: asyncio.Future[Snapshot]) -> SnapshotBatch:
        snapshot = await asyncio.shield(job)
        while snapshot.freed and self.lost_history is not None:  # retired: the newer build
            snapshot = await asyncio.shield(self.lost_history().result)
        payload = await snapshot.batch_payload(
            time.time(), self.rank, self.wire_format, self.publisher_id
        )
        return snapshot.seq, payload
