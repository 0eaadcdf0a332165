"""Snapshots of one rank's published cache, built a slice at a time so that no snapshot holds
the loop, whatever the cache's size.

A ``SnapshotJob`` publishes what is captured, takes an O(1) frozen view of the published
record (the state at that seq) and encodes the view's blocks as one-block ``BlockStored``
events in slices of about ``SLICE_S`` seconds, yielding to the loop between slices: a reset
or a store arriving meanwhile waits one slice at most. Every request at the same seq shares one
job (the control ``snapshot`` op, replays of history the ring no longer holds, and the
snapshot endpoint). A reset during the build starts it again on the new state.

The events are encoded once, in chunks of about ``CHUNK_BYTES``, each chunk a whole batch
``[ts, events, rank]`` as the snapshot endpoint sends it; the control op and the replay batch
put their one message together from the chunks' event bodies, without re-encoding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np

from kvpubd.daemon.published import FrozenView, PublishedRecord
from kvpubd.daemon.turns import next_slice
from kvpubd.protocol.wire import (
    AllBlocksCleared,
    BatchEncoder,
    BlockStored,
    WireFormat,
    batch_envelope,
    event_to_wire,
)

log = logging.getLogger(__name__)

SLICE_S = 0.0005  # encoding work per loop turn
SLICE_ENTRIES = 32  # log entries read between two clock checks (~0.2 ms of encoding)
# Encoded events per chunk, in bytes: few enough frames that sending a 1M-block snapshot
# costs little per frame, small enough that putting a chunk together is quick.
CHUNK_BYTES = 1 << 18
FREE_STEP_BYTES = 1 << 20  # chunk bytes a snapshot lets go of per loop turn (see free_some)


class SnapshotSource(Protocol):
    """What a job reads: the rank's pipeline. Its published records, one per tier (the pool,
    then the host tier if any), are frozen and read together."""

    rank: int

    def freeze_published(self) -> tuple[int, list[FrozenView[Any]]] | None: ...

    def current_records(self) -> list[PublishedRecord[Any]]: ...

    def block_events(self, tier: int, block_ids: list[Any]) -> list[BlockStored]: ...


ASSEMBLY_STEP = 1 << 20  # bytes copied per loop turn when a large message is put together


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The published blocks of one rank at ``seq``: ``count`` one-block stores in ``chunks``,
    each a whole batch ``[ts, events, rank]``; ``bodies`` are views of the chunks' events
    alone (an array's items without its header), in the same order."""

    seq: int
    count: int
    chunks: list[bytes]
    bodies: list[memoryview]
    nbytes: int  # the chunks' bytes, as built (what replies still in flight keep alive)
    built_chunks: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "built_chunks", len(self.chunks))

    @property
    def freed(self) -> bool:
        """Whether the reaper has begun letting go of its chunks: the rank's state moved on
        and the snapshot was retired while a reader had yet to take its chunks (its done
        callback or wakeup still queued). Such a reader asks for a newer build instead."""
        return len(self.chunks) < self.built_chunks

    def free_some(self) -> bool:
        """Let go of about FREE_STEP_BYTES of chunks; True once none is left. The reaper calls
        it a loop turn at a time for a snapshot no request can use any more: letting go of a
        million blocks' chunks at once took 15-19 ms on the dev VM."""
        chunks, bodies = self.chunks, self.bodies
        freed = 0
        while chunks and freed < FREE_STEP_BYTES:
            freed += len(chunks[-1])
            bodies.pop()  # the view first: its chunk is freed with the chunk's last reference
            chunks.pop()
        return not chunks

    async def batch_payload(
        self, ts: float, rank: int, wire_format: WireFormat, publisher_id: bytes | None = None
    ) -> Buffer:
        """A replay batch that rebuilds the state: ``[ts, [AllBlocksCleared, *stores], rank]``
        (and the publisher id, while the snapshot protocol is on)."""
        head, tail = batch_envelope(ts, self.count + 1, rank, publisher_id)
        cleared = msgspec.msgpack.encode(event_to_wire(AllBlocksCleared(), wire_format))
        parts: list[bytes | memoryview] = [head + cleared, *self.bodies, tail]
        return await assemble(parts)


Buffer = memoryview  # a large message, sent without a copy


async def assemble(parts: Sequence[bytes | memoryview]) -> Buffer:
    """The parts joined into one buffer, about ASSEMBLY_STEP bytes copied at a time, each in
    its turn (turns.py; a snapshot's message can be hundreds of megabytes: one join would
    hold the loop)."""
    # Uninitialised memory (a zero-filled bytearray of this size costs a memset in one go).
    out = np.empty(sum(len(part) for part in parts), dtype=np.uint8).data
    offset = copied = 0
    for part in parts:
        out[offset : offset + len(part)] = part
        offset += len(part)
        copied += len(part)
        if copied >= ASSEMBLY_STEP:
            copied = 0
            await next_slice()
    return out


class SnapshotJob:
    def __init__(self, source: SnapshotSource, wire_format: WireFormat) -> None:
        self._source = source
        self._wire_format = wire_format
        self.seq = -1  # the seq the job is (or was last) building at
        self.result: asyncio.Future[Snapshot] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name=f"kvpubd snapshot rank {source.rank}")

    def advance_to(self, seq: int) -> None:
        """A finished job stands for a later ``seq`` at which nothing changed (only empty
        batches, heartbeats, went out since): its snapshot, numbered ``seq``, chunks shared."""
        snapshot = self.result.result()
        self.seq = seq
        self.result = asyncio.get_running_loop().create_future()
        self.result.set_result(dataclasses.replace(snapshot, seq=seq))

    def cancel(self) -> None:
        self._task.cancel()
        if not self.result.done():
            self.result.cancel()

    async def _run(self) -> None:
        try:
            snapshot = await self._build()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: fail the requests, not the daemon
            log.exception("rank %d: snapshot failed", self._source.rank)
            if not self.result.done():
                self.result.set_exception(exc)
            return
        if not self.result.done():
            self.result.set_result(snapshot)

    async def _build(self) -> Snapshot:
        source = self._source
        while True:
            frozen = source.freeze_published()
            if frozen is None:  # the record is being compacted: a few turns
                await asyncio.sleep(0)
                continue
            self.seq, views = frozen
            try:
                body = await self._encode(views)
            finally:
                for view in views:
                    view.close()
            if body is not None:
                chunks, bodies = body
                nbytes = sum(len(chunk) for chunk in chunks)
                count = sum(view.count for view in views)
                return Snapshot(self.seq, count, chunks, bodies, nbytes)
            # A reset replaced the record mid-way: build again, on the new state.

    async def _encode(
        self, views: list[FrozenView[Any]]
    ) -> tuple[list[bytes], list[memoryview]] | None:
        source = self._source
        # A slice's events are encoded at its end, in one msgspec call with their NumPy token
        # rows (views into the cache: encoded before the loop turns, so no slot is reused
        # meanwhile), as live batches are; the slices' events are joined into chunks.
        encoder = BatchEncoder(self._wire_format, source.rank)
        ts = time.time()
        chunks: list[bytes] = []
        bodies: list[memoryview] = []
        pending: list[memoryview] = []  # encoded events waiting for their chunk
        count = pending_bytes = 0

        def close_chunk() -> None:
            nonlocal count, pending_bytes
            head, tail = batch_envelope(ts, count, source.rank)
            chunk = b"".join((head, *pending, tail))
            chunks.append(chunk)
            bodies.append(memoryview(chunk)[len(head) : len(chunk) - len(tail)])
            pending.clear()
            count = pending_bytes = 0

        def encode(events: list[BlockStored]) -> None:
            nonlocal count, pending_bytes
            if not events:
                return
            encoded = encoder.encode_events(events)  # type: ignore[arg-type]
            pending.append(encoded)
            count += len(events)
            pending_bytes += len(encoded)

        records = [view.record for view in views]
        for tier, view in enumerate(views):
            while not view.finished:
                current = source.current_records()
                if any(now is not then for now, then in zip(current, records, strict=True)):
                    return None
                deadline = time.perf_counter() + SLICE_S
                events: list[BlockStored] = []
                while not view.finished and time.perf_counter() < deadline:
                    live: list[int] = []
                    for block_id, saved in view.take(SLICE_ENTRIES):
                        if saved is None:
                            live.append(block_id)
                        else:
                            # Removed since the view was taken; events stay in log order.
                            events += source.block_events(tier, live)
                            live = []
                            events.append(saved)
                    events += source.block_events(tier, live)
                encode(events)
                if pending_bytes >= CHUNK_BYTES:
                    close_chunk()
                await asyncio.sleep(0)
        if count:
            close_chunk()
        return chunks, bodies
