"""The control socket: a ZeroMQ ROUTER that owns its binding (ipc permissions, CURVE, frame
limits) and the framing, and hands each parsed request to a callback.

The callback answers with the reply bytes, or with a future of them for work that takes
several loop turns (a snapshot). A reset's marker is handed to ZeroMQ inside the callback,
so it is on the wire before the reply frame is sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import stat
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import cast

import zmq

from kvpubd.daemon.curve import CurveServer
from kvpubd.daemon.endpoint_lock import bind_ipc_safely, ipc_path
from kvpubd.daemon.hooks import MetricsHooks
from kvpubd.daemon.owners import Owner, owner_of_message
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.settings import ControlConfig
from kvpubd.daemon.zmq_loop import (
    LIVE_AFFINITY,
    BoundedMessages,
    listener,
    readable,
    reader_fd,
)
from kvpubd.protocol.control import Request, Snapshot, error_reply, op_of
from kvpubd.protocol.control_frames import ProtocolError, parse_request, peek_id

log = logging.getLogger("kvpubd")

# Requests handled per reader wake-up before the loop gets a turn (drain ticks, replays), and
# the request bytes after which it gets one sooner: reading and parsing a 4 MB store takes
# milliseconds, so 64 of them back to back held the loop for a few hundred.
CONTROL_BURST = 64
CONTROL_BURST_BYTES = 1 << 20
# ... and the time after which it gets one: 64 small stores at ~200 us each held the loop
# 13-14 ms when every load ran at once (bench soak, H200), a reset behind them waited as long.
CONTROL_BURST_S = 0.001
# Entries of finished snapshot replies kept before a sweep drops them, and how often a
# snapshot request waiting for the client's last reply to be written out looks again.
UNSENT_SWEEP = 1024
UNSENT_POLL_S = 0.005
# Routing frames a request may carry before the empty delimiter: the ROUTER's identity of the
# client, and any a proxy or a correlating DEALER put in front (a rank worker's requests come
# from its service's DEALER, each with a correlation frame).
MAX_ENVELOPE_FRAMES = 8
# A request's frames at most: its envelope, the empty delimiter and the request.
MAX_MESSAGE_FRAMES = MAX_ENVELOPE_FRAMES + 2
# Frames of a message longer than any request dropped per loop turn (about a millisecond):
# every request behind it waits until it is gone, so it goes as fast as the loop allows.
DISCARD_FRAMES = 2048
# A client whose ZeroMQ reply queue is full (it does not read): its replies wait in the daemon,
# tried again this often, and its new requests are refused ``busy`` unexecuted, that many at
# most; past that they are dropped unread (each still unexecuted). ZeroMQ dropped such replies
# before, of requests it had carried out.
BACKLOG_RETRY_S = 0.005
MAX_REFUSALS_HELD = 10_000
BACKLOG_SENDS = 256  # waiting replies sent per loop turn at most
# Plain ints: pyzmq's send_multipart combines its flag enums per frame, which costs more than
# the three sends themselves.
_REPLY_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_REPLY_LAST = int(zmq.NOBLOCK)

# Bytes now, or bytes or a buffer to come (a store done in slices, sent the moment it finishes;
# a snapshot built across loop turns, sent without a copy).
Reply = bytes | Pending[bytes] | Pending[memoryview] | Pending[bytes | memoryview]
# The frames a reply goes back through: the client's identity, and any envelope before it.
Route = tuple[bytes, ...]
# The request, the client that sent it (None where it cannot be told: see owners), the
# request's frame as received (a service of rank processes forwards it as it came) and the
# route of its reply (which tells one client's requests from another's).
Handler = Callable[[Request, Owner | None, bytes, Route], Reply]


class StartupError(RuntimeError):
    """The daemon cannot start as configured."""


class ControlServer:
    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        config: ControlConfig,
        handler: Handler,
        metrics: MetricsHooks,
        replies_bounded_by_client: bool = False,
    ) -> None:
        """``replies_bounded_by_client``: the only client (a rank worker's service) bounds
        what it has in flight, so no reply is ever dropped for a full queue; otherwise the
        replies of a client that stops reading are dropped past ZeroMQ's queue (its loss)."""
        self._context = context
        self._config = config
        self._handler = handler
        self._metrics = metrics
        self._replies_bounded_by_client = replies_bounded_by_client
        self._sock: zmq.Socket[bytes] | None = None
        self._curve: CurveServer | None = None
        self._fd: int | None = None
        self._serve_scheduled = False  # a _serve waits in the loop's ready queue
        self.endpoint = ""
        # (client route, rank) of the snapshot replies being put together.
        self._snapshots: set[tuple[Route, int | None]] = set()
        # Per client, its last snapshot reply until ZeroMQ has written it out, and the clients
        # whose next snapshot waits for that (see _snapshot).
        self._unsent: dict[Route, zmq.MessageTracker] = {}
        self._deferred: set[Route] = set()
        # Per client (its ROUTER identity) whose queue was full: the replies waiting, in order,
        # and how many of them are refusals of requests it sent meanwhile.
        self._backlog: dict[bytes, deque[tuple[Route, bytes | memoryview]]] = {}
        self._refusals_held: dict[bytes, int] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._requests = BoundedMessages(MAX_MESSAGE_FRAMES)

    @property
    def socket(self) -> zmq.Socket[bytes] | None:
        return self._sock

    @property
    def curve(self) -> CurveServer | None:
        """CURVE authentication (None: off); SIGHUP reloads its authorised keys."""
        return self._curve

    def bind(self) -> str:
        """Bind the ROUTER (the caller holds the endpoint's lock, so any socket file there is
        a dead daemon's)."""
        config = self._config
        sock = self._sock = listener(self._context.socket(zmq.ROUTER), LIVE_AFFINITY, self._context)
        sock.setsockopt(zmq.LINGER, 0)
        # A reply to a client whose queue is full raises Again (else ZeroMQ drops it): kept.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A client that connects again under the identity it set (an engine restarted while its
        # old connection lingers) takes it over; ZeroMQ otherwise ignored the new connection,
        # whose requests were never answered.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self._replies_bounded_by_client:
            # At the default (1000) a burst of replies its service read late was dropped, and
            # those requests were never answered.
            sock.setsockopt(zmq.SNDHWM, 0)
        if config.curve_secret_key:
            self._curve = CurveServer(
                self._context, Path(config.curve_secret_key), Path(config.curve_authorized_keys)
            )
            self._curve.apply(sock)
        # Hard cap well above the protocol limit: larger frames cost a disconnect, not memory.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * config.max_message_bytes + 1024)
        path = ipc_path(config.endpoint)  # None for an abstract name: no file to protect
        if path is not None:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        old_umask = os.umask(0o077)  # the socket file is created owner-only
        try:
            bind_ipc_safely(sock, config.endpoint)
        finally:
            os.umask(old_umask)
        if path is not None:
            os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def start(self) -> None:
        """Serve requests from the loop (reader on the socket's edge-triggered FD)."""
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        self._fd = reader_fd(self._sock)
        loop.add_reader(self._fd, self._serve)
        # Anything that arrived before the reader existed would not wake it.
        loop.call_soon(self._serve)

    def close(self) -> None:
        """Stop taking requests: close the socket, remove its file, stop CURVE."""
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._fd = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            path = ipc_path(self.endpoint)
            if path is not None:
                path.unlink(missing_ok=True)
        if self._curve is not None:
            self._curve.stop()
            self._curve = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._backlog.clear()
        self._refusals_held.clear()

    def _serve(self) -> None:
        self._serve_scheduled = False
        sock = self._sock
        if sock is None:
            return
        budget = CONTROL_BURST_BYTES
        deadline = time.perf_counter() + CONTROL_BURST_S
        for _ in range(CONTROL_BURST):
            # A frame at a time: a message of a million empty frames, read whole, held the loop
            # for seconds (one longer than any request is dropped a slice per turn).
            taken = self._requests.take(sock, DISCARD_FRAMES, most=1)
            if not taken:
                if self._requests.discarding:
                    break  # the rest of it on a later turn
                return
            ((frames, first),) = taken
            route = _route(frames)
            try:
                self._answer(first, frames, route)
            except Exception:
                # A bug: the request is answered `internal` and the socket keeps being read
                # (it is edge-triggered: a reader that stopped here would never wake again).
                log.exception("control: a request failed")
                if route is not None:
                    self._send(route, error_reply(None, "internal", "the request failed"))
            budget -= len(frames[-1])
            if budget <= 0 or time.perf_counter() >= deadline:
                break
        # More may be waiting: the loop gets a turn first.
        self._serve_scheduled = True
        asyncio.get_running_loop().call_soon(self._serve)

    def _answer(
        self, first: zmq.Frame, frames: list[bytes], route: tuple[bytes, ...] | None
    ) -> None:
        reply: Reply | None = None
        if route is None:
            log.debug("control: dropped a message without the empty delimiter")
        elif route[0] in self._backlog:
            reply = self._not_read(route, frames)
            if reply is None:
                return
        elif self._curve is not None and not self._curve.admits(_metadata(first, "User-Id")):
            reply = self._revoked(frames, len(route))
        else:
            owner = owner_of_message(_metadata(first, "Peer-Address"), self.endpoint)
            reply = self.handle_frames(frames, owner)
        if route is None or reply is None:
            return
        if isinstance(reply, bytes):
            self._send(route, reply)
        else:
            reply.then(functools.partial(self._send_settled, route))

    def handle_frames(self, frames: list[bytes], owner: Owner | None = None) -> Reply | None:
        """Answer one ROUTER message ``[identity, (envelope...,) b"", request]`` from
        ``owner``; None for unusable framing."""
        route = _route(frames)
        if route is None:
            log.debug("control: dropped a message without the empty delimiter")
            return None
        body = frames[len(route) + 1 :]
        try:
            if len(body) != 1:
                raise ProtocolError("bad_request", f"expected one request frame, got {len(body)}")
            config = self._config
            request = parse_request(
                body[0], config.max_message_bytes, config.max_tokens_per_request
            )
        except ProtocolError as exc:
            self._metrics.refused(exc.code)
            log.debug("control: refused a request: %s: %s", exc.code, exc.message)
            return error_reply(exc.request_id, exc.code, exc.message)
        log.debug("control: %s (id %r)", op_of(request), request.id)
        if isinstance(request, Snapshot):
            return self._snapshot(route, request, body[0])
        return self._handler(request, owner, body[0], route)

    def _not_read(self, route: Route, frames: list[bytes]) -> bytes | None:
        """The answer to a request of a client whose earlier replies wait for it to read: it
        is refused ``busy`` and not carried out, or, past MAX_REFUSALS_HELD such refusals,
        dropped."""
        self._metrics.refused("busy")
        held = self._refusals_held.get(route[0], 0)
        if held >= MAX_REFUSALS_HELD:
            return None
        self._refusals_held[route[0]] = held + 1
        request_id = peek_id(frames[-1]) if len(frames) == len(route) + 2 else None
        return error_reply(
            request_id, "busy", "this client's earlier replies are not read: read them first"
        )

    def _revoked(self, frames: list[bytes], envelope: int) -> Reply | None:
        """The answer to a client admitted by a key that is no longer authorised."""
        self._metrics.refused("unauthorized")
        log.debug("control: refused a request of a client whose CURVE key was revoked")
        request_id = peek_id(frames[-1]) if len(frames) == envelope + 2 else None
        return error_reply(
            request_id, "unauthorized", "this client's CURVE key is no longer authorised"
        )

    def _snapshot(self, identity: Route, request: Snapshot, frame: bytes) -> Reply:
        """One snapshot at a time per client: each reply is a copy of the rank's published
        state, so a client that pipelined snapshots without reading them queued a copy per
        request (every request shares one build). Another request while the last of that rank
        is being put together is refused ``busy``; one that comes while the client's last reply
        still waits in ZeroMQ to be written to its connection (a client that does not read)
        waits for that first, and a further one meanwhile is refused ``busy``."""
        key = (identity, request.rank)
        if key in self._snapshots or identity in self._deferred:
            self._metrics.control(op_of(request), "busy")
            return error_reply(
                request.id, "busy", "this client's last snapshot is not sent yet: read it first"
            )
        unsent = self._unsent.get(identity)
        if unsent is None or unsent.done:
            return self._build_snapshot(key, request, frame)
        later: Pending[bytes | memoryview] = Pending()
        self._deferred.add(identity)
        loop = asyncio.get_running_loop()

        def when_sent() -> None:
            if self._sock is None:  # closed meanwhile: nothing to answer on
                self._deferred.discard(identity)
                later.fail(asyncio.CancelledError())
            elif not unsent.done:
                loop.call_later(UNSENT_POLL_S, when_sent)
            else:
                self._deferred.discard(identity)
                reply = self._build_snapshot(key, request, frame)
                if isinstance(reply, bytes):
                    later.resolve(reply)
                else:
                    reply.then(later.settle_as)

        loop.call_later(UNSENT_POLL_S, when_sent)
        return later

    def _build_snapshot(
        self, key: tuple[Route, int | None], request: Snapshot, frame: bytes
    ) -> Reply:
        reply = self._handler(request, None, frame, key[0])
        if isinstance(reply, Pending):
            self._snapshots.add(key)
            reply.then(lambda _reply, _error: self._snapshots.discard(key))
        return reply

    def _send(self, identity: Route, reply: bytes | memoryview) -> None:
        if self._sock is None:
            return
        waiting = self._backlog.get(identity[0])
        if waiting is not None:  # behind the replies that wait already
            waiting.append((identity, reply))
            return
        try:
            self._write(identity, reply)
        except zmq.Again:  # its queue is full: the reply waits here
            self._backlog[identity[0]] = deque([(identity, reply)])
            self._retry_later()
        except zmq.ZMQError as exc:  # the client is gone: its loss
            log.debug("control: reply dropped: %s", exc)

    def _write(self, identity: Route, reply: bytes | memoryview) -> None:
        """Hand the reply to ZeroMQ; zmq.Again (nothing sent) when the client's queue is full."""
        assert self._sock is not None
        send = self._sock.send
        for frame in identity:
            send(frame, _REPLY_MORE)
        send(b"", _REPLY_MORE)
        if isinstance(reply, bytes):
            send(reply, _REPLY_LAST)
            return
        # Large replies (snapshots) go without a copy; the tracker says when ZeroMQ has
        # written it out (it lets go of the buffer then).
        tracker = send(reply, _REPLY_LAST, copy=False, track=True)
        if len(self._unsent) >= UNSENT_SWEEP:  # clients gone since: forget their done ones
            self._unsent = {peer: t for peer, t in self._unsent.items() if not t.done}
        self._unsent[identity] = tracker

    def _retry_later(self, delay_s: float = BACKLOG_RETRY_S) -> None:
        if self._retry is None:
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(delay_s, self._send_backlog)

    def _send_backlog(self) -> None:
        """Send what waits for each client, in order, as far as its queue takes it, and
        BACKLOG_SENDS replies in all at most: a client that reads again may have 10 000
        refusals waiting, a few tens of milliseconds of sends in one step."""
        self._retry = None
        if self._sock is None:
            return
        budget = BACKLOG_SENDS
        for peer, waiting in list(self._backlog.items()):
            try:
                while waiting and budget:
                    self._write(*waiting[0])
                    waiting.popleft()
                    budget -= 1
            except zmq.Again:
                continue  # still full
            except zmq.ZMQError as exc:  # the client is gone
                log.debug("control: %d replies dropped: %s", len(waiting), exc)
                waiting.clear()
            if waiting:
                break  # the budget is spent: the rest on the next turn
            del self._backlog[peer]
            self._refusals_held.pop(peer, None)
        if self._backlog:
            self._retry_later(0 if not budget else BACKLOG_RETRY_S)
        self._rearm()

    def _send_settled(
        self, identity: Route, reply: bytes | memoryview | None, _: BaseException | None
    ) -> None:
        if reply is not None:  # a reply cancelled at shutdown is not sent
            self._send(identity, reply)
            self._rearm()

    def _rearm(self) -> None:
        """After a send from outside the reader. A send processes the socket's command mailbox
        and so clears its edge-triggered FD: a request that arrived meanwhile would wait, unread,
        until a new connection's handshake signalled the FD again (a reset neither published nor
        answered). Reading EVENTS says whether one waits; the reader then gets a turn."""
        sock = self._sock
        if sock is not None and not self._serve_scheduled and readable(sock):
            self._serve_scheduled = True
            asyncio.get_running_loop().call_soon(self._serve)


def _route(frames: list[bytes]) -> Route | None:
    """The frames before the empty delimiter (the identity first); None without one."""
    for index in range(1, min(len(frames), MAX_ENVELOPE_FRAMES + 1)):
        if frames[index] == b"":
            return tuple(frames[:index])
    return None


def _metadata(frame: zmq.Frame, name: str) -> str | None:
    """A property libzmq gives a received message (``Peer-Address``, ``User-Id``); None where
    the connection has none."""
    try:
        return cast(str, frame.get(name))
    except zmq.ZMQError:
        return None
