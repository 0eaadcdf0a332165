"""Serving ZeroMQ sockets from the asyncio loop.

A ZeroMQ socket's FD is edge-triggered: it wakes a loop reader when the socket's state may have
changed, and reading ``EVENTS`` re-arms it. So every reader drains until ZeroMQ reports nothing
more to read, and checks ``EVENTS`` again after its own sends."""

from __future__ import annotations

from typing import cast

import zmq


def reader_fd(sock: zmq.Socket[bytes]) -> int:
    """The FD to register as a loop reader for ``sock``."""
    return cast(int, sock.getsockopt(zmq.FD))


def readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits on ``sock`` (re-arms its FD)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


# Two ZeroMQ I/O threads: live publishing and control on the first, replay traffic on the
# second, so that a replay flood never queues ahead of a reset's marker in one thread.
IO_THREADS = 2
LIVE_AFFINITY = 0b01
REPLAY_AFFINITY = 0b10


def new_context() -> zmq.Context[zmq.Socket[bytes]]:
    return zmq.Context(io_threads=IO_THREADS)


# A peer that has not greeted within this is disconnected (libzmq's default is 30 s): what
# frees the connection caps from an idle flood.
HANDSHAKE_IVL_MS = 10_000


def peer_address(frame: zmq.Frame) -> str:
    """Where a received message came from, as ZeroMQ tells: the IP address over tcp,
    ``localhost:UID:GID:PID`` over ipc (the peer process), "" where it does not tell
    (inproc: this process; no share applies). A process in another PID namespace (another
    container on the host) has pid 0 here, the same for all of them: "" too, not one share
    for them all."""
    try:
        address = str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return ""
    fields = address.split(":")
    if len(fields) == 4 and fields[0] == "localhost" and fields[3] == "0":
        return ""
    return address


def address_share(limit: int) -> int:
    """How much of a per-socket ``limit`` one peer address (host, or local process) may
    hold: a quarter, so that many connections from one place cannot take it all."""
    return max(1, limit // 4)


def listener(
    sock: zmq.Socket[bytes], affinity: int, context: zmq.Context[zmq.Socket[bytes]]
) -> zmq.Socket[bytes]:
    """Set up a socket about to be bound: served from the I/O threads in ``affinity`` where the
    context has them (a mask naming no existing thread would leave the socket without one),
    peers that never greet dropped after HANDSHAKE_IVL_MS. Before the bind: libzmq copies a
    socket's options into each listener when it binds, so later settings miss it."""
    if affinity < 1 << context.get(zmq.IO_THREADS):
        sock.setsockopt(zmq.AFFINITY, affinity)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    return sock


class BoundedMessages:
    """Reads a ROUTER's requests a frame at a time, a budget of frames per call. libzmq hands
    over a message only once it has all of it, and a peer may send one of a million empty
    frames (2 bytes each on the wire): read as one list, it held the loop for seconds. A
    message past ``max_frames`` is given with its first frames only (a request it cannot be)
    and the rest is read and dropped, a budget per call."""

    def __init__(self, max_frames: int) -> None:
        self.max_frames = max_frames
        self.discarding = False  # in the middle of a message too long to be a request

    def take(
        self, sock: zmq.Socket[bytes], budget: int, most: int | None = None
    ) -> list[tuple[list[bytes], zmq.Frame]]:
        """Messages read within ``budget`` frames (``most`` of them at most), each with its
        first frame as received (its metadata: ``peer_address``, a CURVE key)."""
        taken: list[tuple[list[bytes], zmq.Frame]] = []
        while budget > 0 and (most is None or len(taken) < most):
            if self.discarding:
                budget -= self._discard(sock, budget)
                continue
            if not readable(sock):
                break
            first = sock.recv(zmq.NOBLOCK, copy=False)
            frames: list[bytes] = [first.bytes]
            budget -= 1
            while sock.getsockopt(zmq.RCVMORE):
                if len(frames) > self.max_frames:
                    self.discarding = True
                    break
                frames.append(sock.recv(zmq.NOBLOCK))
                budget -= 1
            taken.append((frames, first))
        return taken

    def _discard(self, sock: zmq.Socket[bytes], budget: int) -> int:
        read = 0
        while read < budget and self.discarding:
            sock.recv(zmq.NOBLOCK)
            read += 1
            self.discarding = bool(sock.getsockopt(zmq.RCVMORE))
        return read
