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
