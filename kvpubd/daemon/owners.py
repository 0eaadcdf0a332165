"""Who opened each open request, so that a client that dies does not pin its blocks for ever.

A client is the peer process behind its control connections: its pid over ipc (ZeroMQ's
``Peer-Address`` of an ipc message, and the kernel's SO_PEERCRED of an accepted Unix socket,
both name it) or its host over tcp (the peer address of both; several clients on one host
count as one there). The control socket's monitor reports each connection accepted and
closed; once a client has had no connection for ``grace_s`` its open requests are released,
as if it had sent ``release`` for each: their blocks stay cached (routers were told of them
and they are still there), only unpinned, so a reset no longer waits for them and the pool can
evict them. The grace lets a client close one connection and open the next (a tool run per
command, a client rebuilt after a timeout) without losing its requests.

Over tcp the address names the host, not the process: a client that died keeps its requests
while another client on the same host stays connected."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import Counter
from collections.abc import Callable

log = logging.getLogger("kvpubd")

Owner = tuple[str, int | str]  # ("ipc", pid) or ("tcp", host address)
RequestId = str | int
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def owner_of_message(peer_address: str | None, endpoint: str) -> Owner | None:
    """The owner named by a request's ``Peer-Address`` on the control ``endpoint``; None where
    it names nobody (inproc, or an address libzmq did not give)."""
    if not peer_address:
        return None
    if endpoint.startswith("ipc://"):
        # libzmq writes an ipc peer as "<host>:<uid>:<gid>:<pid>" (from SO_PEERCRED).
        pid = peer_address.rpartition(":")[2]
        return ("ipc", int(pid)) if pid.isdigit() else None
    if endpoint.startswith("tcp://"):
        return ("tcp", _plain_address(peer_address))
    return None


def owner_of_connection(fd: int) -> Owner | None:
    """The owner at the other end of the connection libzmq accepted as ``fd``; None once it is
    closed, or for a peer of another kind."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family == socket.AF_UNIX:
            pid, _, _ = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            return ("ipc", pid) if pid > 0 else None
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            return ("tcp", _plain_address(str(sock.getpeername()[0])))
        return None
    except OSError:
        return None
    finally:
        sock.detach()


def _plain_address(address: str) -> str:
    """An IPv4 peer of a dual-stack listener is written ``::ffff:a.b.c.d`` by one side only."""
    return address.removeprefix("::ffff:")


class RequestOwners:
    """The owners of the open requests of every rank, and their connections."""

    def __init__(self, release: Callable[[RequestId], None], grace_s: float | None) -> None:
        # Request ids are unique across ranks. An entry outlives its request only where the
        # request was closed by a forced reset: a later release, the id's next store or the
        # owner's end removes it (releasing a request no longer open does nothing).
        self._owner_of: dict[RequestId, Owner] = {}
        self._requests_of: dict[Owner, set[RequestId]] = {}
        self._release = release
        self._grace_s = grace_s  # None: requests are never released for their client
        self._connections: Counter[Owner] = Counter()
        self._timers: dict[Owner, asyncio.TimerHandle] = {}
        self.released = 0  # requests released because their client went away

    @property
    def enabled(self) -> bool:
        return self._grace_s is not None

    def claim(self, owner: Owner | None, request_id: RequestId) -> None:
        """``owner`` opened ``request_id`` (None: nobody to watch)."""
        self.drop(request_id)
        if owner is not None and self._grace_s is not None:
            self._owner_of[request_id] = owner
            self._requests_of.setdefault(owner, set()).add(request_id)

    def drop(self, request_id: RequestId) -> None:
        """The request is no longer open (released, or its store failed)."""
        owner = self._owner_of.pop(request_id, None)
        if owner is not None:
            requests = self._requests_of[owner]
            requests.discard(request_id)
            if not requests:
                del self._requests_of[owner]

    def connected(self, owner: Owner) -> None:
        self._connections[owner] += 1
        timer = self._timers.pop(owner, None)
        if timer is not None:
            timer.cancel()

    def disconnected(self, owner: Owner) -> None:
        left = self._connections[owner] - 1
        if left > 0:
            self._connections[owner] = left
            return
        del self._connections[owner]
        if self._grace_s is None or owner in self._timers:
            return
        loop = asyncio.get_running_loop()
        self._timers[owner] = loop.call_later(self._grace_s, self._orphaned, owner)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _orphaned(self, owner: Owner) -> None:
        del self._timers[owner]
        if self._connections[owner] > 0:
            return  # came back within the grace
        requests = self._requests_of.pop(owner, set())
        for request_id in requests:
            del self._owner_of[request_id]
            self._release(request_id)
        released = len(requests)
        if released:
            self.released += released
            kind, who = owner
            log.info(
                "released %d open request(s) of a client that went away (%s)",
                released,
                f"pid {who}" if kind == "ipc" else f"host {who}",
            )


class ConnectionOwners:
    """Feeds a listener's accepted and closed connections (by fd, from its monitor) to the
    owners' connection counts."""

    def __init__(self, owners: RequestOwners) -> None:
        self._owners = owners
        self._owner_of_fd: dict[int, Owner] = {}

    def accepted(self, fd: int) -> None:
        owner = owner_of_connection(fd)
        if owner is not None:
            self._owner_of_fd[fd] = owner
            self._owners.connected(owner)

    def disconnected(self, fd: int) -> None:
        owner = self._owner_of_fd.pop(fd, None)
        if owner is not None:
            self._owners.disconnected(owner)
