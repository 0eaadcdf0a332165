"""Transport for one rank: the PUB socket, the replay ROUTER and the ring of sent batches.

Usable as a library: ``Publisher(...).publish(events)`` encodes, numbers and sends one batch
and returns its seq; ``handle_replay()`` answers whatever replay requests are waiting.

Seqs start at ``first_seq`` (see ``seq_origin``) and grow by one per batch. ``heartbeat()``
publishes an empty batch when nothing went out for ``heartbeat_ms``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import zmq

from kvpubd.protocol.wire import END_SEQ, MAX_SEQ, BatchEncoder, Event, WireFormat, pack_seq

log = logging.getLogger(__name__)

REPLAY_MAX_MESSAGE_BYTES = 256  # a replay request is 8 bytes; anything far larger is abuse
REPLAY_CHUNK = 256  # batches one replay sends per turn of the loop
ZERO_COPY_BYTES = 65536  # pyzmq's own threshold: below it a copy is cheaper than tracking


def seq_origin(mode: str) -> int:
    """The first seq of a run. "clock": the wall clock in microseconds, so every run's seqs lie
    above the last run's (a run would have to average a million batches a second to overtake
    the clock) and a restart looks like a forward jump to consumers that keep the last seq they
    applied. "zero": every run starts again at 0."""
    if mode == "zero":
        return 0
    if mode == "clock":
        return time.time_ns() // 1000
    raise ValueError(f"seq origin {mode!r}: use 'clock' or 'zero'")


@dataclass(slots=True)
class _Replay:
    identity: bytes
    next_seq: int


class Publisher:
    def __init__(
        self,
        context: zmq.Context,
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
    ) -> None:
        if not 0 <= first_seq <= MAX_SEQ:
            raise ValueError(f"first_seq: {first_seq} is not a seq (0..{MAX_SEQ})")
        self.rank = rank
        self.topic = topic.encode()
        self.legacy_replay = replay_framing == "legacy"
        self._encoder = BatchEncoder(wire_format, rank)
        self.first_seq = first_seq
        self._next_seq = first_seq
        self.heartbeat_s = heartbeat_ms / 1000
        self._last_sent = time.monotonic()
        # (seq frame, payload) of the last buffer_steps batches, oldest first.
        self._ring: deque[tuple[bytes, bytes]] = deque(maxlen=buffer_steps)
        self.batches = 0
        self.events = 0
        self.replay_requests = 0
        self.replays_refused = 0
        self.max_replays = max_replays
        self._replays: deque[_Replay] = deque()

        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.pub.setsockopt(zmq.LINGER, linger_ms)
        self.pub.bind(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)

        self.replay: zmq.Socket | None = None
        self.replay_endpoint = ""
        if replay_endpoint:
            self.replay = context.socket(zmq.ROUTER)
            # A full replay plus its end marker always fits.
            self.replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self.replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_MESSAGE_BYTES)
            # Errors instead of silent drops: a gone or stalled peer ends its replay early.
            self.replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)

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
        self._ring.append((seq_frame, payload))
        # PUB never blocks: at the HWM ZeroMQ drops for that subscriber, and replay repairs it.
        self.pub.send_multipart((self.topic, seq_frame, payload))
        self._last_sent = time.monotonic()
        self.batches += 1
        self.events += len(events)
        return seq

    def heartbeat(self) -> int | None:
        """Publish an empty batch ``[ts, [], rank]`` if nothing went out for the heartbeat
        interval; returns its seq, or None. An ordinary batch (numbered, kept for replay): a
        consumer that missed the last batch sees the gap, and one that joined an idle daemon
        hears of it, within one interval."""
        if not self.heartbeat_s or time.monotonic() - self._last_sent < self.heartbeat_s:
            return None
        return self.publish([])

    def handle_replay(self, budget: int = 4 * REPLAY_CHUNK) -> bool:
        """Take waiting replay requests and send up to ``budget`` batches of the replays in
        progress, round-robin, without blocking. Returns True while replays remain: call it
        again on a later loop turn (a long replay never holds the loop)."""
        sock = self.replay
        if sock is None:
            return False
        while True:
            # Reading EVENTS after our own sends re-arms the socket's edge-triggered FD.
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._accept(sock.recv_multipart(zmq.NOBLOCK))
            if not self._replays or budget <= 0:
                return bool(self._replays)
            replay = self._replays.popleft()
            sent, done = self._stream(sock, replay, min(REPLAY_CHUNK, budget))
            budget -= max(sent, 1)
            if not done:
                self._replays.append(replay)

    def _accept(self, frames: list[bytes]) -> None:
        # [identity, b"", start_seq]: what a REQ sends (a DEALER sends [b"", start_seq]).
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.debug(
                "rank %d: ignored malformed replay request (%d frames)", self.rank, len(frames)
            )
            return
        if len(self._replays) >= self.max_replays:
            # No reply: the client times out and asks again once the others are served.
            self.replays_refused += 1
            log.debug("rank %d: %d replays in progress, one refused", self.rank, self.max_replays)
            return
        self.replay_requests += 1
        self._replays.append(_Replay(frames[0], int.from_bytes(frames[2], "big")))

    def _stream(self, sock: zmq.Socket, replay: _Replay, limit: int) -> tuple[int, bool]:
        """Send up to ``limit`` retained batches from ``replay.next_seq``; the end marker once
        it is past the last. Returns (batches sent, finished)."""
        ring = self._ring
        first = self._next_seq - len(ring)
        skip = max(0, replay.next_seq - first)
        head = (replay.identity, b"") if self.legacy_replay else (replay.identity, b"", self.topic)
        sent = 0
        try:
            for seq_frame, payload in islice(ring, skip, skip + limit):
                for frame in (*head, seq_frame):
                    sock.send(frame, zmq.SNDMORE | zmq.NOBLOCK)
                # Large payloads go zero-copy: many replays then share the ring's bytes.
                sock.send(payload, zmq.NOBLOCK, copy=len(payload) < ZERO_COPY_BYTES)
                sent += 1
            replay.next_seq = first + skip + sent
            if replay.next_seq < self._next_seq:
                return sent, False
            end = head[:2] if self.legacy_replay else (*head[:2], b"")
            sock.send_multipart((*end, END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or over its HWM: it sees no end marker, asks again
            log.debug("rank %d: replay to a peer stopped: %s", self.rank, exc)
        return sent, True

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        self.pub.close()
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint.startswith("ipc://"):
                Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
