"""One replay request to an engine's ROUTER socket, its answer streamed batch by batch.

The request is ``[b"", start_seq]`` from a DEALER; the answer is every retained batch from
``start_seq`` as ``[b"", topic, seq, payload]`` (``[b"", seq, payload]`` from older engines),
then the end marker (seq ``ff``x8). The answer is read as it comes, so the batches are applied
while the rest is on its way and no more than the socket's receive high-water mark of them waits
in memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvpubd.protocol.wire import END_SEQ, pack_seq, unpack_seq


def parse_replay_message(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one answer message, None for the end marker; ValueError for anything
    else. Both framings: ``[b"", topic, seq, payload]`` and the older ``[b"", seq, payload]``."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise ValueError(f"a replay message has 3 or 4 frames, not {len(frames)}")
    if frames[-2] == END_SEQ:
        return None
    return unpack_seq(frames[-2]), frames[-1]


@dataclass
class ReplayOutcome:
    """How the last answer ended: ``finished`` once its end marker came, else ``cut_short``
    says why. ``malformed`` counts messages that were no replay message (skipped: the hole
    they leave is a gap like any other)."""

    finished: bool = False
    cut_short: str = ""
    malformed: int = 0
    received: int = 0


class ReplayClient:
    """A DEALER on the engine's replay endpoint, one request at a time. An answer that falls
    silent for ``timeout`` seconds, or runs past ``max_batches``, is abandoned and the socket
    replaced, so that its late messages are never read as the next answer's."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        *,
        topic: bytes = b"",
        timeout: float = 2.0,
        max_batches: int = 20_000,
        max_message_bytes: int = -1,
    ) -> None:
        self._context = context
        self.endpoint = endpoint
        self.topic = topic
        self.timeout = timeout
        self.max_batches = max_batches
        self.max_message_bytes = max_message_bytes
        self._socket: zmq.asyncio.Socket | None = None
        self.outcome = ReplayOutcome()

    def _dealer(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # The whole answer may queue while the batches before it are applied: bounded.
            sock.setsockopt(zmq.RCVHWM, self.max_batches + 1)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            sock.connect(self.endpoint)
            self._socket = sock
        return self._socket

    def _abandon(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def batches(self, start_seq: int) -> AsyncIterator[tuple[int, bytes]]:
        """(seq, payload) of every batch the engine retains from ``start_seq``, in the order
        sent; ``outcome`` says afterwards whether the answer was complete."""
        self.outcome = outcome = ReplayOutcome()
        sock = self._dealer()
        try:
            await sock.send_multipart([b"", pack_seq(start_seq)])
            while outcome.received <= self.max_batches:
                if not await sock.poll(int(self.timeout * 1000)):
                    outcome.cut_short = f"silent for {self.timeout} s"
                    return
                frames = await sock.recv_multipart()
                outcome.received += 1
                try:
                    item = parse_replay_message(frames)
                except ValueError:
                    outcome.malformed += 1
                    continue
                if item is None:
                    outcome.finished = True
                    return
                if len(frames) == 4 and not frames[1].startswith(self.topic):
                    continue  # another topic's batch, as the SUB socket would leave it out
                yield item
            outcome.cut_short = f"more than {self.max_batches} batches"
        finally:
            if not outcome.finished:
                self._abandon()

    def close(self) -> None:
        self._abandon()
