"""Control clients of a running daemon: ``ControlClient`` (blocking) and
``AsyncControlClient`` (asyncio), over a DEALER socket. Every op returns a typed reply
(``kvpubd.client.replies``); a refusal raises ``ControlError``, silence ``ControlTimeout``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from kvpubd.client import replies
from kvpubd.client.replies import (
    Call,
    ChecksumReply,
    ControlError,
    PauseReply,
    PingReply,
    PoolInfo,
    ReleaseReply,
    ReplyMap,
    RequestId,
    ResetReply,
    SnapshotReply,
    StatsReply,
    StoreReply,
)
from kvpubd.protocol.endpoints import (
    check_endpoint,
    default_control_endpoint,
    missing_ipc_socket,
)

__all__ = ["AsyncControlClient", "ControlClient", "ControlError", "ControlTimeout"]

T = TypeVar("T")
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

    def _frame(self, op: str, fields: dict[str, object]) -> tuple[int, list[bytes]]:
        path = missing_ipc_socket(self.endpoint)
        if path is not None:
            raise ControlTimeout(f"no control socket at {path}")
        request_id = next(self._ids)
        body = msgpack.packb({"op": op, "id": request_id, **fields}, use_bin_type=True)
        return request_id, [b"", body]

    def _cannot_send(self) -> ControlTimeout:
        return ControlTimeout(f"cannot send to {self.endpoint}")

    def _no_reply(self) -> ControlTimeout:
        return ControlTimeout(f"no reply from {self.endpoint}")

    @staticmethod
    def _answer(frames: list[bytes], request_id: int) -> ReplyMap | None:
        """The reply map if ``frames`` answer ``request_id`` (None: another request's reply);
        ControlError when the daemon refused it."""
        try:
            reply = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
        except (ValueError, msgpack.ExtraData):
            return None
        if not isinstance(reply, dict) or reply.get("id") != request_id:
            return None
        if not reply.get("ok"):
            error = reply.get("error")
            error = error if isinstance(error, dict) else {}
            raise ControlError(str(error.get("code")), str(error.get("message")))
        return reply


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

    def ping(self) -> PingReply:
        return self._run(replies.ping())

    def stats(self) -> StatsReply:
        return self._run(replies.stats())

    def store(
        self,
        request_id: RequestId,
        token_ids: Sequence[int] | np.ndarray | bytes,
        *,
        rank: int = 0,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> StoreReply:
        """Store a prompt and pin its blocks until ``release``; a NumPy array travels as
        packed uint32 bytes (the fast form)."""
        call = replies.store(
            request_id, token_ids, rank=rank, lora_id=lora_id, lora_name=lora_name,
            cache_salt=cache_salt,
        )  # fmt: skip
        return self._run(call)

    def release(self, request_id: RequestId) -> ReleaseReply:
        return self._run(replies.release(request_id))

    def reset(self, rank: int | None = None, *, force: bool = False) -> ResetReply:
        """Reset one rank (default: all); ``force`` drops requests that still pin blocks."""
        return self._run(replies.reset(rank, force=force))

    def pause(self) -> PauseReply:
        return self._run(replies.pause())

    def resume(self) -> PauseReply:
        return self._run(replies.resume())

    def snapshot(self, rank: int = 0) -> SnapshotReply:
        return self._run(replies.snapshot(rank))

    def pool_info(self, rank: int = 0) -> PoolInfo:
        return self._run(replies.pool_info(rank))

    def checksum(self, block_ids: Sequence[int], rank: int = 0) -> ChecksumReply:
        return self._run(replies.checksum(block_ids, rank))

    def _run(self, call: Call[T]) -> T:
        return call.parse(self._call(call.op, **call.fields))

    def _call(self, op: str, **fields: object) -> ReplyMap:
        """Send one request as given; the reply map, or ControlError / ControlTimeout."""
        request_id, frames = self._frame(op, fields)
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
        if not self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
            raise self._cannot_send()
        self._sock.send_multipart([b"", *frames], zmq.NOBLOCK)

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

    async def ping(self) -> PingReply:
        return await self._run(replies.ping())

    async def stats(self) -> StatsReply:
        return await self._run(replies.stats())

    async def store(
        self,
        request_id: RequestId,
        token_ids: Sequence[int] | np.ndarray | bytes,
        *,
        rank: int = 0,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> StoreReply:
        call = replies.store(
            request_id, token_ids, rank=rank, lora_id=lora_id, lora_name=lora_name,
            cache_salt=cache_salt,
        )  # fmt: skip
        return await self._run(call)

    async def release(self, request_id: RequestId) -> ReleaseReply:
        return await self._run(replies.release(request_id))

    async def reset(self, rank: int | None = None, *, force: bool = False) -> ResetReply:
        return await self._run(replies.reset(rank, force=force))

    async def pause(self) -> PauseReply:
        return await self._run(replies.pause())

    async def resume(self) -> PauseReply:
        return await self._run(replies.resume())

    async def snapshot(self, rank: int = 0) -> SnapshotReply:
        return await self._run(replies.snapshot(rank))

    async def pool_info(self, rank: int = 0) -> PoolInfo:
        return await self._run(replies.pool_info(rank))

    async def checksum(self, block_ids: Sequence[int], rank: int = 0) -> ChecksumReply:
        return await self._run(replies.checksum(block_ids, rank))

    async def _run(self, call: Call[T]) -> T:
        return call.parse(await self._call(call.op, **call.fields))

    async def _call(self, op: str, **fields: object) -> ReplyMap:
        request_id, frames = self._frame(op, fields)
        deadline = time.monotonic() + self.timeout
        # pyzmq's stub of the asyncio poll() lacks its flags argument.
        writable = self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT)  # type: ignore[call-arg]
        if not await writable:
            raise self._cannot_send()
        await self._sock.send_multipart(frames)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._sock.poll(int(left * 1000)):
                raise self._no_reply()
            reply = self._answer(await self._sock.recv_multipart(), request_id)
            if reply is not None:
                return reply
