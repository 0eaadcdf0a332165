"""The relay of upstream mode without sockets: what an engine's events become in the rank's
sink, and which of them a reset drops (the engine's from before its own clear)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvpubd.daemon.published import ValuedRecord
from kvpubd.daemon.relay import Relay
from kvpubd.daemon.sink import EventSink
from kvpubd.protocol.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvpubd.upstream.flavours import FlavourDecoder, UpstreamPayloadError

BS = 2


def stored(*hashes: int, parent: int | None = None, group: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[h % 1000 for h in hashes for _ in range(BS)],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
    )


def removed(*hashes: int, group: int | None = None) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU", group_idx=group)


class Rank:
    """A relay, its sink, and what it handed the reaper."""

    def __init__(self, flavour: str = "vllm", hash_format: str = "u64", **options: Any) -> None:
        self.sink = EventSink(block_size=BS, medium="GPU", max_events_per_tick=1 << 30)
        self.retired: list[Any] = []
        self.relay = Relay(
            self.sink,
            hash_format,
            self._engine_cleared,
            lambda *containers: self.retired.extend(containers),
            clears_per_block=flavour == "trtllm",
            **options,
        )

    def _engine_cleared(self) -> None:  # what the pipeline does
        self.sink.cleared()
        self.relay.clear()

    def out(self, *events: Event) -> list[Event]:
        self.relay.apply(list(events))
        return self.sink.drain()

    def held(self) -> set[Any]:
        (record,) = self.relay.records
        return {e.block_hashes[0] for e in self.relay.block_events(list(record))}


make = Rank


def test_blocks_stored_again_are_not_repeated_and_unknown_removals_not_published() -> None:
    rank = make()
    assert rank.out(stored(1, 2)) == [stored(1, 2)]
    # vLLM republishes the blocks a prefix hit reuses: only the new one goes out, its parent
    # the block before it.
    assert rank.out(stored(1, 2, 3)) == [stored(3, parent=2)]
    assert rank.out(removed(2, 99)) == [removed(2)]
    assert rank.relay.duplicates == 2 and rank.relay.unknown_removals == 1
    assert rank.held() == {1, 3}


def test_the_same_hash_in_two_groups_is_two_blocks() -> None:
    rank = make()
    rank.out(stored(1, group=0), stored(1, group=1))
    assert rank.out(removed(1, group=1)) == [removed(1, group=1)]
    assert rank.out(removed(1, group=1)) == []  # gone from group 1 only
    assert rank.held() == {1}


def test_signed_engine_hashes_go_out_in_the_configured_format() -> None:
    rank = make()
    (event,) = rank.out(stored(-1))
    assert isinstance(event, BlockStored) and event.block_hashes == [(1 << 64) - 1]
    (event,) = make(hash_format="bytes").out(stored(5))
    assert isinstance(event, BlockStored) and event.block_hashes == [(5).to_bytes(8, "big")]


def test_a_store_whose_tokens_are_not_its_blocks_is_not_kept() -> None:
    rank = make()
    skipping = stored(1, 2)
    skipping.token_ids = [*skipping.token_ids, 7, 7]  # vLLM's window stores skip blocks
    assert rank.out(skipping) == []
    assert rank.relay.non_dense_blocks == 2


def test_past_max_blocks_stores_are_dropped() -> None:
    rank = make(max_blocks=2)
    assert rank.out(stored(1, 2, 3)) == [stored(1, 2)]
    assert rank.relay.over_limit == 1


def test_after_a_reset_the_engines_events_up_to_its_own_clear_are_dropped() -> None:
    rank = make()
    rank.out(stored(1, 2))
    rank.relay.clear(fence=True)  # the pipeline published the marker
    # Flushed at the engine's next step: a store and a removal from before its clear.
    assert rank.out(stored(3, parent=2), removed(1)) == []
    assert rank.out(AllBlocksCleared(), stored(4)) == [stored(4)]
    assert rank.relay.dropped_by_reset == 3 and not rank.relay.fencing
    assert rank.held() == {4}


def test_a_per_block_engine_is_followed_again_once_it_removed_what_it_held() -> None:
    rank = make("trtllm")
    rank.out(stored(1, 2))
    rank.relay.clear(fence=True)
    assert rank.out(stored(3, parent=2), removed(1)) == []
    assert rank.relay.fencing
    assert rank.out(removed(2, 3), stored(5)) == [stored(5)]
    assert rank.held() == {5}


def test_a_fence_ends_after_its_timeout_and_at_an_engine_restart() -> None:
    rank = make(clear_timeout=0.0)
    rank.relay.clear(fence=True)
    assert rank.out(stored(1)) == [stored(1)]  # past the timeout: followed again
    assert rank.relay.fences_timed_out == 1
    rank = make()
    rank.relay.clear(fence=True)
    rank.relay.restart("test")
    assert rank.sink.drain() == [AllBlocksCleared()]
    assert rank.out(stored(1)) == [stored(1)]


def test_a_loss_while_fencing_leaves_the_fence_on() -> None:
    """Batches lost (or seqs that went back) after a reset: the marker again, and the
    engine's events are still dropped up to its clear, which the loss may or may not have
    taken (only a restarted engine, which holds nothing from before, ends the fence)."""
    rank = make()
    rank.out(stored(1, 2))
    rank.relay.clear(fence=True)
    rank.relay.restart("2 engine batch(es) lost", new_engine=False)
    assert rank.sink.drain() == [AllBlocksCleared()]
    assert rank.out(stored(777)) == []  # from before the engine's clear
    assert rank.out(AllBlocksCleared(), stored(888)) == [stored(888)]
    assert rank.held() == {888}


def test_a_second_reset_that_called_the_engine_waits_for_its_second_clear() -> None:
    """Two resets, each calling the engine (reset_url): what the engine stored between its
    two clears is from before the second reset."""
    rank = make()
    rank.out(stored(1))
    rank.relay.clear(fence=True, engine_called=True)
    rank.relay.clear(fence=True, engine_called=True)
    assert rank.out(AllBlocksCleared(), stored(5)) == []
    assert rank.out(AllBlocksCleared(), stored(6)) == [stored(6)]
    # A reset that did not call the engine adds no clear to wait for.
    rank.relay.clear(fence=True, engine_called=True)
    rank.relay.clear(fence=True)
    assert rank.out(AllBlocksCleared(), stored(7)) == [stored(7)]


def test_a_second_reset_leaves_a_per_block_engines_fence_on() -> None:
    """TensorRT-LLM: after two resets back to back, the engine's events are dropped until it
    has removed every block it held at the first."""
    rank = make("trtllm")
    rank.out(stored(1, 2))
    rank.relay.clear(fence=True)
    rank.relay.clear(fence=True)
    assert rank.out(stored(778)) == []  # stored before its reset, still in its queue
    assert rank.relay.fencing
    assert rank.out(removed(1, 2), stored(5)) == [stored(5)]
    assert rank.held() == {5}


def test_an_engine_store_of_many_blocks_goes_out_in_chained_parts() -> None:
    """A store of 2 500 blocks goes out as stores of 1 024 at most, each under the last
    block of the one before, tokens and extra keys with their blocks (it went out whole: a
    batch of a million blocks, against at most 1 024 for kvpubd's own)."""
    rank = make()
    hashes = list(range(1, 2501))
    big = msgspec.structs.replace(stored(*hashes, parent=None), extra_keys=[[h] for h in hashes])
    parts = [p for p in rank.out(big) if isinstance(p, BlockStored)]
    assert [len(p.block_hashes) for p in parts] == [1024, 1024, 452]
    assert [h for p in parts for h in p.block_hashes] == hashes
    assert [p.parent_block_hash for p in parts] == [None, 1024, 2048]
    assert [t for p in parts for t in p.token_ids] == big.token_ids
    assert [k for p in parts for k in p.extra_keys or []] == big.extra_keys
    assert rank.held() == set(hashes)
    # One that cannot be cut (its tokens are not its blocks') is checked whole: skipped.
    uncut = msgspec.structs.replace(stored(*range(5000, 7500)), token_ids=[1, 2, 3])
    assert rank.out(uncut) == []
    assert rank.relay.non_dense_blocks == 2500


def test_stores_no_subscriber_takes_are_not_republished() -> None:
    """A store of no blocks, and a block under a parent of another block size (an engine's
    bug): republished, they made kvpubd's own client refuse the snapshot ("block_size 8 !=
    4") or count a violation and resync."""
    rank = make()
    assert rank.out(stored(1)) == [stored(1)]
    empty = msgspec.structs.replace(stored(), block_size=1 << 62)
    assert rank.out(empty) == []
    wider = msgspec.structs.replace(stored(2, parent=1), block_size=BS * 2, token_ids=[5] * 4)
    assert rank.out(wider) == []
    assert rank.out(stored(3, parent=2)) == []  # nor its children
    assert rank.relay.orphans == 2
    assert rank.held() == {1}


def test_clearing_hands_the_old_containers_to_the_reaper() -> None:
    rank = make()
    rank.out(stored(1, 2))
    rank.relay.clear(fence=True)
    assert len(rank.relay) == 0 and not list(rank.relay.records[0])
    assert any(isinstance(c, ValuedRecord) and len(c) == 2 for c in rank.retired)


def test_a_lora_store_without_its_name_is_published_with_the_name_kvpubd_gives() -> None:
    event = stored(1)
    event.lora_id = 7
    (out,) = make().out(event)
    assert isinstance(out, BlockStored) and (out.lora_id, out.lora_name) == (7, "lora-7")


def test_blocks_under_a_parent_that_is_not_live_are_left_out_but_not_in_window_groups() -> None:
    rank = make()
    rank.out(stored(1, 2))
    rank.relay.restart("test")  # kvpubd forgets; the engine stores on under block 2
    rank.sink.drain()
    assert rank.out(stored(3, 4, parent=2)) == []
    assert rank.out(stored(5, parent=4)) == []  # a descendant: left out too
    assert rank.relay.orphans == 3
    # The chain goes on past a block that is live: what hangs under it is published.
    rank.out(stored(1))
    assert rank.out(stored(1, 6, parent=None)) == [stored(6, parent=1)]
    window = stored(7, parent=99, group=1)
    window.kv_cache_spec_kind, window.kv_cache_spec_sliding_window = "sliding_window", 64
    assert rank.out(window) == [window]


def vllm_stores(*stores: dict[str, Any]) -> list[Event]:
    """vLLM maps (fields given, the rest as vLLM sends them) decoded as the daemon decodes
    them: token ids kept as the engine encoded them."""
    events = [
        {"type": "BlockStored", "parent_block_hash": None, "block_size": BS, "lora_id": None}
        | {"medium": "GPU", "lora_name": None}
        | store
        for store in stores
    ]
    payload = msgspec.msgpack.encode([0.0, events, 0])
    return FlavourDecoder("vllm", tokens_encoded=True).decode(payload).events


def test_a_relayed_store_whose_token_ids_are_not_ints_never_fails_the_relay() -> None:
    """vLLM's token ids are relayed unchecked (only their count): an engine sending strings
    has them relayed as sent, also where kvpubd cuts a store into runs (a block stored again)
    and where a snapshot reads the blocks one by one."""
    rank = make()
    (first,) = vllm_stores({"block_hashes": [1, 2], "token_ids": ["a", "b", "c", "d"]})
    (again,) = vllm_stores({"block_hashes": [1, 2, 3], "token_ids": list("abcdef")})
    assert len(rank.out(first)) == 1
    (run,) = rank.out(again)
    assert isinstance(run, BlockStored)
    assert run.block_hashes == [3] and list[Any](run.token_ids) == list("ef")
    snapshot = {e.block_hashes[0]: e.token_ids for e in rank.relay.block_events([1, 2, 3])}
    expected: dict[Any, Any] = {1: list("ab"), 2: list("cd"), 3: list("ef")}
    assert snapshot == expected


def test_a_store_whose_extra_keys_are_not_one_per_block_is_not_kept() -> None:
    rank = make()
    short = stored(1, 2)
    short.extra_keys = [("lora",)]
    assert rank.out(short) == [] and rank.relay.non_dense_blocks == 2
    assert rank.held() == set()


def test_a_vllm_store_of_blocks_of_no_tokens_is_a_malformed_payload() -> None:
    with pytest.raises(UpstreamPayloadError):
        vllm_stores({"block_hashes": [1], "token_ids": [], "block_size": 0})


def test_token_ids_no_decoder_reads_never_fail_the_relay_either() -> None:
    """A msgpack timestamp of the wrong length, a map keyed by a map: the array is relayed as
    the engine encoded it, and where kvpubd must cut it (a run, a snapshot) its ids are None."""
    bad_timestamp = msgspec.msgpack.encode([msgspec.msgpack.Ext(-1, b"\x00\x00\x00"), 1, 2, 3])
    map_keyed_by_map = bytes([0x94, 0x81, 0x81, 0x01, 0x02, 0x03, 1, 2, 3])
    for tokens in (bad_timestamp, map_keyed_by_map):
        rank = make()
        longer = bytes([0x96]) + tokens[1:] + bytes([4, 5])  # the same, and one block more
        (first,) = vllm_stores({"block_hashes": [1, 2], "token_ids": msgspec.Raw(tokens)})
        (again,) = vllm_stores({"block_hashes": [1, 2, 3], "token_ids": msgspec.Raw(longer)})
        assert len(rank.out(first)) == 1
        (run,) = rank.out(again)
        assert isinstance(run, BlockStored) and run.block_hashes == [3]
        assert list[Any](run.token_ids) == [None, None]
        snapshot = rank.relay.block_events([1, 2, 3])
        assert [e.block_hashes[0] for e in snapshot] == [1, 2, 3]
        assert all(len(e.token_ids) == BS for e in snapshot)


def test_a_snapshot_lists_a_parent_before_its_child_across_media() -> None:
    """A GPU store under a block live only on CPU (offloaded, then evicted from the GPU) is
    kept; a snapshot lists the blocks in publication order across media: the parent first."""
    rank = make()
    offloaded = stored(1)
    offloaded.medium = "CPU"
    rank.out(stored(1), offloaded, removed(1))
    assert len(rank.out(stored(2, parent=1))) == 1
    (record,) = rank.relay.records
    snapshot = rank.relay.block_events(list(record))
    assert [(e.medium, e.block_hashes[0]) for e in snapshot] == [("CPU", 1), ("GPU", 2)]


def test_a_parent_is_converted_to_the_hash_format_even_where_the_hashes_are_not() -> None:
    rank = make()
    rank.out(stored(-5))  # kept as 2**64 - 5
    assert rank.out(stored(7, parent=-5)) == [stored(7, parent=(1 << 64) - 5)]
    assert rank.relay.orphans == 0 and rank.held() == {(1 << 64) - 5, 7}
