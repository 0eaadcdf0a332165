"""The daemon's service in this process, driven through its control handler, for tests that
count what happens on each turn of the loop (which a subprocess hides).

``InProcess.per_turn`` samples a value once per loop turn: between two samples exactly one
step of every other task ran (each resumes once per turn), so the difference of two samples is
what one step did. ``InProcess.mirror`` rebuilds the cache from the real PUB socket's batches
(a ``Mirror`` raises on any broken stream invariant) up to the current snapshot."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack
import zmq

from kvpubd.client import Mirror, SnapshotReply
from kvpubd.daemon.cache import RankCache
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.pipeline import RankPipeline
from kvpubd.daemon.service import Service
from kvpubd.daemon.settings import Settings
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockStored, decode_batch, unpack_seq
from tests.mirrors import snapshot_blocks

TINY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"}
BOUND_S = 20.0  # a bound against hanging, far above anything a healthy daemon needs
MAX_TURNS = 1_000_000


class InProcess:
    def __init__(self, service: Service, sub: zmq.Socket[bytes]) -> None:
        self.service = service
        self.sub = sub
        self._ids = iter(range(1 << 30))
        self.history: list[tuple[int, list[Any]]] = []  # (seq, events) of every batch read

    @property
    def pipeline(self) -> RankPipeline:
        return self.service.pipelines[0]

    @property
    def cache(self) -> RankCache:
        return self.pipeline.cache

    def send(self, op: str, **fields: Any) -> bytes | Pending[Any]:
        """Hand one request to the control handler, as the control socket would."""
        assert self.service.control is not None
        frames = [b"peer", b"", msgpack.packb({"op": op, "id": next(self._ids), **fields})]
        reply = self.service.control.handle_frames(frames)
        assert reply is not None
        return reply

    async def answer(self, reply: bytes | Pending[Any]) -> dict[str, Any]:
        """The decoded reply, once it came (a loop turn at a time)."""
        if isinstance(reply, Pending):
            pending = reply
            await self.turns_until(lambda: pending.done)
            outcome: list[Any] = []
            pending.then(lambda value, error: outcome.append(error or value))
            (reply,) = outcome
        assert isinstance(reply, bytes | memoryview), reply
        answer: dict[str, Any] = msgpack.unpackb(bytes(reply), raw=False)
        return answer

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        return await self.answer(self.send(op, **fields))

    async def per_turn(self, sample: Callable[[], int], until: Callable[[], bool]) -> list[int]:
        """``sample()`` now and after each loop turn until ``until()``."""
        samples = [sample()]
        for _ in range(MAX_TURNS):
            if until():
                return samples
            await asyncio.sleep(0)
            samples.append(sample())
        raise AssertionError("still not done after a million loop turns")

    async def turns_until(self, until: Callable[[], bool]) -> None:
        await self.per_turn(lambda: 0, until)

    def _read(self, seq: int) -> None:
        deadline = time.monotonic() + BOUND_S
        while not self.history or self.history[-1][0] < seq:
            assert self.sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), (
                f"batch {seq} never arrived"
            )
            _topic, seq_frame, payload = self.sub.recv_multipart()
            self.history.append((unpack_seq(seq_frame), decode_batch(payload).events))

    async def mirror(self) -> dict[BlockHash, BlockStored]:
        """The published stream, applied from the first batch read, checked against the
        rank's snapshot at the same seq; the blocks."""
        snapshot = SnapshotReply.parse(await self.call("snapshot"))
        self._read(snapshot.seq)
        mirror = Mirror()
        for seq, events in self.history:
            if seq <= snapshot.seq:
                mirror.apply(events)
        assert mirror.blocks == snapshot_blocks(snapshot)
        return mirror.blocks

    def go_live(self) -> None:
        """Reset until a marker arrives: the SUB socket is subscribed from then on."""
        for _ in range(200):
            assert self.service.control is not None
            self.send("reset")
            if self.sub.poll(50):
                while self.sub.poll(50):
                    _topic, seq_frame, payload = self.sub.recv_multipart()
                    events = decode_batch(payload).events
                    if any(isinstance(event, AllBlocksCleared) for event in events):
                        self.history = [(unpack_seq(seq_frame), events)]
                return
        raise AssertionError("the subscriber never received a marker")


def settings(
    tmp_path: Path,
    num_blocks: int,
    host_blocks: int = 0,
    upstream: dict[str, Any] | None = None,
    **control: Any,
) -> Settings:
    return Settings(
        events={"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
        control={"endpoint": f"ipc://{tmp_path}/ctl", **control},
        cache={**TINY, "num_blocks": num_blocks, "host_blocks": host_blocks},
        service={"linger_ms": 0},
        upstream=upstream or {},
    )


@asynccontextmanager
async def in_process(
    tmp_path: Path,
    num_blocks: int,
    host_blocks: int = 0,
    upstream: dict[str, Any] | None = None,
    **control: Any,
) -> AsyncIterator[InProcess]:
    """A started service with a subscriber that is live (``host_blocks``: its host tier;
    ``upstream``: following an engine)."""
    service = Service(settings(tmp_path, num_blocks, host_blocks, upstream, **control))
    await service.startup()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(service.pipelines[0].publisher.endpoint)
    try:
        daemon = InProcess(service, sub)
        daemon.go_live()
        yield daemon
    finally:
        sub.close(linger=0)
        context.term()
        await service.shutdown()
