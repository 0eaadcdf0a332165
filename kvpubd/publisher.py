"""Transport for one rank: the PUB socket, the replay ROUTER and the ring of sent batches.

Usable as a library: ``Publisher(...).publish(events)`` encodes, numbers and sends one batch
and returns its seq; ``handle_replay()`` answers whatever replay requests are waiting.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from itertools import islice
from pathlib import Path

import zmq

from kvpubd.wire import END_SEQ, MAX_SEQ, BatchEncoder, Event, WireFormat, pack_seq

log = logging.getLogger(__name__)

REPLAY_MAX_MESSAGE_BYTES = 256  # a replay request is 8 bytes; anything far larger is abuse


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
    ) -> None:
        self.rank = rank
        self.topic = topic.encode()
        self.legacy_replay = replay_framing == "legacy"
        self._encoder = BatchEncoder(wire_format, rank)
        self._next_seq = 0
        # (seq frame, payload) of the last buffer_steps batches, oldest first.
        self._ring: deque[tuple[bytes, bytes]] = deque(maxlen=buffer_steps)
        self.batches = 0
        self.events = 0
        self.replay_requests = 0

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
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def last_seq(self) -> int:
        """The seq of the last batch sent, -1 before the first."""
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
        self.batches += 1
        self.events += len(events)
        return seq

    def handle_replay(self) -> None:
        """Answer every replay request waiting on the ROUTER, without blocking."""
        sock = self.replay
        if sock is None:
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._answer(sock, frames)

    def _answer(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        # [identity, b"", start_seq]: what a REQ sends (a DEALER sends [b"", start_seq]).
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.debug(
                "rank %d: ignored malformed replay request (%d frames)", self.rank, len(frames)
            )
            return
        self.replay_requests += 1
        identity = frames[0]
        start = int.from_bytes(frames[2], "big")
        ring = self._ring
        first = self._next_seq - len(ring)
        skip = max(0, start - first)
        head = (identity, b"") if self.legacy_replay else (identity, b"", self.topic)
        try:
            for seq_frame, payload in islice(ring, skip, None):
                sock.send_multipart((*head, seq_frame, payload), flags=zmq.NOBLOCK)
            end = (identity, b"") if self.legacy_replay else (identity, b"", b"")
            sock.send_multipart((*end, END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or over its HWM: it asks again
            log.debug("rank %d: replay to a peer stopped: %s", self.rank, exc)

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        self.pub.close()
        for endpoint in (self.endpoint, self.replay_endpoint):
            if endpoint.startswith("ipc://"):
                Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
