"""KV-cache event types and their wire encoding (vLLM's format), in one plain place.

Live message: 3 frames ``[topic, seq, payload]``; ``seq`` is 8-byte big-endian and the
payload is the msgpack array ``[ts, events, data_parallel_rank]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgpack

BlockHash = int | bytes
WireFormat = Literal["map", "array"]

END_SEQ = b"\xff" * 8  # reserved: the replay end marker, never a live seq
MAX_SEQ = (1 << 64) - 2


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def pack_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def event_to_wire(event: Event, wire_format: WireFormat) -> Any:
    """The msgpack-ready form of one event: a tagged map (vLLM >= 0.24) or a tagged array."""
    if wire_format == "map":
        if type(event) is BlockStored:
            return {
                "type": "BlockStored",
                "block_hashes": event.block_hashes,
                "parent_block_hash": event.parent_block_hash,
                "token_ids": event.token_ids,
                "block_size": event.block_size,
                "lora_id": event.lora_id,
                "medium": event.medium,
                "lora_name": event.lora_name,
            }
        if type(event) is BlockRemoved:
            return {
                "type": "BlockRemoved",
                "block_hashes": event.block_hashes,
                "medium": event.medium,
            }
        return {"type": "AllBlocksCleared"}
    # Array form: every field in order, the optional tail as nils.
    if type(event) is BlockStored:
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            None,  # extra_keys
            None,  # group_idx
            None,  # kv_cache_spec_kind
            None,  # kv_cache_spec_sliding_window
        ]
    if type(event) is BlockRemoved:
        return ["BlockRemoved", event.block_hashes, event.medium, None]
    return ["AllBlocksCleared"]


def event_from_wire(obj: Any) -> Event:
    """Decode one event in either wire form; raises ValueError on anything else."""
    if isinstance(obj, dict):
        tag = obj.get("type")
        if tag == "BlockStored":
            return BlockStored(
                list(obj["block_hashes"]),
                obj["parent_block_hash"],
                list(obj["token_ids"]),
                obj["block_size"],
                obj.get("lora_id"),
                obj.get("medium"),
                obj.get("lora_name"),
            )
        if tag == "BlockRemoved":
            return BlockRemoved(list(obj["block_hashes"]), obj.get("medium"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    elif isinstance(obj, (list, tuple)) and obj:
        tag = obj[0]
        if tag == "BlockStored":
            hashes, parent, tokens, size, lora_id, medium, lora_name = (
                list(obj[1:8]) + [None] * 7
            )[:7]
            return BlockStored(list(hashes), parent, list(tokens), size, lora_id, medium, lora_name)
        if tag == "BlockRemoved":
            return BlockRemoved(list(obj[1]), obj[2] if len(obj) > 2 else None)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    raise ValueError(f"not a KV-cache event: {obj!r:.80}")


class BatchEncoder:
    """Encodes event batches for one rank; one packer reused for every batch."""

    def __init__(self, wire_format: WireFormat, rank: int) -> None:
        self.wire_format = wire_format
        self.rank = rank
        self._packer = msgpack.Packer(use_bin_type=True)

    def encode(self, ts: float, events: list[Event]) -> bytes:
        fmt = self.wire_format
        return self._packer.pack([ts, [event_to_wire(e, fmt) for e in events], self.rank])


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a payload frame; raises ValueError when it is not a valid batch."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError(f"payload is not msgpack: {exc}") from None
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError("payload is not [ts, events, rank]")
    rank = obj[2] if len(obj) > 2 else None
    return EventBatch(float(obj[0]), [event_from_wire(e) for e in obj[1]], rank)
