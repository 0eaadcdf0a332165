"""Serving ZeroMQ sockets from the asyncio loop.

A ZeroMQ socket's FD is edge-triggered: it wakes a loop reader when the socket's state may have
changed, and reading ``EVENTS`` re-arms it. So every reader drains until ZeroMQ reports nothing
more to read, and checks ``EVENTS`` again after its own sends."""

from __future__ import annotations

from typing import cast

import zmq


def reader_fd(sock: zmq.Socket) -> int:
    """The FD to register as a loop reader for ``sock``."""
    return cast(int, sock.getsockopt(zmq.FD))


def readable(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock`` (re-arms its FD)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


# Two ZeroMQ I/O threads: live publishing and control on the first, replay traffic on the
# second, so that a replay flood never queues ahead of a reset's marker in one thread.
IO_THREADS = 2
LIVE_AFFINITY = 0b01
REPLAY_AFFINITY = 0b10


def new_context() -> zmq.Context:
    return zmq.Context(io_threads=IO_THREADS)


def pin_io_thread(sock: zmq.Socket, affinity: int, context: zmq.Context) -> None:
    """Serve ``sock`` from the I/O threads in ``affinity``, where the context has them (a
    mask naming no existing thread would leave the socket without one)."""
    if affinity < 1 << context.get(zmq.IO_THREADS):
        sock.setsockopt(zmq.AFFINITY, affinity)
