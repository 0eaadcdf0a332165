"""The service's control connection to one rank worker: a DEALER on the worker's private
endpoint. Each request goes out as ``[correlation, b"", request]`` and its reply comes back
through the same envelope (the worker's control server answers through any envelope), so
replies that finish out of order (a store done in slices, a snapshot) still find their
request.

Served from the loop like every ZeroMQ socket here: the reader drains a bounded number of
replies per wake-up, and after each send the socket's events are read again (a send can
clear the edge-triggered FD while a reply waits, which would leave it unread)."""

from __future__ import annotations

import asyncio
import itertools
import logging

import zmq

from kvpubd.daemon.pending import Pending
from kvpubd.daemon.zmq_loop import readable, reader_fd

log = logging.getLogger("kvpubd")

# Replies handled per reader wake-up before the loop gets a turn.
REPLY_BURST = 256
_CORRELATION = 8  # bytes of a correlation frame
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)


class LinkLost(RuntimeError):
    """The worker went away (died, restarted or stopped) before it answered."""


class RankLink:
    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, rank: int) -> None:
        self.rank = rank
        self.endpoint = endpoint
        sock = self._sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # The service bounds what it has in flight to a worker itself (see in_flight): ZeroMQ
        # must never refuse a send (a reset) for a full queue.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(endpoint)
        self._fd: int | None = None
        self._waiting: dict[bytes, tuple[Pending[zmq.Frame], int]] = {}
        self.bytes_in_flight = 0
        self._ids = itertools.count()
        self._read_scheduled = False
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._waiting)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._fd = reader_fd(self._sock)
        loop.add_reader(self._fd, self._read)
        loop.call_soon(self._read)

    def request(self, frame: bytes | zmq.Frame) -> Pending[zmq.Frame]:
        """Send one request frame; its reply frame, or LinkLost."""
        reply: Pending[zmq.Frame] = Pending()
        if self._closed:
            reply.fail(LinkLost(f"rank {self.rank}'s worker is not running"))
            return reply
        correlation = next(self._ids).to_bytes(_CORRELATION, "big")
        send = self._sock.send
        send(correlation, _MORE)
        send(b"", _MORE)
        send(frame, _LAST, copy=not isinstance(frame, zmq.Frame))
        size = len(frame)
        self._waiting[correlation] = (reply, size)
        self.bytes_in_flight += size
        self._rearm()
        return reply

    def close(self, reason: str) -> None:
        """Stop: every request still waiting fails with LinkLost(``reason``)."""
        if self._closed:
            return
        self._closed = True
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._fd = None
        self._sock.close(linger=0)
        waiting, self._waiting = self._waiting, {}
        self.bytes_in_flight = 0
        for pending, _ in waiting.values():
            pending.fail(LinkLost(reason))

    def _read(self) -> None:
        self._read_scheduled = False
        if self._closed:
            return
        sock = self._sock
        for _ in range(REPLY_BURST):
            if not readable(sock):
                return
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            if len(frames) != 3 or frames[1].bytes != b"":
                log.warning("rank %d: dropped a malformed reply from its worker", self.rank)
                continue
            waiting = self._waiting.pop(frames[0].bytes, None)
            if waiting is not None:
                pending, size = waiting
                self.bytes_in_flight -= size
                pending.resolve(frames[2])
            if self._closed:  # a receiver closed it
                return
        self._schedule_read()

    def _rearm(self) -> None:
        if not self._read_scheduled and readable(self._sock):
            self._schedule_read()

    def _schedule_read(self) -> None:
        self._read_scheduled = True
        asyncio.get_running_loop().call_soon(self._read)
