"""Control clients of a running daemon: ``ControlClient`` (blocking) and
``AsyncControlClient`` (asyncio), over a DEALER socket. Every op returns a typed reply
(``kvpubd.client.replies``); a refusal raises ``ControlError``, silence ``ControlTimeout``."""

from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import msgpack
import msgspec
import zmq
import zmq.asyncio

from kvpubd.client import replies as ops
from kvpubd.client.replies import Call, ControlError
from kvpubd.protocol.control import (
    ControlReply,
    ControlRequest,
    encode_request,
    op_of,
    reply_fields,
)
from kvpubd.protocol.endpoints import (
    check_endpoint,
    default_control_endpoint,
    missing_ipc_socket,
)

__all__ = ["AsyncControlClient", "ControlClient", "ControlError", "ControlTimeout"]

R = TypeVar("R", bound=ControlReply)
P = ParamSpec("P")
# A reply map as decoded, before it is read as its op's reply type.
ReplyMap = dict[str, Any]
_decode_reply = msgspec.msgpack.Decoder()
ContextT = TypeVar("ContextT", zmq.Context[zmq.Socket[bytes]], zmq.asyncio.Context)

Curve = tuple[Path, Path]  # (this client's secret certificate, the daemon's public one)


class ControlTimeout(TimeoutError):
    """No reply within the timeout: the daemon is not running or not reachable there (or it
    has CURVE on and refused this client's handshake)."""


def check_timeout(timeout: float, what: str = "timeout") -> float:
    if not 0 < timeout < float("inf"):
        raise ValueError(f"{what}: {timeout} is not a positive number of seconds")
    return timeout


class _Client(Generic[ContextT]):
    """What both forms share: the endpoint, the DEALER, request ids and reply matching.
    Replies are matched by id, so a late reply to a timed-out request never answers the next
    one."""

    _context_class: type[ContextT]
    _sock: Any  # each form names its socket type

    def __init__(
        self,
        endpoint: str | None = None,
        timeout: float = 5.0,
        context: ContextT | None = None,
        curve: Curve | None = None,
    ) -> None:
        self.endpoint = check_endpoint(endpoint or default_control_endpoint())
        self.timeout = check_timeout(timeout)
        self.curve = curve
        self._own_context = context is None
        self._context: ContextT = context if context is not None else self._context_class()
        sock = self._sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                from kvpubd.protocol.auth import apply_curve_client

                apply_curve_client(sock, *curve)
            sock.connect(self.endpoint)
        except BaseException:
            sock.close()
            self._term()
            raise
        self._ids = itertools.count(1)

    def close(self) -> None:
        self._sock.close()
        self._term()

    def _term(self) -> None:
        if self._own_context:
            self._context.term()

    def _frame(self, request: ControlRequest) -> tuple[int, list[bytes]]:
        """The request's id and frames (the id is this connection's next)."""
        path = missing_ipc_socket(self.endpoint)
        if path is not None:
            raise ControlTimeout(f"no control socket at {path}")
        request_id = next(self._ids)
        body = encode_request(msgspec.structs.replace(request, id=request_id))
        return request_id, [b"", body]

    def _raw_frame(self, op: str, fields: dict[str, object]) -> tuple[int, list[bytes]]:
        """Frames of a request map as given, unchecked (protocol tests send bad ones)."""
        path = missing_ipc_socket(self.endpoint)
        if path is not None:
            raise ControlTimeout(f"no control socket at {path}")
        request_id = next(self._ids)
        body = msgpack.packb({"op": op, "id": request_id, **fields}, use_bin_type=True)
        return request_id, [b"", body]

    @staticmethod
    def _typed(call: Call[R], reply: ReplyMap) -> R:
        """The reply map as the call's reply type; ControlError ``bad_reply`` if it is not."""
        return reply_fields(reply, call.reply, op_of(call.request))

    def _cannot_send(self) -> ControlTimeout:
        return ControlTimeout(f"cannot send to {self.endpoint}")

    def _no_reply(self) -> ControlTimeout:
        return ControlTimeout(f"no reply from {self.endpoint}")

    @staticmethod
    def _answer(frames: list[bytes], request_id: int) -> ReplyMap | None:
        """The reply map if ``frames`` answer ``request_id`` (None: another request's reply);
        ControlError when the daemon refused it."""
        try:
            reply = _decode_reply.decode(frames[-1])
        except (msgspec.DecodeError, RecursionError):  # nested past msgspec's depth: this
            return None
        if not isinstance(reply, dict) or reply.get("id") != request_id:
            return None
        if not reply.get("ok"):
            error = reply.get("error")
            error = error if isinstance(error, dict) else {}
            raise ControlError(str(error.get("code")), str(error.get("message")))
        return reply


M = TypeVar("M", bound=Callable[..., object])


def _like(method: M, op: Callable[..., object]) -> M:
    """Give ``method`` the op's name, docstring and parameters (for help() and editors), with
    the reply type as what it returns."""
    functools.update_wrapper(method, op)
    signature = inspect.signature(op)
    returns = str(signature.return_annotation).removeprefix("Call[").removesuffix("]")
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    parameters = [self, *signature.parameters.values()]
    described = signature.replace(parameters=parameters, return_annotation=returns)
    method.__signature__ = described  # type: ignore[attr-defined]
    return method


def _blocking(
    op: Callable[P, Call[R]],
) -> Callable[Concatenate[ControlClient, P], R]:
    """The op as a ControlClient method: same parameters, the typed reply."""

    def method(self: ControlClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(op(*args, **kwargs))

    return _like(method, op)


def _awaited(
    op: Callable[P, Call[R]],
) -> Callable[Concatenate[AsyncControlClient, P], Coroutine[Any, Any, R]]:
    """The op as an AsyncControlClient coroutine method."""

    async def method(self: AsyncControlClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._run(op(*args, **kwargs))

    return _like(method, op)


class ControlClient(_Client[zmq.Context[zmq.Socket[bytes]]]):
    """Blocking control client. ``endpoint`` defaults to the daemon's default ipc socket;
    ``curve``: (this client's secret certificate, the daemon's public certificate) for a
    daemon with CURVE on. A bad endpoint or timeout raises ValueError at once."""

    _context_class = zmq.Context
    _sock: zmq.Socket[bytes]

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    ping = _blocking(ops.ping)
    stats = _blocking(ops.stats)
    store = _blocking(ops.store)
    release = _blocking(ops.release)
    computed = _blocking(ops.computed)
    reset = _blocking(ops.reset)
    pause = _blocking(ops.pause)
    resume = _blocking(ops.resume)
    snapshot = _blocking(ops.snapshot)
    pool_info = _blocking(ops.pool_info)
    checksum = _blocking(ops.checksum)
    batch = _blocking(ops.batch)

    def _run(self, call: Call[R]) -> R:
        return self._typed(call, self._exchange(*self._frame(call.request)))

    def _call(self, op: str, **fields: object) -> ReplyMap:
        """Send one request map as given, unchecked; the reply map, or ControlError /
        ControlTimeout (protocol tests)."""
        return self._exchange(*self._raw_frame(op, fields))

    def _exchange(self, request_id: int, frames: list[bytes]) -> ReplyMap:
        self._send_raw(frames[1:])
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                raise self._no_reply()
            reply = self._answer(self._sock.recv_multipart(), request_id)
            if reply is not None:
                return reply

    def _send_raw(self, frames: list[bytes]) -> None:
        """Send frames as they are, after the empty delimiter (protocol tests use it)."""
        # With no usable connection (nothing listening, or a refused CURVE handshake) a DEALER
        # holds the message back; don't wait longer than for a reply.
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000), zmq.POLLOUT):
                raise self._cannot_send()
            try:
                self._sock.send_multipart([b"", *frames], zmq.NOBLOCK)
                return
            except zmq.Again:
                # Writable a moment ago, then the connection went (a refused CURVE handshake
                # drops it): wait for the next one until the deadline.
                continue

    def _recv_raw(self, timeout: float | None = None) -> object:
        """The next reply as msgpack decodes it, whatever it answers (protocol tests)."""
        if not self._sock.poll(int((self.timeout if timeout is None else timeout) * 1000)):
            raise self._no_reply()
        return msgpack.unpackb(self._sock.recv_multipart()[-1], raw=False)


class AsyncControlClient(_Client[zmq.asyncio.Context]):
    """The asyncio form of ControlClient, with the same arguments and replies:
    ``await client.store(...)``."""

    _context_class = zmq.asyncio.Context
    _sock: zmq.asyncio.Socket

    async def __aenter__(self) -> AsyncControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    ping = _awaited(ops.ping)
    stats = _awaited(ops.stats)
    store = _awaited(ops.store)
    release = _awaited(ops.release)
    computed = _awaited(ops.computed)
    reset = _awaited(ops.reset)
    pause = _awaited(ops.pause)
    resume = _awaited(ops.resume)
    snapshot = _awaited(ops.snapshot)
    pool_info = _awaited(ops.pool_info)
    checksum = _awaited(ops.checksum)
    batch = _awaited(ops.batch)

    async def _run(self, call: Call[R]) -> R:
        return self._typed(call, await self._exchange(*self._frame(call.request)))

    async def _call(self, op: str, **fields: object) -> ReplyMap:
        """The asyncio form of ControlClient._call."""
        return await self._exchange(*self._raw_frame(op, fields))

    async def _exchange(self, request_id: int, frames: list[bytes]) -> ReplyMap:
        deadline = time.monotonic() + self.timeout
        # pyzmq's stub of the asyncio poll() lacks its flags argument.
        writable = self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT)  # type: ignore[call-arg]
        if not await writable:
            raise self._cannot_send()
        try:
            # Not beyond the deadline: the connection can go between poll and send.
            left = max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(self._sock.send_multipart(frames), left)
        except asyncio.TimeoutError:
            raise self._cannot_send() from None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._sock.poll(int(left * 1000)):
                raise self._no_reply()
            reply = self._answer(await self._sock.recv_multipart(), request_id)
            if reply is not None:
                return reply
