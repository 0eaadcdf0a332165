"""The snapshot protocol's bootstrap, without any I/O: ``SnapshotTracker`` follows ranks whose
publisher serves snapshots (a ``[ts, events, rank, publisher_id]`` stream plus a snapshot
ROUTER) and says when to ask for a snapshot. The subscribers (``kvpubd.client.subscriber``)
read the sockets, feed it, and carry out its ``FetchSnapshot`` requests.

Per rank (``RankBootstrap``):

- waiting: nothing buffered; the first live message (merely connecting a SUB socket does not
  establish delivery) is buffered and a snapshot is wanted;
- requesting: live messages are buffered (up to ``buffer_bytes``) while a snapshot is asked
  for. A reply whose publisher_id is the last buffered one's is built into a NEW private
  ``Mirror``: its chunks in order, then the buffered messages above its seq, which must be
  consecutive from seq + 1 (those at or below it are covered: duplicates). Only a complete
  index is installed; its batches from the buffer are delivered. A -2 or malformed reply, or
  chunks that do not decode or apply, are retried after ``retry_backoff`` seconds; another
  publisher_id or a hole in the buffered suffix starts again from waiting;
- ready: seq ``next`` of the same publisher_id is applied and delivered, a lower one is a
  duplicate; a higher one (a gap), another publisher_id (a restart), a batch that does not
  decode or apply, or ``silence_timeout`` seconds without a message makes the rank's state
  unavailable (``synced`` False) and it bootstraps again.

While a rank is not ready, ``mirror``, ``last`` and ``publisher_id`` describe the last
installed state (an empty mirror before the first) and ``synced`` is False.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpubd.client.mirror import Mirror, MirrorError
from kvpubd.client.tracker import Callbacks, Counters, Received, SubscriberError, check_ranks
from kvpubd.protocol.snapshot_wire import (
    NOTHING_PUBLISHED,
    LiveMessage,
    NoPublisherId,
    SnapshotReply,
    parse_live,
    parse_reply,
)
from kvpubd.protocol.wire import decode_batch

BUFFER_BYTES = 64 << 20
# Bytes a held live message costs beyond its payload (measured: about 110 for a heartbeat).
HELD_MESSAGE_OVERHEAD = 128
SILENCE_TIMEOUT = 5.0
RETRY_BACKOFF = 0.25


@dataclass(frozen=True, slots=True)
class FetchSnapshot:
    """Ask the rank's snapshot socket (a fresh REQ) and feed the reply or the timeout back
    with ``attempt``; stop waiting once ``awaiting`` says the answer is no longer wanted."""

    rank: int
    attempt: int


class Phase(enum.Enum):
    WAITING = "waiting for a live message"
    REQUESTING = "asking for a snapshot"
    READY = "ready"


class _Failed(Exception):
    """This bootstrap attempt cannot succeed; ``restart``: from waiting (empty buffer)."""

    def __init__(self, reason: str, *, restart: bool) -> None:
        super().__init__(reason)
        self.restart = restart


class RankBootstrap:
    """One rank's state: its installed mirror and where its bootstrap stands."""

    def __init__(self, rank: int, keep_mirror: bool, host_medium: str | None = None) -> None:
        self.rank = rank
        self.keep_mirror = keep_mirror
        self.host_medium = host_medium
        self.counters = Counters()
        self.mirror: Mirror | None = self.new_mirror()
        self.last: int | None = None  # last seq applied to the installed mirror
        self.publisher_id: bytes | None = None  # the installed mirror's publisher
        self.phase = Phase.WAITING
        self.attempt = 0  # bumped whenever the outstanding snapshot request stops counting
        self.retry_at = 0.0  # clock time before which no snapshot is asked for
        self.heard_at = 0.0  # clock time of the last live message
        self.seen_id: bytes | None = None  # the last live message's publisher_id
        self.buffer: list[LiveMessage] = []
        self.buffered_bytes = 0

    def new_mirror(self) -> Mirror | None:
        return Mirror(host_medium=self.host_medium) if self.keep_mirror else None

    @property
    def synced(self) -> bool:
        return self.phase is Phase.READY

    @property
    def next_seq(self) -> int:
        return 0 if self.last is None else self.last + 1

    def start_over(self) -> None:
        """Back to waiting with an empty buffer (an outstanding request no longer counts)."""
        self.phase = Phase.WAITING
        self.buffer = []
        self.buffered_bytes = 0
        self.attempt += 1

    def hold(self, message: LiveMessage) -> None:
        self.buffer.append(message)
        # With what each held message costs beside its payload (the message, its seq, its
        # frames): heartbeats of 30 bytes took 4.7 times what was counted.
        self.buffered_bytes += len(message.payload) + HELD_MESSAGE_OVERHEAD
        if self.phase is Phase.WAITING:
            self.phase = Phase.REQUESTING


class SnapshotTracker:
    """Pure state machine of a subscriber following ``ranks`` through the snapshot protocol.

    Feed it with ``on_live``, ``on_snapshot`` and ``on_snapshot_timeout`` (the first two return
    the batches to deliver); call ``tick()`` after reading the sockets (silence). It asks for
    snapshots through ``next_request()``; ``wake_in()`` says when a timed step is due. ``clock``
    (seconds, monotonic) is injectable. Not thread-safe: one shell drives it."""

    def __init__(
        self,
        ranks: Sequence[int],
        *,
        keep_mirror: bool = True,
        callbacks: Callbacks | None = None,
        silence_timeout: float = SILENCE_TIMEOUT,
        retry_backoff: float = RETRY_BACKOFF,
        buffer_bytes: int = BUFFER_BYTES,
        clock: Callable[[], float] = time.monotonic,
        host_medium: str | None = None,
    ) -> None:
        check_ranks(ranks)
        if not silence_timeout > 0:
            raise ValueError(f"silence_timeout: {silence_timeout} is not a positive number")
        self.callbacks = callbacks or Callbacks()
        self.silence_timeout = silence_timeout
        self.retry_backoff = retry_backoff
        self.buffer_bytes = buffer_bytes
        self.clock = clock
        self.streams = {rank: RankBootstrap(rank, keep_mirror, host_medium) for rank in ranks}
        self.epoch: int | None = None  # a control-protocol notion: never known here

    # -- what to do next -----------------------------------------------------------------

    def next_request(self) -> FetchSnapshot | None:
        now = self.clock()
        for stream in self.streams.values():
            if stream.phase is Phase.REQUESTING and now >= stream.retry_at:
                return FetchSnapshot(stream.rank, stream.attempt)
        return None

    def awaiting(self, request: FetchSnapshot) -> bool:
        """Whether the answer to ``request`` is still wanted (a buffer overflow drops it)."""
        stream = self.streams[request.rank]
        return stream.phase is Phase.REQUESTING and stream.attempt == request.attempt

    def wake_in(self) -> float | None:
        """Seconds until a timed step is due (a retry, a silence), None when none is."""
        now = self.clock()
        due: list[float] = []
        for stream in self.streams.values():
            if stream.phase is Phase.REQUESTING:
                due.append(stream.retry_at - now)
            elif stream.phase is Phase.READY:
                due.append(stream.heard_at + self.silence_timeout - now)
        return max(0.0, min(due)) if due else None

    def all_ready(self) -> bool:
        return all(stream.synced for stream in self.streams.values())

    def counters(self) -> Counters:
        return Counters.total(stream.counters for stream in self.streams.values())

    # -- inputs --------------------------------------------------------------------------

    def on_live(self, rank: int, frames: list[bytes]) -> list[Received]:
        """A message from the rank's SUB socket. A batch without a publisher_id raises
        SubscriberError: that publisher does not serve snapshots."""
        stream = self.streams[rank]
        try:
            message = parse_live(frames, rank)
        except NoPublisherId:
            stream.counters.malformed += 1
            raise SubscriberError(
                f"rank {rank}: the publisher sends [ts, events, rank] batches without a "
                "publisher_id: it does not serve snapshots (give it a snapshot endpoint, or "
                "subscribe without snapshot_endpoint)"
            ) from None
        except ValueError:
            stream.counters.malformed += 1
            return []
        stream.heard_at = self.clock()
        previous, stream.seen_id = stream.seen_id, message.publisher_id
        if previous is not None and previous != message.publisher_id:
            stream.counters.restarts += 1
            if self.callbacks.on_restart:
                self.callbacks.on_restart(rank, "the publisher_id changed: the publisher restarted")
            if stream.phase is Phase.REQUESTING:
                # The old lifetime's messages can never follow a snapshot of the new one, and
                # a request the old one took will never be answered: asked again at once (it
                # was waited for until snapshot_timeout, 10 s).
                self._unavailable(stream)
        if stream.phase is not Phase.READY:
            return self._hold(stream, message)
        if message.publisher_id != stream.publisher_id:
            self._unavailable(stream)
            return self._hold(stream, message)
        if message.seq < stream.next_seq:
            stream.counters.duplicates += 1
            return []
        if message.seq > stream.next_seq:
            stream.counters.gaps += 1
            if self.callbacks.on_gap:
                self.callbacks.on_gap(rank, stream.next_seq, message.seq)
            self._unavailable(stream)
            return self._hold(stream, message)
        try:
            received = self._apply(stream, stream.mirror, message)
        except _Failed:
            # Held: a snapshot at its seq or later covers it.
            self._unavailable(stream)
            return self._hold(stream, message)
        return self._delivered(stream, [received])

    def on_snapshot(self, request: FetchSnapshot, frames: list[bytes]) -> list[Received]:
        """The reply to ``request``: installs the rank's new mirror when the bootstrap
        completes, and returns the buffered batches above the snapshot's seq."""
        if not self.awaiting(request):
            return []  # answers a question no longer asked
        stream = self.streams[request.rank]
        stream.attempt += 1
        try:
            reply = parse_reply(frames)
        except ValueError:
            stream.counters.malformed += 1
            return self._failed(stream, restart=False)
        if reply.seq < NOTHING_PUBLISHED:
            return self._failed(stream, restart=False)
        try:
            return self._install(stream, reply)
        except _Failed as failure:
            return self._failed(stream, restart=failure.restart)

    def on_snapshot_timeout(self, request: FetchSnapshot) -> None:
        """No reply in time: asked again (fresh socket) at the next ``next_request``."""
        if self.awaiting(request):
            stream = self.streams[request.rank]
            stream.attempt += 1
            stream.counters.snapshots_failed += 1

    def tick(self) -> None:
        """After reading the sockets: a ready rank silent for ``silence_timeout`` seconds (a
        publisher heartbeats within 1 s) is unavailable, and bootstraps again."""
        now = self.clock()
        for stream in self.streams.values():
            if stream.phase is Phase.READY and now - stream.heard_at >= self.silence_timeout:
                stream.counters.silences += 1
                self._unavailable(stream)

    def on_timeout(self) -> None:
        """The shells' hook after a request timed out: ``on_snapshot_timeout`` did it all."""

    # -- internals -----------------------------------------------------------------------

    def _hold(self, stream: RankBootstrap, message: LiveMessage) -> list[Received]:
        stream.hold(message)
        if stream.buffered_bytes > self.buffer_bytes:
            # The snapshot comes slower than the stream: its reply could not be followed.
            stream.counters.snapshots_failed += 1
            stream.start_over()
        return []

    def _unavailable(self, stream: RankBootstrap) -> None:
        stream.start_over()
        stream.retry_at = 0.0

    def _failed(self, stream: RankBootstrap, *, restart: bool) -> list[Received]:
        stream.counters.snapshots_failed += 1
        if restart:
            stream.start_over()
        else:
            stream.retry_at = self.clock() + self.retry_backoff
        return []

    def _install(self, stream: RankBootstrap, reply: SnapshotReply) -> list[Received]:
        buffer = stream.buffer
        if reply.publisher_id != buffer[-1].publisher_id:
            raise _Failed("the publisher restarted during the bootstrap", restart=True)
        mirror = stream.new_mirror()
        for chunk in reply.chunks:
            self._apply_chunk(stream, mirror, chunk)
        suffix = [m for m in buffer if m.seq > reply.seq]
        expected = range(reply.seq + 1, reply.seq + 1 + len(suffix))
        if [m.seq for m in suffix] != list(expected) or any(
            m.publisher_id != reply.publisher_id for m in suffix
        ):
            raise _Failed("the buffered messages do not follow the snapshot", restart=True)
        applied = [self._apply(stream, mirror, message) for message in suffix]
        stream.counters.duplicates += len(buffer) - len(suffix)
        stream.mirror = mirror
        stream.publisher_id = reply.publisher_id
        stream.last = suffix[-1].seq if suffix else (reply.seq if reply.seq >= 0 else None)
        stream.phase = Phase.READY
        stream.buffer, stream.buffered_bytes = [], 0
        stream.counters.resyncs += 1
        if self.callbacks.on_resync:
            self.callbacks.on_resync(stream.rank, reply.seq)
        return self._delivered(stream, applied)

    def _apply_chunk(self, stream: RankBootstrap, mirror: Mirror | None, chunk: bytes) -> None:
        if mirror is None:
            return  # nothing to build: the chunks are not even decoded
        try:
            batch = decode_batch(chunk)
            if batch.data_parallel_rank not in (None, stream.rank):
                raise ValueError(f"a chunk of rank {batch.data_parallel_rank}")
        except ValueError:
            stream.counters.malformed += 1
            raise _Failed("a chunk does not decode", restart=False) from None
        try:
            mirror.apply(batch.events)
        except MirrorError:
            stream.counters.violations += 1
            raise _Failed("the chunks break an invariant", restart=False) from None

    def _apply(
        self, stream: RankBootstrap, mirror: Mirror | None, message: LiveMessage
    ) -> Received:
        """Decode ``message`` and apply it to ``mirror``; _Failed when it cannot be."""
        try:
            batch = decode_batch(message.payload)
        except ValueError:
            stream.counters.malformed += 1
            raise _Failed(f"batch {message.seq} does not decode", restart=True) from None
        if mirror is not None:
            try:
                mirror.apply(batch.events)
            except MirrorError:
                stream.counters.violations += 1
                raise _Failed(f"batch {message.seq} breaks an invariant", restart=True) from None
        return Received(stream.rank, message.seq, batch, message.payload, replayed=False)

    def _delivered(self, stream: RankBootstrap, batches: list[Received]) -> list[Received]:
        for received in batches:
            stream.last = received.seq
            stream.counters.batches += 1
            stream.counters.events += len(received.batch.events)
            if self.callbacks.on_batch:
                self.callbacks.on_batch(received)
        return batches
