"""A connection cap for a bound ZeroMQ TCP or ipc socket: stop admitting while it holds ``cap``.

libzmq has no such limit of its own, and running out of file descriptors is fatal to it: an
ipc listener's accept that fails with EMFILE aborts the whole process, so idle TCP connections
to the PUB or replay port could kill the daemon at its next ipc control connection. A socket
monitor counts accepted and closed connections; at the cap a drop-everything socket filter
(classic BPF) goes on the listening socket, so the kernel drops new handshakes (clients retry
them) while every established connection stays; below three quarters of the cap it comes off.
(Unbinding would not do: libzmq closes every connection of an endpoint it unbinds.)
Connections that never finish the ZMTP handshake are dropped by libzmq after
``zmq_loop.HANDSHAKE_IVL_MS`` (set on each listener before it binds), which is what frees the
cap from an idle flood.

An ipc listener's gate is its name: at the cap the socket file is renamed aside (connects
then fail with ENOENT and libzmq's clients retry, while every established connection stays)
and renamed back below three quarters (a Unix socket's connection requests are not packets a
filter could drop, and shutting the listener down cannot be undone). Abstract-namespace names
have no file: there, as for every connection accepted before a gate closed, a connection over
the cap is hung up as soon as it is accepted. So a leaking or hostile client of the same user
can no longer make libzmq abort the daemon."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvpubd.daemon.zmq_loop import readable, reader_fd
from kvpubd.protocol.endpoints import CAPPED_SUFFIX

log = logging.getLogger("kvpubd")

ZMQ_BACKLOG = 100  # libzmq's default accept queue
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class ConnectionObserver(Protocol):
    """Told of each connection the listener accepts and closes, by its fd."""

    def accepted(self, fd: int) -> None: ...

    def disconnected(self, fd: int) -> None: ...


class ConnectionCap:
    """Counts ``sock``'s connections on the TCP or ipc endpoint ``bound`` and holds them to
    ``cap``, telling ``observer`` of each. Served from the daemon's loop; ``create`` returns
    None where no cap can be put on."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        gate: ListenerGate | IpcListener,
        cap: int,
        name: str,
        observer: ConnectionObserver | None = None,
    ) -> None:
        self.sock = sock
        self.observer = observer
        self.gate = gate
        self.cap = max(1, cap)
        self.name = name
        self.connections = 0
        # One peer (a host over tcp, a process over ipc) holds at most ``share`` of them: a
        # client that leaks connections, or opens them to lock others out, reached the cap
        # alone and closed the listener to everyone (the control socket deaf to resets).
        # Never below 4 (the cap allowing): a worker's private control socket, with a small
        # cap on a small fd budget, must still take the service's three connections.
        self.share = min(self.cap, max(4, self.cap // 4))
        self._peers: dict[str, int] = {}  # connections counted per peer
        self._peer_of: dict[int, str] = {}  # by fd, the counted connections' peers
        self._shed: set[int] = set()  # hung up for their peer's share, not counted
        self.shed = 0
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._first_drain: asyncio.Handle | None = None

    @classmethod
    def create(
        cls,
        sock: zmq.Socket[bytes],
        bound: str,
        cap: int,
        name: str,
        observer: ConnectionObserver | None = None,
    ) -> ConnectionCap | None:
        if bound.startswith("ipc://"):
            return cls(sock, IpcListener(bound), cap, name, observer)
        fd = listening_fd(bound)
        if fd is None:
            return None
        gate = ListenerGate(fd)
        # The kernel's accept queue is what libzmq still takes after the gate closes.
        gate.listen(min(ZMQ_BACKLOG, max(1, cap // 4)))
        return cls(sock, gate, cap, name, observer)

    @property
    def fd(self) -> int:
        return reader_fd(self._monitor)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self.fd, self.drain)
        # Events before the reader existed do not wake it.
        self._first_drain = loop.call_soon(self.drain)

    def drain(self) -> None:
        monitor = self._monitor
        while readable(monitor):
            message = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            event = message["event"]
            if event == zmq.EVENT_ACCEPTED:
                fd = message["value"]
                if self.observer is not None:  # before a hang-up, which it then hears of
                    self.observer.accepted(fd)
                # A new connection on this fd: whatever held it before is gone, heard of or not.
                self._shed.discard(fd)
                if self._over_share(fd):
                    continue
                self.connections += 1
                if self.connections >= self.cap and not self.gate.closed:
                    self._pause()  # at once, not after the rest of the burst is counted
                if self.connections > self.cap:
                    # Accepted before the gate closed: hang up at once, so the fds the
                    # overshoot took are back within a turn of the loop, not a handshake
                    # timeout later.
                    self.gate.hang_up(message["value"])
            elif event == zmq.EVENT_DISCONNECTED:
                fd = message["value"]
                if self.observer is not None:
                    self.observer.disconnected(fd)
                if fd in self._shed:
                    self._shed.discard(fd)
                    continue
                peer = self._peer_of.pop(fd, None)
                if peer is not None:
                    left = self._peers.pop(peer) - 1
                    if left:
                        self._peers[peer] = left
                # Peers accepted before the monitor existed are not counted: never below 0.
                self.connections = max(0, self.connections - 1)
        if self.gate.closed and self.connections <= self.cap * 3 // 4:
            self.gate.open()
            log.info("%s: %d connections; accepting again", self.name, self.connections)

    def _over_share(self, fd: int) -> bool:
        """Count connection ``fd`` for its peer, or hang it up if the peer holds its share
        (True: not counted)."""
        peer = self.gate.peer(fd)
        if peer is None:
            return False
        held = self._peers.get(peer, 0)
        if held >= self.share and self.gate.hang_up(fd):
            self._shed.add(fd)
            self.shed += 1
            if self.shed & (self.shed - 1) == 0:  # the 1st, 2nd, 4th, ... : no log flood
                log.warning(
                    "%s: %s holds %d connections, its share; hung up another (%d so far)",
                    self.name,
                    peer,
                    held,
                    self.shed,
                )
            return True
        self._peers[peer] = held + 1
        self._peer_of[fd] = peer
        return False

    def _pause(self) -> None:
        try:
            self.gate.close()
        except OSError as exc:
            log.error("%s: cannot stop accepting at %d connections: %s", self.name, self.cap, exc)
            return
        log.warning(
            "%s: %d connections, the cap; refusing new ones until some close", self.name, self.cap
        )

    def close(self) -> None:
        if self.gate.closed:  # an ipc socket file goes back where its owner removes it
            self.gate.open()
        if self._loop is not None:
            self._loop.remove_reader(self.fd)
        if self._first_drain is not None:  # a daemon stopped in the turn it started
            self._first_drain.cancel()
        self.sock.disable_monitor()
        self._monitor.close(linger=0)


class IpcListener:
    """The gate of an ipc listener: its socket file, renamed aside while closed."""

    def __init__(self, bound: str) -> None:
        name = bound.removeprefix("ipc://")
        abstract = name.startswith("@")
        # getsockname() of an accepted connection names the listener; "@" is Linux's
        # abstract namespace, a leading NUL there.
        self.name = "\0" + name[1:] if abstract else name
        self.path = None if abstract else name
        self.aside = name + CAPPED_SUFFIX
        self.closed = False
        if self.path is not None:  # bound under the endpoint's lock: any such file is stale
            with contextlib.suppress(OSError):
                os.unlink(self.aside)

    def hang_up(self, fd: int) -> bool:
        """Shut down the connection libzmq accepted as ``fd`` (see ``_hang_up``)."""
        return _hang_up(fd, (socket.AF_UNIX,), self._names_me)

    def peer(self, fd: int) -> str | None:
        """The process at the other end of connection ``fd`` (None if it cannot tell)."""

        def credentials(sock: socket.socket) -> str | None:
            size = struct.calcsize("3i")
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, _PEERCRED, size))
            # pid 0: a process in another PID namespace, as are all the others there; telling
            # them apart is not possible, so no share applies.
            return f"process {pid} (uid {uid})" if pid else None

        return _peer(fd, (socket.AF_UNIX,), self._names_me, credentials)

    def _names_me(self, sock: socket.socket) -> bool:
        name = sock.getsockname()
        return (name.decode(errors="replace") if isinstance(name, bytes) else name) == self.name

    def close(self) -> None:
        if self.path is not None:
            os.replace(self.path, self.aside)
        self.closed = True

    def open(self) -> None:
        if self.path is not None:
            try:
                os.replace(self.aside, self.path)
            except OSError as exc:
                log.error("cannot open a listener again: %s", exc)
                return
        self.closed = False


SO_ATTACH_FILTER = 26  # Linux <asm-generic/socket.h>
SO_DETACH_FILTER = 27
# One classic BPF instruction, BPF_RET | BPF_K with k = 0: accept no bytes of any packet.
_DROP_ALL = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))
_DROP_ALL_PROGRAM = struct.pack("HL", 1, ctypes.addressof(_DROP_ALL))  # struct sock_fprog


class ListenerGate:
    """Opens and closes a listening socket (by fd, owned by libzmq) to new connections."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.closed = False
        with self._socket() as sock:
            self.port = sock.getsockname()[1]

    def hang_up(self, fd: int) -> bool:
        """Shut down the connection libzmq accepted as ``fd`` (see ``_hang_up``)."""
        return _hang_up(fd, _INET, self._names_me)

    def peer(self, fd: int) -> str | None:
        """The host at the other end of connection ``fd`` (None if it cannot tell)."""
        return _peer(fd, _INET, self._names_me, lambda sock: f"host {sock.getpeername()[0]}")

    def _names_me(self, sock: socket.socket) -> bool:
        return bool(sock.getsockname()[1] == self.port)

    def close(self) -> None:
        self._setsockopt(SO_ATTACH_FILTER, _DROP_ALL_PROGRAM)
        self.closed = True

    def open(self) -> None:
        try:
            self._setsockopt(SO_DETACH_FILTER, 0)
        except OSError as exc:
            log.error("cannot open a listener again: %s", exc)
            return
        self.closed = False

    def listen(self, backlog: int) -> None:
        """Set the accept queue's length (listen() again on a listening socket does that)."""
        with self._socket() as sock:
            sock.listen(backlog)

    def _setsockopt(self, option: int, value: bytes | int) -> None:
        with self._socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, option, value)

    @contextmanager
    def _socket(self) -> Iterator[socket.socket]:
        sock = socket.socket(fileno=self.fd)  # no dup: at the fd limit there is none to spare
        try:
            yield sock
        finally:
            sock.detach()


def _hang_up(fd: int, families: tuple[int, ...], is_ours: Callable[[socket.socket], bool]) -> bool:
    """Shut down the connection libzmq accepted as ``fd`` (libzmq then closes it). Checked
    first: the fd is still a connection (``families``, not a listener) to this listener
    (``is_ours``), not a number reused meanwhile."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False  # closed meanwhile
    try:
        if sock.family not in families or sock.type != socket.SOCK_STREAM:
            return False
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) or not is_ours(sock):
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()


_PEERCRED = getattr(socket, "SO_PEERCRED", 17)  # Linux


def _peer(
    fd: int,
    families: tuple[int, ...],
    is_ours: Callable[[socket.socket], bool],
    name: Callable[[socket.socket], str | None],
) -> str | None:
    """``name`` of connection ``fd``'s peer, checked as ``_hang_up`` checks it first; None
    where it is not such a connection (any more) or the peer cannot be told."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.family not in families or sock.type != socket.SOCK_STREAM:
            return None
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) or not is_ours(sock):
            return None
        return name(sock)
    except OSError:
        return None
    finally:
        sock.detach()


def listening_fd(bound: str) -> int | None:
    """The fd of this process's TCP socket listening at ``bound`` (a tcp:// LAST_ENDPOINT);
    None for other transports, or where it cannot be found (not Linux)."""
    if not bound.startswith("tcp://") or not hasattr(socket, "SO_ACCEPTCONN"):
        return None
    host, _, port = bound.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in _INET:
                continue
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            address = sock.getsockname()
            if str(address[1]) == port and address[0] == host:
                return fd
        finally:
            sock.detach()
    return None


_INET = (socket.AF_INET, socket.AF_INET6)
