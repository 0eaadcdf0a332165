"""The client's Mirror on a hybrid model's stream (``cache.groups``): each KV cache group's
blocks apart (one chain of hashes, told apart by ``group_idx`` alone), each group's kind learned
from its stores, the same strict rules per group, and a parent that must be live only in a
full-attention group. The tracker rebuilds such a mirror from a snapshot that repeats hashes
across groups."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvpubd.client import GroupKind, Mirror, MirrorError
from kvpubd.client.tracker import StreamTracker
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored

BS = 4
FULL: dict[str, Any] = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
WINDOW: dict[str, Any] = {
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 8,
}


def stored(hashes: list[BlockHash], parent: int | None, **group: Any) -> BlockStored:
    tokens = [int(h) % 1000 for h in hashes for _ in range(BS)]
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None, **group)


def removed(hashes: list[BlockHash], group_idx: int | None) -> BlockRemoved:
    return BlockRemoved(hashes, "GPU", group_idx=group_idx)


def test_one_chain_in_two_groups_is_kept_apart() -> None:
    """Both groups store 1..3; the window group lets 1 and 2 go: the full group keeps all
    three, and a group that holds nothing has no entry."""
    mirror = Mirror()
    mirror.apply([stored([1, 2, 3], None, **FULL), stored([1, 2, 3], None, **WINDOW)])
    assert {g: set(b) for g, b in mirror.group_blocks.items()} == {0: {1, 2, 3}, 1: {1, 2, 3}}
    assert mirror.blocks == {}
    mirror.apply([removed([1, 2], 1)])
    assert set(mirror.group(0)) == {1, 2, 3} and set(mirror.group(1)) == {3}
    assert mirror.group(1)[3].kv_cache_spec_sliding_window == 8  # one-block stores, as stored
    assert mirror.group_kinds == {
        0: GroupKind("full_attention", None),
        1: GroupKind("sliding_window", 8),
    }
    mirror.apply([removed([3], 1)])
    assert 1 not in mirror.group_blocks and mirror.group(1) == {}


def test_a_window_store_may_name_a_parent_its_group_let_go() -> None:
    """A window group's store under a block it evicted (or skipped) is applied; the same in the
    full-attention group breaks the stream."""
    mirror = Mirror()
    mirror.apply([stored([1, 2], None, **FULL), stored([1, 2], None, **WINDOW), removed([2], 1)])
    mirror.apply([stored([3], 2, **WINDOW), stored([9], 8, **WINDOW)])
    assert set(mirror.group(1)) == {1, 3, 9}
    mirror.apply([removed([2], 0)])
    with pytest.raises(MirrorError, match="parent 2 is not live in group 0"):
        mirror.apply([stored([3], 2, **FULL)])


@pytest.mark.parametrize(
    "events,match",
    [
        ([stored([1], None, **WINDOW), stored([1], None, **WINDOW)], "repeats live block 1 in"),
        ([stored([1], None, **FULL), removed([1], 1)], "unknown block 1 of group 1"),
        ([stored([1], None, **FULL), removed([1], None)], "unknown block 1$"),
        ([stored([1], None, **FULL), stored([2], None, group_idx=0)], "group 0 is full_attention"),
        (
            [
                stored([1], None, **WINDOW),
                stored([2], None, **{**WINDOW, "kv_cache_spec_sliding_window": 16}),
            ],
            "window 8",
        ),
        ([BlockStored([1], None, [0] * (BS - 1), BS, None, "GPU", None, **WINDOW)], "token_ids"),
    ],
    ids=["repeat", "removal-other-group", "removal-without-group", "kind", "window", "tokens"],
)
def test_each_group_is_held_to_the_stream_rules(events: list[Any], match: str) -> None:
    with pytest.raises(MirrorError, match=match):
        Mirror().apply(events)


def test_a_clear_empties_every_group_and_forgets_their_kinds() -> None:
    """AllBlocksCleared clears every group (vLLM's reset); a restart may bring other groups, so
    their kinds are learned again."""
    mirror = Mirror()
    mirror.apply([stored([1], None, **FULL), stored([1], None, **WINDOW), AllBlocksCleared()])
    assert (mirror.group_blocks, mirror.group_kinds) == ({}, {})
    mirror.apply([stored([1], None, group_idx=1, kv_cache_spec_kind="full_attention")])
    assert mirror.group_kinds == {1: GroupKind("full_attention", None)}


def test_events_without_a_group_are_the_pools() -> None:
    """A stream of a cache without groups fills ``blocks`` as before; ``group(None)`` is it."""
    mirror = Mirror()
    mirror.apply([stored([1, 2], None), removed([1], None)])
    assert set(mirror.blocks) == {2} and mirror.group(None) is mirror.blocks
    assert mirror.group_blocks == {} and mirror.group_kinds == {}


def test_the_tracker_rebuilds_a_hybrid_mirror_from_a_snapshot() -> None:
    """A snapshot lists the same hash once per group that holds it (a window group's block
    under a parent it does not hold included): the tracker's mirror holds each group's."""
    tracker = StreamTracker([0], replay=False, control=True)
    events = [
        stored([1], None, **FULL),
        stored([2], 1, **FULL),
        stored([2], 1, **WINDOW),
    ]
    tracker.on_snapshot(0, {"seq": 5, "epoch": 1, "events": msgspec.to_builtins(events)})
    mirror = tracker.streams[0].mirror
    assert mirror is not None
    assert {g: set(b) for g, b in mirror.group_blocks.items()} == {0: {1, 2}, 1: {2}}
