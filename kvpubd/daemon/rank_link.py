"""The service's control connection to one rank worker: three DEALERs on the worker's private
endpoint. Each request goes out as ``[correlation, b"", request]`` and its reply comes back
through the same envelope (the worker's control server answers through any envelope), so
replies that finish out of order (a store done in slices, a snapshot) still find their
request.

Three connections, because the worker's ROUTER reads its connections in turn, as a daemon
reads its clients': stores go on the bulk one, small ops (stats, ping, pause) on the priority
one, and a reset from a client with nothing on its way to that worker on the reset one, so it
is read next: not behind every store the service has forwarded for all clients, nor behind
another client's small ops, each of which waited its turn with a store (``RankFront`` picks;
one client's requests stay on one connection while any is on its way, so they are never
reordered).

Served from the loop like every ZeroMQ socket here: the reader drains a bounded number of
replies per wake-up, and after each send the socket's events are read again (a send can
clear the edge-triggered FD while a reply waits, which would leave it unread)."""

from __future__ import annotations

import asyncio
import enum
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


class Conn(enum.IntEnum):
    """The connections of a link, by what they carry (see above)."""

    BULK = 0
    PRIORITY = 1
    RESET = 2


class LinkLost(RuntimeError):
    """The worker went away (died, restarted or stopped) before it answered."""


class RankLink:
    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, rank: int) -> None:
        self.rank = rank
        self.endpoint = endpoint
        self._socks = tuple(_dealer(context, endpoint) for _ in Conn)
        self._fds: list[int] = []
        self._waiting: dict[bytes, tuple[Pending[zmq.Frame], int]] = {}
        self.bytes_in_flight = 0
        self._ids = itertools.count()
        self._read_scheduled = [False] * len(Conn)
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._waiting)

    @property
    def closed(self) -> bool:
        """Its worker went away: requests fail at once with LinkLost."""
        return self._closed

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for lane, sock in enumerate(self._socks):
            fd = reader_fd(sock)
            self._fds.append(fd)
            loop.add_reader(fd, self._read, lane)
            loop.call_soon(self._read, lane)

    def request(self, frame: bytes | zmq.Frame, conn: Conn = Conn.BULK) -> Pending[zmq.Frame]:
        """Send one request frame on connection ``conn``; its reply frame, or LinkLost."""
        reply: Pending[zmq.Frame] = Pending()
        if self._closed:
            reply.fail(LinkLost(f"rank {self.rank}'s worker is not running"))
            return reply
        correlation = next(self._ids).to_bytes(_CORRELATION, "big")
        lane = int(conn)
        send = self._socks[lane].send
        send(correlation, _MORE)
        send(b"", _MORE)
        send(frame, _LAST, copy=not isinstance(frame, zmq.Frame))
        size = len(frame)
        self._waiting[correlation] = (reply, size)
        self.bytes_in_flight += size
        self._rearm(lane)
        return reply

    def close(self, reason: str) -> None:
        """Stop: every request still waiting fails with LinkLost(``reason``)."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        for fd in self._fds:
            loop.remove_reader(fd)
        self._fds = []
        for sock in self._socks:
            sock.close(linger=0)
        waiting, self._waiting = self._waiting, {}
        self.bytes_in_flight = 0
        for pending, _ in waiting.values():
            pending.fail(LinkLost(reason))

    def _read(self, lane: int) -> None:
        self._read_scheduled[lane] = False
        if self._closed:
            return
        sock = self._socks[lane]
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
        self._schedule_read(lane)

    def _rearm(self, lane: int) -> None:
        if not self._read_scheduled[lane] and readable(self._socks[lane]):
            self._schedule_read(lane)

    def _schedule_read(self, lane: int) -> None:
        self._read_scheduled[lane] = True
        asyncio.get_running_loop().call_soon(self._read, lane)


def _dealer(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # The service bounds what it has in flight to a worker itself (see in_flight): ZeroMQ must
    # never refuse a send (a reset) for a full queue.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    return sock
