"""Transport for one rank: the PUB socket, the replay ROUTER and the ring of sent batches.

Usable as a library: ``Publisher(...).publish(events)`` encodes, numbers and sends one batch
and returns its seq; ``handle_replay()`` answers whatever replay requests are waiting.

Seqs start at ``first_seq`` (see ``seq_origin``) and grow by one per batch. ``heartbeat()``
publishes an empty batch when nothing went out for ``heartbeat_ms``. ``record_seq`` is told each
seq before its batch goes out (the seq state file of ``seq_origin = "continue"``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Protocol

import zmq

from kvpubd.daemon.snapshot import Buffer, Snapshot
from kvpubd.daemon.zmq_loop import (
    LIVE_AFFINITY,
    REPLAY_AFFINITY,
    listener,
    readable,
    reader_fd,
)
from kvpubd.protocol.wire import END_SEQ, MAX_SEQ, BatchEncoder, Event, WireFormat, pack_seq


class SnapshotSupply(Protocol):
    """What the publisher asks for when a replay wants history it no longer holds."""

    @property
    def result(self) -> asyncio.Future[Snapshot]: ...


log = logging.getLogger(__name__)

REPLAY_MAX_MESSAGE_BYTES = 256  # a replay request is 8 bytes; anything far larger is abuse
REPLAY_CHUNK = 64  # batches one replay sends before the next replay gets a turn
REPLAY_ACCEPT = 32  # replay requests read per loop turn: a flood waits in ZeroMQ, not here
REPLAY_SLICE_S = 0.0005  # replay work per loop turn
# Batches the ring may keep beyond buffer_steps for the replays in progress (buffer_steps if
# larger): what goes out while a snapshot batch of lost history is put together.
REPLAY_EXTRA_BATCHES = 4096
# Empty batches a run that continues an earlier run's seqs keeps for replay just below its
# first seq: a consumer that lost the old run's last batches in flight (a kill -9 drops what
# ZeroMQ still queued) replays from its own last seq + 1 and must find exactly that seq.
# Empty is right: the run's first batch, AllBlocksCleared, follows them.
RESTART_OVERLAP = 1024
_MORE = int(zmq.SNDMORE)  # a plain int: combining pyzmq's flag enums costs per frame


def seq_origin(mode: str, last_seq: int | None = None) -> int:
    """The first seq of a run. "continue": the previous run's ``last_seq`` + 1 (0 for a first
    run, and after the last seq there is), so every consumer applies the new run's first batch
    in order. "clock": the wall clock in microseconds, so every run's seqs lie above the last
    run's (a run would have to average a million batches a second to overtake the clock) and a
    restart looks like a forward jump to consumers that keep the last seq they applied. "zero":
    every run starts again at 0."""
    if mode == "continue":
        return 0 if last_seq is None or last_seq >= MAX_SEQ else last_seq + 1
    if mode == "zero":
        return 0
    if mode == "clock":
        return time.time_ns() // 1000
    raise ValueError(f"seq origin {mode!r}: use 'continue', 'clock' or 'zero'")


SnapshotBatch = tuple[int, Buffer]  # (seq, payload) of a replay batch holding the whole state


@dataclass(slots=True, eq=False)  # one replay is one request: compared by identity
class _Replay:
    identity: bytes
    next_seq: int
    # Set while the replay waits for a snapshot batch (its history is no longer retained).
    snapshot: asyncio.Future[SnapshotBatch] | None = None
    # The seq of the first batch published after it began to wait: the snapshot it waits for
    # is of that moment or later, so the ring keeps what follows from here on.
    parked_at: int = 0

    @property
    def needs_from(self) -> int:
        """The oldest seq this replay may still send from the ring."""
        return self.parked_at if self.snapshot is not None else self.next_seq


class Publisher:
    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        *,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        wire_format: WireFormat = "map",
        rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        replay_framing: str = "v026",
        linger_ms: int = 2000,
        max_replays: int = 64,
        first_seq: int = 0,
        heartbeat_ms: int = 0,
        overlap: int = 0,
        record_seq: Callable[[int], None] | None = None,
    ) -> None:
        if not 0 <= first_seq <= MAX_SEQ:
            raise ValueError(f"first_seq: {first_seq} is not a seq (0..{MAX_SEQ})")
        self.rank = rank
        self.topic = topic.encode()
        self.legacy_replay = replay_framing == "legacy"
        self.wire_format = wire_format
        self._encoder = BatchEncoder(wire_format, rank)
        self.first_seq = first_seq
        self._next_seq = first_seq
        self.heartbeat_s = heartbeat_ms / 1000
        self._last_sent = time.monotonic()
        # (seq frame, payload) of the last buffer_steps batches, oldest first; up to
        # max_retained while a replay still needs the older ones (see _trim).
        self._ring: deque[tuple[bytes, bytes]] = deque()
        self.buffer_steps = buffer_steps
        self._record_seq = record_seq
        # ``overlap`` empty batches below first_seq, for replay only (see RESTART_OVERLAP).
        overlap = min(overlap, first_seq, buffer_steps)
        if overlap:
            empty = self._encoder.encode(time.time(), [])
            self._ring.extend((pack_seq(s), empty) for s in range(first_seq - overlap, first_seq))
        self.max_retained = buffer_steps + max(buffer_steps, REPLAY_EXTRA_BATCHES)
        self.batches = 0
        self.events = 0
        self.replay_requests = 0
        self.replays_refused = 0
        self.max_replays = max_replays
        self._replays: deque[_Replay] = deque()  # streaming, round-robin
        self._waiting: list[_Replay] = []  # waiting for a snapshot batch
        # The snapshot of the current state, for replays of history the ring lost (set by the
        # rank's pipeline); without it such a replay gets what the ring holds.
        self.lost_history: Callable[[], SnapshotSupply] | None = None
        self._pump_scheduled = False
        self._snapshot_batches: (
            tuple[asyncio.Future[Snapshot], asyncio.Future[SnapshotBatch]] | None
        ) = None
        self._replay_fd: int | None = None

        self.pub = listener(context.socket(zmq.PUB), LIVE_AFFINITY, context)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.setsockopt(zmq.LINGER, linger_ms)
        self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

        self.replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint = ""
        if replay_endpoint:
            self.replay = listener(context.socket(zmq.ROUTER), REPLAY_AFFINITY, context)
            # A full replay (the whole ring, a snapshot batch and the end marker) always fits.
            self.replay.setsockopt(zmq.SNDHWM, 2 * (self.max_retained + 2))
            self.replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_MESSAGE_BYTES)
            # Errors instead of silent drops: a gone or stalled peer ends its replay early.
            self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.replay.setsockopt(zmq.LINGER, 0)
            # Payloads go without a copy whatever their size (pyzmq copies those under 64 kB
            # even when asked not to): every replay shares the ring's bytes.
            self.replay.copy_threshold = 0
            try:
                self.replay.bind(replay_endpoint)
            except zmq.ZMQError:
                self.close()  # the PUB socket's file must not outlive a failed start
                raise
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replays_in_progress(self) -> int:
        """Replays accepted and not finished (streaming, or waiting for a snapshot batch)."""
        return len(self._replays) + len(self._waiting)

    @property
    def last_seq(self) -> int:
        """The seq of the last batch sent, ``first_seq - 1`` before the first."""
        return self._next_seq - 1

    def publish(self, events: list[Event], ts: float | None = None) -> int:
        """Encode and send one batch; it is in ZeroMQ's hands when this returns its seq."""
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
        if len(ring) > self.buffer_steps:
            if self._replays or self._waiting:
                self._trim()
            else:  # back to buffer_steps, also after replays had it keep more
                while len(ring) > self.buffer_steps:
                    ring.popleft()
        # PUB never blocks: at the HWM ZeroMQ drops for that subscriber, and replay repairs it.
        send = self.pub.send
        send(self.topic, _MORE)
        send(seq_frame, _MORE)
        send(payload)
        self._last_sent = time.monotonic()
        self.batches += 1
        self.events += len(events)
        return seq

    def _trim(self) -> None:
        """Drop batches beyond buffer_steps that no replay in progress still needs: a replay
        of lost history waits for its snapshot batch and then sends what followed it, so under
        load the ring must not move past that while the batch is put together (it would never
        catch up). At most max_retained batches: past that a replay that fell behind starts
        over from a newer snapshot batch."""
        ring = self._ring
        first = self._next_seq - len(ring)
        needed = min(r.needs_from for r in (*self._replays, *self._waiting))
        keep = self._next_seq - max(needed, first)
        target = max(self.buffer_steps, min(keep, self.max_retained))
        while len(ring) > target:
            ring.popleft()

    def heartbeat(self) -> int | None:
        """Publish an empty batch ``[ts, [], rank]`` if nothing went out for the heartbeat
        interval; returns its seq, or None. An ordinary batch (numbered, kept for replay): a
        consumer that missed the last batch sees the gap, and one that joined an idle daemon
        hears of it, within one interval."""
        if not self.heartbeat_s or time.monotonic() - self._last_sent < self.heartbeat_s:
            return None
        return self.publish([])

    def start(self) -> None:
        """Serve replay requests from the running loop (a reader on the ROUTER's FD)."""
        if self.replay is None:
            return
        loop = asyncio.get_running_loop()
        self._replay_fd = reader_fd(self.replay)
        loop.add_reader(self._replay_fd, self._pump)
        self._schedule_pump()  # anything that arrived before the reader existed

    def stop(self) -> None:
        if self._replay_fd is not None:
            asyncio.get_running_loop().remove_reader(self._replay_fd)
            self._replay_fd = None

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        if self.handle_replay():
            self._schedule_pump()

    def handle_replay(self, slice_s: float = REPLAY_SLICE_S) -> bool:
        """Take up to REPLAY_ACCEPT waiting requests and stream the replays in progress,
        round-robin, for about ``slice_s`` seconds, without blocking. Returns True while work
        remains: call it again on a later loop turn (no replay or flood holds the loop)."""
        sock = self.replay
        if sock is None:
            return False
        deadline = time.perf_counter() + slice_s
        for _ in range(REPLAY_ACCEPT):
            # Reading EVENTS after our own sends re-arms the socket's edge-triggered FD.
            if not readable(sock):
                break
            self._accept(sock.recv_multipart(zmq.NOBLOCK))
        while self._replays and time.perf_counter() < deadline:
            replay = self._replays.popleft()
            if not self._stream(sock, replay, REPLAY_CHUNK):
                self._replays.append(replay)
        more_requests = readable(sock)
        return bool(self._replays) or more_requests

    def _accept(self, frames: list[bytes]) -> None:
        # [identity, b"", start_seq]: what a REQ sends (a DEALER sends [b"", start_seq]).
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.debug(
                "rank %d: ignored malformed replay request (%d frames)", self.rank, len(frames)
            )
            return
        if self.replays_in_progress >= self.max_replays:
            # No reply: the client times out and asks again once the others are served.
            self.replays_refused += 1
            log.debug("rank %d: %d replays in progress, one refused", self.rank, self.max_replays)
            return
        self.replay_requests += 1
        replay = _Replay(frames[0], int.from_bytes(frames[2], "big"))
        log.debug("rank %d: replay from seq %d", self.rank, replay.next_seq)
        if not self._wait_for_snapshot(replay):
            self._replays.append(replay)

    def _wait_for_snapshot(self, replay: _Replay) -> bool:
        """Park a replay whose start the ring no longer holds until a snapshot batch of the
        current state is ready; False when the ring has what it asks for."""
        first = self._next_seq - len(self._ring)
        # (The ring starts at or below first_seq while it holds all of this run.)
        if replay.next_seq >= first or first <= self.first_seq or self.lost_history is None:
            return False
        replay.snapshot = self._snapshot_batch(self.lost_history().result)
        replay.parked_at = self._next_seq
        self._waiting.append(replay)
        replay.snapshot.add_done_callback(lambda _: self._snapshot_ready(replay))
        return True

    def _snapshot_ready(self, replay: _Replay) -> None:
        if replay in self._waiting:
            self._waiting.remove(replay)
            self._replays.append(replay)
            self._schedule_pump()

    def _snapshot_batch(self, job: asyncio.Future[Snapshot]) -> asyncio.Future[SnapshotBatch]:
        """The job's replay batch, put together once for every replay that sends it."""
        cached = self._snapshot_batches
        if cached is None or cached[0] is not job:
            batch = asyncio.ensure_future(self._put_together(job))
            cached = self._snapshot_batches = (job, batch)
        return cached[1]

    async def _put_together(self, job: asyncio.Future[Snapshot]) -> SnapshotBatch:
        snapshot = await asyncio.shield(job)
        payload = await snapshot.batch_payload(time.time(), self.rank, self.wire_format)
        return snapshot.seq, payload

    def _stream(self, sock: zmq.Socket[bytes], replay: _Replay, limit: int) -> bool:
        """Send up to ``limit`` batches of ``replay`` (its snapshot batch first, if it waited
        for one); the end marker once it is past the last. Returns True when it leaves the
        queue: finished, or parked until a newer snapshot batch is ready."""
        head = (replay.identity, b"") if self.legacy_replay else (replay.identity, b"", self.topic)
        try:
            snapshot: SnapshotBatch | None = None
            if replay.snapshot is not None:
                batch, replay.snapshot = replay.snapshot, None
                if batch.cancelled() or batch.exception() is not None:
                    return True  # no end marker: the client asks again
                snapshot = batch.result()
                replay.next_seq = snapshot[0] + 1
            if self._wait_for_snapshot(replay):
                # The ring no longer holds what comes next (a snapshot older than the moment
                # the replay parked, or a stream that fell behind the ring's limit): nothing
                # is sent that would leave a gap; the replay waits for a newer snapshot batch,
                # which _snapshot_ready queues (so it leaves the queue here).
                log.debug("rank %d: a replay fell behind the ring", self.rank)
                return True
            if snapshot is not None:
                # Without a copy: every replay shares the one payload.
                seq, snapshot_payload = snapshot
                sock.send_multipart(
                    (*head, pack_seq(seq), snapshot_payload), zmq.NOBLOCK, copy=False
                )
            ring = self._ring
            first = self._next_seq - len(ring)
            # Clamped: a start far past the last seq (up to 2^64 - 1) sends nothing.
            skip = min(max(0, replay.next_seq - first), len(ring))
            sent = 0
            for seq_frame, payload in islice(ring, skip, skip + limit):
                for frame in (*head, seq_frame):
                    sock.send(frame, zmq.SNDMORE | zmq.NOBLOCK)
                # A copy per replay let each client that never reads hold a whole ring's
                # worth of daemon memory.
                sock.send(payload, zmq.NOBLOCK, copy=False)
                sent += 1
            replay.next_seq = max(replay.next_seq, first + skip + sent)
            if first + skip + sent < self._next_seq:
                return False
            end = head[:2] if self.legacy_replay else (*head[:2], b"")
            sock.send_multipart((*end, END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or over its HWM: it sees no end marker, asks again
            log.debug("rank %d: replay to a peer stopped: %s", self.rank, exc)
        return True

    def close(self) -> None:
        self.stop()
        if self.replay is not None:
            self.replay.close()
            # A pump already scheduled, or a snapshot batch finished later, finds no socket
            # and no replays (they once raised on the closed socket during shutdown).
            self.replay = None
            self._replays.clear()
            self._waiting.clear()
        self.pub.close()
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint.startswith("ipc://"):
                Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
