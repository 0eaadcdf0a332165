"""The checks ``kvpubd bench snapshot`` puts every snapshot reply through: a reply that breaks
the protocol must fail them, one that keeps it must pass (chunks made here by hand)."""

from __future__ import annotations

import msgpack
import pytest

from kvpubd.protocol.wire import AllBlocksCleared, BlockStored, Event, event_to_wire
from kvpubd.tools.snapshot_client import SnapshotMismatch, counted_events, verified_events

RANK = 3


def store(block: int, parent: int | None, blocks: int = 1) -> BlockStored:
    return BlockStored(
        block_hashes=list(range(block, block + blocks)),
        parent_block_hash=parent,
        token_ids=list(range(16 * blocks)),
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name=None,
    )


def chunk(events: list[Event], rank: int = RANK) -> memoryview:
    body = [event_to_wire(event, "map") for event in events]
    return memoryview(msgpack.packb([1.5, body, rank], use_bin_type=True))


def test_a_chain_split_over_chunks_counts_and_verifies() -> None:
    chunks = [chunk([store(1, None), store(2, 1)]), chunk([store(3, 2)]), chunk([])]
    assert counted_events(chunks) == 3
    assert verified_events(chunks, RANK) == 3


@pytest.mark.parametrize(
    ("chunks", "wrong"),
    [
        ([chunk([store(2, 1)]), chunk([store(1, None)])], "before its parent"),
        ([chunk([store(1, None), store(1, None)])], "stored twice"),
        ([chunk([store(1, None, blocks=2)])], "not a one-block store"),
        ([chunk([AllBlocksCleared()])], "not a one-block store"),
        ([chunk([store(1, None)], rank=RANK + 1)], "of rank"),
        ([memoryview(msgpack.packb([1.5, [[1]], RANK]))], "chunk 0"),
    ],
)
def test_a_snapshot_that_breaks_the_protocol_fails_verification(
    chunks: list[memoryview], wrong: str
) -> None:
    with pytest.raises(SnapshotMismatch, match=wrong):
        verified_events(chunks, RANK)


def test_counting_refuses_a_chunk_that_is_no_batch() -> None:
    with pytest.raises(SnapshotMismatch, match="not a"):
        counted_events([memoryview(msgpack.packb([[], RANK]))])
