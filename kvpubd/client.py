"""Clients of a running daemon: ``ControlClient`` / ``AsyncControlClient`` for the control
socket, ``Subscriber`` / ``AsyncSubscriber`` for the event stream (``kvpubd.subscriber``,
re-exported here), ``replay()``, ``Mirror`` (a cache view rebuilt from published events alone)
and ``map_pool``."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from kvpubd.config import default_control_endpoint
from kvpubd.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    unpack_seq,
)


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
        from kvpubd.auth import apply_curve_client

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


class MappedPool:
    """The daemon's block pool mapped into this process: ``array`` is ``[num_blocks,
    block_bytes]`` uint8, a NumPy array over shared memory or a CuPy array over a CUDA IPC
    mapping. Close it before the daemon stops."""

    def __init__(self, info: dict[str, Any]) -> None:
        shape = tuple(info["shape"])
        self.info = info
        self._shm: Any = None
        self._ipc_ptr: int | None = None
        if info["kind"] == "shm":
            from multiprocessing import resource_tracker, shared_memory

            self._shm = shared_memory.SharedMemory(name=info["name"])
            # Before Python 3.13 attaching registers the segment with this process's resource
            # tracker, which would unlink the daemon's segment when we exit.
            resource_tracker.unregister(self._shm._name, "shared_memory")
            self.array: Any = np.ndarray(shape, dtype=np.uint8, buffer=self._shm.buf)
        elif info["kind"] == "cuda_ipc":
            import cupy

            self._device = int(info["device"])
            with cupy.cuda.Device(self._device):
                self._ipc_ptr = cupy.cuda.runtime.ipcOpenMemHandle(
                    info["handle"], cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
                )
                size = shape[0] * shape[1]
                memory = cupy.cuda.UnownedMemory(self._ipc_ptr + info.get("offset", 0), size, self)
                pointer = cupy.cuda.MemoryPointer(memory, 0)
                self.array = cupy.ndarray(shape, dtype=cupy.uint8, memptr=pointer)
        else:
            raise ValueError(f"unknown pool kind {info['kind']!r}")

    def __enter__(self) -> MappedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.array = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._ipc_ptr is not None:
            import cupy

            with cupy.cuda.Device(self._device):
                cupy.cuda.runtime.deviceSynchronize()
                cupy.cuda.runtime.ipcCloseMemHandle(self._ipc_ptr)
            self._ipc_ptr = None


def map_pool(control: ControlClient, rank: int = 0) -> MappedPool:
    """Map rank ``rank``'s block pool of the daemon behind ``control`` into this process."""
    return MappedPool(control.pool_info(rank))


@dataclass(slots=True)
class Received:
    """One batch as a subscriber sees it."""

    rank: int
    seq: int
    batch: EventBatch
    payload: bytes
    replayed: bool


def replay(
    endpoint: str, start_seq: int, *, timeout: float = 5.0, context: zmq.Context | None = None
) -> list[tuple[int, bytes]]:
    """Ask a replay socket for every retained batch from ``start_seq``: [(seq, payload)]."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"replay from {endpoint} did not finish")
            frames = sock.recv_multipart()
            # [b"", topic, seq, payload] (v026) or [b"", seq, payload] (legacy)
            seq_frame, payload = frames[-2], frames[-1]
            if seq_frame == END_SEQ:
                return batches
            batches.append((unpack_seq(seq_frame), payload))
    finally:
        sock.close()


class MirrorError(AssertionError):
    """The published stream broke an invariant routers rely on."""


@dataclass
class Mirror:
    """The cache as a router sees it, built only from published events. Applying an event
    that breaks DESIGN.md's invariants raises MirrorError."""

    block_size: int | None = None
    blocks: dict[BlockHash, BlockStored] = field(default_factory=dict)

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if block_hash not in self.blocks:
                        raise MirrorError(f"BlockRemoved names unknown block {block_hash!r}")
                    del self.blocks[block_hash]

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        if self.block_size is not None and size != self.block_size:
            raise MirrorError(f"block_size {size} != {self.block_size}")
        if len(event.token_ids) != len(event.block_hashes) * size:
            raise MirrorError("token_ids length is not blocks x block_size")
        parent = event.parent_block_hash
        if parent is not None and parent not in self.blocks:
            raise MirrorError(f"BlockStored parent {parent!r} is not live")
        for i, block_hash in enumerate(event.block_hashes):
            if block_hash in self.blocks:
                raise MirrorError(f"BlockStored repeats live block {block_hash!r}")
            self.blocks[block_hash] = BlockStored(
                [block_hash],
                parent,
                event.token_ids[i * size : (i + 1) * size],
                size,
                event.lora_id,
                event.medium,
                event.lora_name,
            )
            parent = block_hash


# The subscribers build on the pieces above.
from kvpubd.subscriber import (  # noqa: E402
    AsyncSubscriber,
    Counters,
    Subscriber,
    SubscriberError,
    SubscriberTimeout,
)

__all__ = [
    "AsyncControlClient",
    "AsyncSubscriber",
    "ControlClient",
    "ControlError",
    "ControlTimeout",
    "Counters",
    "MappedPool",
    "Mirror",
    "MirrorError",
    "Received",
    "Subscriber",
    "SubscriberError",
    "SubscriberTimeout",
    "map_pool",
    "replay",
]
