"""A consumer of the snapshot endpoint, as the benches use it: a REQ that sends ``b"snapshot"``
and times it to the whole reply ``[seq, publisher_id, *chunks]``, and two ways to count the
reply's events: from the chunks' array headers (cheap, every reply) or by decoding every
event and checking it is what the protocol promises (once per size: seconds at 1M blocks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq

from kvpubd.protocol.snapshot_wire import SNAPSHOT_REQUEST, UNAVAILABLE, reply_head
from kvpubd.protocol.wire import PUBLISHER_ID_BYTES, BlockStored, decode_batch

POLL_MS = 100  # how often a waiting request looks at its caller's stop flag


class SnapshotMismatch(Exception):
    """A reply that breaks the protocol, or rebuilds other than the blocks cached."""


@dataclass(frozen=True, slots=True)
class SnapshotReply:
    seq: int  # signed: -1 nothing published yet, -2 unavailable
    publisher_id: bytes
    chunks: list[memoryview]
    nbytes: int  # every frame of the reply
    seconds: float  # request sent -> whole reply received

    @property
    def unavailable(self) -> bool:
        return self.seq == UNAVAILABLE


def parse_reply(frames: list[zmq.Frame], seconds: float) -> SnapshotReply:
    """The reply's parts (without a copy); SnapshotMismatch if it is malformed
    (``snapshot_wire.reply_head``)."""
    buffers = [frame.buffer for frame in frames]
    try:
        seq, publisher_id = reply_head(buffers)
    except ValueError as exc:
        sizes = [len(buffer) for buffer in buffers[:3]]
        raise SnapshotMismatch(f"malformed reply ({exc}): first sizes {sizes}") from None
    return SnapshotReply(
        seq=seq,
        publisher_id=publisher_id,
        chunks=buffers[2:],
        nbytes=sum(len(frame.buffer) for frame in frames),
        seconds=seconds,
    )


class SnapshotRequester:
    """A REQ on one rank's snapshot endpoint. A request that gets no reply leaves a REQ that
    cannot send again: the socket is then replaced by a fresh one (as a consumer retries)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self._context = context
        self.endpoint = endpoint
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket[bytes]:
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        self._sock.close(linger=0)

    def request(
        self, timeout: float, stop: Callable[[], bool] = lambda: False
    ) -> SnapshotReply | None:
        """One snapshot, timed from the send to the whole reply; None if none came within
        ``timeout`` seconds or ``stop()`` turned true while waiting."""
        started = time.perf_counter()
        self._sock.send(SNAPSHOT_REQUEST)
        deadline = time.monotonic() + timeout
        while not self._sock.poll(POLL_MS):
            if stop() or time.monotonic() > deadline:
                self._sock.close(linger=0)
                self._sock = self._connect()
                return None
        frames = self._sock.recv_multipart(copy=False)
        return parse_reply(frames, time.perf_counter() - started)


def counted_events(chunks: list[memoryview]) -> int:
    """Events in the chunks, read from each batch's array headers alone (no event decoded)."""
    total = 0
    for chunk in chunks:
        unpacker = msgpack.Unpacker()
        unpacker.feed(chunk)
        if unpacker.read_array_header() < 3:
            raise SnapshotMismatch("a chunk is not a [ts, events, rank] batch")
        unpacker.skip()  # ts
        total += unpacker.read_array_header()
    return total


def verified_events(chunks: list[memoryview], rank: int) -> int:
    """Decode every chunk and check what the protocol promises of them: batches of the rank,
    each event a one-block ``BlockStored`` whose parent came before it, no block twice.
    Returns the events; SnapshotMismatch on the first thing wrong."""
    seen: set[int | bytes] = set()
    for index, chunk in enumerate(chunks):
        try:
            batch = decode_batch(bytes(chunk))
        except ValueError as exc:
            raise SnapshotMismatch(f"chunk {index}: {exc}") from None
        if batch.data_parallel_rank != rank:
            raise SnapshotMismatch(f"chunk {index} is of rank {batch.data_parallel_rank}")
        for event in batch.events:
            if not isinstance(event, BlockStored) or len(event.block_hashes) != 1:
                raise SnapshotMismatch(f"chunk {index}: not a one-block store: {event!r:.120}")
            parent, (block,) = event.parent_block_hash, event.block_hashes
            if parent is not None and parent not in seen:
                raise SnapshotMismatch(f"chunk {index}: a block comes before its parent")
            if block in seen:
                raise SnapshotMismatch(f"chunk {index}: a block is stored twice")
            seen.add(block)
    return len(seen)


def check_publisher_id(reply: SnapshotReply, expected: bytes) -> None:
    if len(expected) != PUBLISHER_ID_BYTES or reply.publisher_id != expected:
        raise SnapshotMismatch(
            f"publisher id {reply.publisher_id.hex()} is not the rank's ({expected.hex()})"
        )
