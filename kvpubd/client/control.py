"""Control clients of a running daemon: ``ControlClient`` (blocking) and
``AsyncControlClient`` (asyncio), over a DEALER socket."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from kvpubd.protocol.config import default_control_endpoint


class ControlError(Exception):
    """The daemon refused a request; ``code`` is its error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ControlTimeout(TimeoutError):
    """No reply within the timeout: the daemon is not running or not reachable there."""


def _encode_request(op: str, request_id: int, fields: dict[str, Any]) -> bytes:
    return msgpack.packb({"op": op, "id": request_id, **fields}, use_bin_type=True)


def _checked(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise ControlError(str(error.get("code")), str(error.get("message")))
    return reply


def _dealer(context: zmq.Context, endpoint: str, curve: tuple[Path, Path] | None) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        from kvpubd.protocol.auth import apply_curve_client

        apply_curve_client(sock, *curve)
    sock.connect(endpoint)
    return sock


class _Ops:
    """The control ops, on top of a ``call`` that is a plain or an async function."""

    def call(self, op: str, **fields: Any) -> Any:
        raise NotImplementedError

    def _call_for(self, key: str, op: str, **fields: Any) -> Any:
        raise NotImplementedError

    def ping(self) -> Any:
        return self.call("ping")

    def stats(self) -> Any:
        return self.call("stats")

    def store(self, request_id: str | int, token_ids: list[int] | np.ndarray, **fields: Any) -> Any:
        """Store a prompt; a NumPy array travels as packed uint32 bytes (the fast form)."""
        if isinstance(token_ids, np.ndarray):
            token_ids = token_ids.astype("<u4").tobytes()
        return self.call("store", request_id=request_id, token_ids=token_ids, **fields)

    def release(self, request_id: str | int) -> Any:
        return self.call("release", request_id=request_id)

    def reset(self, rank: int | None = None, force: bool = False) -> Any:
        """The markers: ``[{"rank": r, "seq": s}, ...]``."""
        fields: dict[str, Any] = {"force": force}
        if rank is not None:
            fields["rank"] = rank
        return self._call_for("markers", "reset", **fields)

    def pause(self) -> Any:
        return self.call("pause")

    def resume(self) -> Any:
        return self.call("resume")

    def snapshot(self, rank: int = 0) -> Any:
        return self.call("snapshot", rank=rank)

    def pool_info(self, rank: int = 0) -> Any:
        return self.call("pool_info", rank=rank)

    def checksum(self, block_ids: list[int], rank: int = 0) -> Any:
        return self._call_for("checksums", "checksum", rank=rank, block_ids=block_ids)


class ControlClient(_Ops):
    """Synchronous control client over a DEALER socket. Replies are matched by id, so a late
    reply to a timed-out request never answers the next one. ``curve``: (this client's secret
    certificate, the daemon's public certificate) for a daemon with CURVE on."""

    def __init__(
        self,
        endpoint: str | None = None,
        timeout: float = 5.0,
        context: zmq.Context | None = None,
        curve: tuple[Path, Path] | None = None,
    ) -> None:
        self.endpoint = endpoint or default_control_endpoint()
        self.timeout = timeout
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._sock = _dealer(self._context, self.endpoint, curve)
        self._ids = itertools.count(1)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()
        if self._own_context:
            self._context.term()

    def send_raw(self, frames: list[bytes]) -> None:
        """Send frames as they are (after the delimiter), for protocol tests."""
        # With no usable connection (nothing listening, or a refused CURVE handshake) a DEALER
        # holds the message back; don't wait longer than for a reply.
        if not self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
            raise ControlTimeout(f"cannot send to {self.endpoint}")
        self._sock.send_multipart([b"", *frames], zmq.NOBLOCK)

    def recv_raw(self, timeout: float | None = None) -> dict[str, Any]:
        if not self._sock.poll(int((self.timeout if timeout is None else timeout) * 1000)):
            raise ControlTimeout(f"no reply from {self.endpoint}")
        frames = self._sock.recv_multipart()
        return msgpack.unpackb(frames[-1], raw=False)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request; return the reply map, or raise ControlError / ControlTimeout."""
        request_id = next(self._ids)
        self.send_raw([_encode_request(op, request_id, fields)])
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self.recv_raw(max(0.0, deadline - time.monotonic()))
            if isinstance(reply, dict) and reply.get("id") == request_id:
                return _checked(reply)

    def _call_for(self, key: str, op: str, **fields: Any) -> Any:
        return self.call(op, **fields)[key]


class AsyncControlClient(_Ops):
    """The asyncio form of ControlClient: ``await client.store(...)``."""

    def __init__(
        self,
        endpoint: str | None = None,
        timeout: float = 5.0,
        context: zmq.asyncio.Context | None = None,
        curve: tuple[Path, Path] | None = None,
    ) -> None:
        self.endpoint = endpoint or default_control_endpoint()
        self.timeout = timeout
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._sock = _dealer(self._context, self.endpoint, curve)
        self._ids = itertools.count(1)

    async def __aenter__(self) -> AsyncControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()
        if self._own_context:
            self._context.term()

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        request_id = next(self._ids)
        deadline = time.monotonic() + self.timeout
        if not await self._sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
            raise ControlTimeout(f"cannot send to {self.endpoint}")
        await self._sock.send_multipart([b"", _encode_request(op, request_id, fields)])
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._sock.poll(int(left * 1000)):
                raise ControlTimeout(f"no reply from {self.endpoint}")
            frames = await self._sock.recv_multipart()
            reply = msgpack.unpackb(frames[-1], raw=False)
            if isinstance(reply, dict) and reply.get("id") == request_id:
                return _checked(reply)

    async def _call_for(self, key: str, op: str, **fields: Any) -> Any:
        return (await self.call(op, **fields))[key]
