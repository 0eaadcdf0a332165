"""The snapshot protocol's frames (vLLM's), declared once for the daemon that serves it and the
consumers that read it, without any I/O.

Live message: ``[topic, seq, payload]``, the payload ``[ts, events, data_parallel_rank,
publisher_id]`` (16 bytes of publisher_id: one publisher lifetime). Snapshot request: one frame
``b"snapshot"`` on a REQ socket; reply ``[seq, publisher_id, chunk_0, ...]`` with ``seq`` a
signed 64-bit big-endian (>= 0: the last live seq the chunks cover; -1: nothing published
yet; -2: unavailable now) and each chunk a ``[ts, events, data_parallel_rank]`` batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from kvpubd.protocol import wire
from kvpubd.protocol.wire import PUBLISHER_ID_BYTES

SNAPSHOT_REQUEST = b"snapshot"
NOTHING_PUBLISHED = -1  # reply seq: an empty index, no live seq covered yet
UNAVAILABLE = -2  # reply seq: no snapshot right now (and no chunks): retry later


def pack_signed_seq(seq: int) -> bytes:
    """A reply's seq frame: signed 64-bit big-endian."""
    return seq.to_bytes(8, "big", signed=True)


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    """A live payload's outer array; the events stay undecoded until they are applied (those
    a snapshot covers never are)."""

    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None
    publisher_id: bytes | None = None


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


class NoPublisherId(ValueError):
    """A ``[ts, events, rank]`` batch: the publisher does not serve snapshots."""


@dataclass(frozen=True, slots=True)
class LiveMessage:
    seq: int
    publisher_id: bytes
    payload: bytes


def parse_live(frames: list[bytes], rank: int) -> LiveMessage:
    """One live message of ``rank``'s stream; ValueError (NoPublisherId for a 3-element
    payload) when it is not one."""
    seq, payload = wire.split_live(frames)
    try:
        envelope = _ENVELOPE.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:  # nested past msgspec's depth: this
        raise ValueError(f"payload is not a batch: {exc}") from None
    named = envelope.data_parallel_rank
    if named is not None and named != rank:
        # Another rank's batch (a misrouted socket): its events would land in this rank's index.
        raise ValueError(f"a batch of rank {named} on rank {rank}'s stream")
    publisher_id = envelope.publisher_id
    if publisher_id is None:
        raise NoPublisherId("the batch has no publisher_id")
    if len(publisher_id) != PUBLISHER_ID_BYTES:
        raise ValueError(f"publisher_id has {len(publisher_id)} bytes, not 16")
    return LiveMessage(seq, publisher_id, payload)


@dataclass(frozen=True, slots=True)
class SnapshotReply:
    seq: int
    publisher_id: bytes
    chunks: list[bytes]


def parse_reply(frames: list[bytes]) -> SnapshotReply:
    """A snapshot reply; ValueError when malformed (see ``reply_head``)."""
    seq, publisher_id = reply_head(frames)
    return SnapshotReply(seq, publisher_id, frames[2:])


def reply_head(frames: Sequence[bytes | memoryview]) -> tuple[int, bytes]:
    """A reply's seq and publisher_id; ValueError when malformed (too few frames, frame 0
    not 8 bytes, frame 1 not 16 bytes, chunks alongside a seq that has none)."""
    if len(frames) < 2:
        raise ValueError(f"a snapshot reply has at least 2 frames, not {len(frames)}")
    if len(frames[0]) != 8 or len(frames[1]) != PUBLISHER_ID_BYTES:
        raise ValueError("a snapshot reply starts with an 8-byte seq and a 16-byte publisher_id")
    seq = int.from_bytes(frames[0], "big", signed=True)
    if seq < 0 and len(frames) > 2:
        raise ValueError(f"a snapshot reply with seq {seq} carries {len(frames) - 2} chunk(s)")
    return seq, bytes(frames[1])
