"""The snapshot endpoint of vLLM's snapshot protocol (``events.snapshot_endpoint``): a ROUTER
that answers a REQ's one frame ``b"snapshot"`` with one message
``[seq, publisher_id, *chunks]``: ``seq`` signed 64-bit big-endian (the last seq the snapshot
covers; -1 nothing published yet, -2 unavailable now: retry), the rank's 16-byte publisher id,
then the batches ``[ts, events, rank]`` that rebuild the rank's state from empty. Anything else
sent to it gets no answer.

Nothing here holds the loop: requests are read a few per turn (a message of many frames is
discarded a slice per turn), snapshots are built a slice per turn and shared by every request
they can answer, and replies go out a slice of frames per turn, their chunks without a copy.
A request is answered from a snapshot at least as recent as the last batch published when it
arrived: the requester has seen a live batch before asking, so the snapshot must reach it.

A client that never reads keeps its reply's chunks alive in ZeroMQ: at most ``PEER_HWM``
replies each, and the snapshots that only such replies still hold are capped at
``PINNED_BYTES`` in all; past that a request for a newer snapshot gets -2.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

import zmq

from kvpubd.daemon.history import History, Snapshots
from kvpubd.daemon.snapshot import Snapshot
from kvpubd.daemon.zmq_loop import (
    REPLAY_AFFINITY,
    BoundedMessages,
    address_share,
    listener,
    peer_address,
    readable,
    reader_fd,
)
from kvpubd.protocol.snapshot_wire import (
    NOTHING_PUBLISHED,
    SNAPSHOT_REQUEST,
    UNAVAILABLE,
    pack_signed_seq,
)
from kvpubd.protocol.wire import MAX_SIGNED_SEQ

log = logging.getLogger(__name__)

# Per frame: the request is 8 bytes, but ZeroMQ's handshake (READY, with a routing id of up
# to 255 bytes) is held to it too.
MAX_MESSAGE_BYTES = 512
# [identity, b"", b"snapshot"] as the ROUTER reads a REQ's request; the frames between the
# identity and the empty one (a REQ's correlation id, proxies' identities) come back as they
# came, as REQ/ROUTER envelopes do. Longer messages are not requests.
MAX_REQUEST_FRAMES = 8
ACCEPT_FRAMES = 256  # frames read per loop turn (a message of thousands is discarded in slices)
MAX_WAITING = 1024  # peers waiting for a snapshot; more are ignored (the client retries)
PEER_HWM = 2  # replies ZeroMQ queues for one peer; a reply beyond that is dropped
PINNED_BYTES = 1 << 30  # older snapshots kept alive by replies still in ZeroMQ's hands
SEND_SLICE_S = 0.0005  # reply frames sent per loop turn
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


@dataclass(slots=True, eq=False)
class _Reply:
    frames: list[bytes | memoryview]  # the request's envelope first (the identity leading)
    chunks_from: int  # the first frame that is a chunk (sent without a copy)
    snapshot: Snapshot | None  # whose chunks it sends (None: an "unavailable" reply)
    sent: int = 0  # frames sent so far (the rest go out on later turns)


class SnapshotEndpoint:
    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        history: History,
        snapshots: Snapshots,
        endpoint: str,
    ) -> None:
        if history.publisher_id is None:
            raise ValueError("a snapshot endpoint needs a history with a publisher id")
        self.history = history
        self.publisher_id = history.publisher_id
        self._snapshots = snapshots
        self.requests = 0  # well-formed requests received
        self.unavailable = 0  # answered -2
        self.ignored = 0  # malformed, or beyond MAX_WAITING
        # By the peer's identity (one request each: a new one replaces the peer's last),
        # (envelope: the request's frames but its last, the last seq published when it asked,
        # the peer's address); and how many wait per address (see zmq_loop.address_share).
        self._waiting: dict[bytes, tuple[tuple[bytes, ...], int, str]] = {}
        self._waiting_at: dict[str, int] = {}
        self._job: asyncio.Future[Snapshot] | None = None  # the build the waiting wait for
        self._replies: deque[_Reply] = deque()
        self._in_flight: list[tuple[zmq.MessageTracker, Snapshot]] = []
        self._requests = BoundedMessages(MAX_REQUEST_FRAMES)
        self._pump_scheduled = False
        self._fd: int | None = None

        sock = listener(context.socket(zmq.ROUTER), REPLAY_AFFINITY, context)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, PEER_HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an error, not a silent drop, at the HWM
        sock.setsockopt(zmq.LINGER, 0)
        sock.copy_threshold = 0  # chunks go without a copy whatever their size
        sock.bind(endpoint)
        self.socket: zmq.Socket[bytes] | None = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # -- the loop's side ----------------------------------------------------------------------

    def start(self) -> None:
        assert self.socket is not None
        self._fd = reader_fd(self.socket)
        asyncio.get_running_loop().add_reader(self._fd, self._pump)
        self._schedule_pump()

    def stop(self) -> None:
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._fd = None

    def close(self) -> None:
        self.stop()
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        self._waiting.clear()
        self._waiting_at.clear()
        self._replies.clear()
        self._in_flight.clear()

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and self.socket is not None:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        sock = self.socket
        if sock is None:
            return
        self._accept(sock)
        self._dispatch()
        self._send(sock)
        # Reading EVENTS after our own sends re-arms the socket's edge-triggered FD.
        if self._replies or self._requests.discarding or readable(sock):
            self._schedule_pump()

    # -- requests -----------------------------------------------------------------------------

    def _accept(self, sock: zmq.Socket[bytes]) -> None:
        for frames, first in self._requests.take(sock, ACCEPT_FRAMES):
            self._take(frames, peer_address(first))

    def _take(self, frames: list[bytes], address: str = "") -> None:
        # An envelope's frames before the empty one are ids, never empty themselves.
        if (
            not 3 <= len(frames) <= MAX_REQUEST_FRAMES
            or frames[-2:] != [b"", SNAPSHOT_REQUEST]
            or not all(frames[:-2])
        ):
            self.ignored += 1
            log.debug("rank %d: ignored a malformed snapshot request", self.history.rank)
            return
        # A peer asks again only once it gave up on its answer (a REQ cannot do otherwise):
        # its new request replaces the one waiting, so one peer asking over and over without
        # reading holds one place, not all MAX_WAITING (everyone else's requests ignored).
        # Nor does one address (host, or local process) hold more than its share of places,
        # however many connections it opens.
        peer = frames[0]
        if peer not in self._waiting:
            if len(self._waiting) >= MAX_WAITING or (
                address and self._waiting_at.get(address, 0) >= address_share(MAX_WAITING)
            ):
                self.ignored += 1
                return
            self._waiting_at[address] = self._waiting_at.get(address, 0) + 1
        self.requests += 1
        self._waiting[peer] = (tuple(frames[:-1]), self.history.last_seq, address)

    def _dispatch(self) -> None:
        """Answer the waiting requests that the current snapshot reaches; start (or wait
        for) a newer build for the others."""
        answered_from: asyncio.Future[Snapshot] | None = None
        while self._waiting:
            job = self._job
            if job is None:
                job = self._snapshots().result
                if job is answered_from:  # (cannot be: a finished job serves the latest seq)
                    return
                self._job = job
                if not job.done():
                    job.add_done_callback(lambda _: self._schedule_pump())
            if not job.done():
                return
            self._job = None
            self._answer(job)
            answered_from = job

    def _answer(self, job: asyncio.Future[Snapshot]) -> None:
        if job.cancelled() or job.exception() is not None:
            waiting, self._waiting, self._waiting_at = self._waiting, {}, {}
            for envelope, _, _ in waiting.values():
                self._queue_unavailable(envelope)
            return
        snapshot = job.result()
        if snapshot.freed:  # retired before we got to it: the waiting wait for a newer build
            return
        answered = [w[0] for w in self._waiting.values() if w[1] <= snapshot.seq]
        self._waiting = {p: w for p, w in self._waiting.items() if w[1] > snapshot.seq}
        self._waiting_at = dict(Counter(w[2] for w in self._waiting.values()))
        # (A run that serves snapshots never numbers past MAX_SIGNED_SEQ.)
        if not answered or snapshot.seq > MAX_SIGNED_SEQ or not self._may_pin(snapshot):
            for envelope in answered:
                self._queue_unavailable(envelope)
            return
        seq = snapshot.seq if snapshot.seq >= self.history.first_seq else NOTHING_PUBLISHED
        head = (pack_signed_seq(seq), self.publisher_id)
        for envelope in answered:
            frames: list[bytes | memoryview] = [*envelope, *head, *snapshot.chunks]
            self._replies.append(_Reply(frames, len(envelope) + len(head), snapshot))

    def _queue_unavailable(self, envelope: tuple[bytes, ...]) -> None:
        self.unavailable += 1
        frames: list[bytes | memoryview] = [
            *envelope,
            pack_signed_seq(UNAVAILABLE),
            self.publisher_id,
        ]
        self._replies.append(_Reply(frames, len(frames), None))

    def _may_pin(self, snapshot: Snapshot) -> bool:
        """Whether replies of ``snapshot`` may go out: the snapshots that replies still in
        ZeroMQ's hands keep alive stay within PINNED_BYTES, the newest one aside."""
        self._in_flight = [(t, s) for t, s in self._in_flight if not t.done]
        # By their chunks: a snapshot that stands for a later seq shares its build's.
        if any(s.chunks is snapshot.chunks for _, s in self._in_flight):
            return True
        pinned = {id(s.chunks): s.nbytes for _, s in self._in_flight}
        return sum(pinned.values()) < PINNED_BYTES

    # -- replies ------------------------------------------------------------------------------

    def _send(self, sock: zmq.Socket[bytes]) -> None:
        """Send reply frames for about SEND_SLICE_S, one reply after another (a reply may stop
        mid-way and go on next turn: nothing else is sent on this socket in between)."""
        deadline = time.perf_counter() + SEND_SLICE_S
        while self._replies:
            reply = self._replies[0]
            frames, last = reply.frames, len(reply.frames) - 1
            try:
                while reply.sent <= last:
                    if time.perf_counter() >= deadline:
                        return
                    index = reply.sent
                    if index < last:
                        copy = index < reply.chunks_from
                        sock.send(frames[index], _MORE | _NOBLOCK, copy=copy)
                    elif reply.snapshot is not None and index >= reply.chunks_from:
                        tracker = sock.send(frames[index], _NOBLOCK, copy=False, track=True)
                        self._in_flight.append((tracker, reply.snapshot))
                    else:
                        sock.send(frames[index], _NOBLOCK)
                    reply.sent += 1
            except zmq.ZMQError as exc:
                # Only the identity frame can fail (the peer at its HWM, or gone): no reply,
                # the client times out and asks again. Past it, ZeroMQ takes every frame.
                log.debug("rank %d: a snapshot reply dropped: %s", self.history.rank, exc)
            self._replies.popleft()
