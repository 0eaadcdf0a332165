"""A hybrid model's KV cache groups at the cache, without sockets: what each group holds, the
prefix a store may skip, and the events, checked by a reader that keeps what the events say
per group, as vLLM documents them ("store events carry cache-spec metadata so consumers can
classify and filter groups as they are learned; remove events only need group_idx + hash").

The prefix every group can serve is computed here from that reader's state alone, by vLLM's
rules (a full-attention group serves the blocks it holds from the first; a sliding-window
group the prefixes whose last ``cdiv(window - 1, block_size)`` blocks it holds), and must be
what the store's reply says was cached."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from kvpubd.daemon.cache import CacheError, RankCache
from kvpubd.daemon.groups import pool_group_tag
from kvpubd.daemon.kernels import gpu_available
from kvpubd.daemon.settings import CacheConfig
from kvpubd.daemon.sink import EventSink
from kvpubd.protocol.control import GroupBlocks, Store, int_list
from kvpubd.protocol.hashing import TOKEN_DTYPE
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

BS = 4
WINDOW = 9  # tokens: a hit needs cdiv(8, 4) = 2 blocks before its end
WINDOW_BLOCKS = 2


class GroupReader:
    """Per group: the kind learned from its stores and the blocks the events say it holds."""

    def __init__(self) -> None:
        self.kinds: dict[int, tuple[str | None, int | None]] = {}
        self.blocks: dict[int, set[BlockHash]] = {}

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                assert event.group_idx is not None
                self.kinds[event.group_idx] = (
                    event.kv_cache_spec_kind,
                    event.kv_cache_spec_sliding_window,
                )
                held = self.blocks.setdefault(event.group_idx, set())
                assert not held.intersection(event.block_hashes), "stored twice"
                held.update(event.block_hashes)
                # Dense: Dynamo and llm-d hash token_ids a block at a time.
                assert len(event.token_ids) == len(event.block_hashes) * BS
            elif isinstance(event, BlockRemoved):
                assert event.group_idx is not None
                held = self.blocks.setdefault(event.group_idx, set())
                assert held.issuperset(event.block_hashes), "removed what it never held"
                held.difference_update(event.block_hashes)

    def hit(self, hashes: list[BlockHash]) -> int:
        """The prefix (in blocks) every group can serve, by vLLM's rules."""
        if not self.kinds:
            return 0  # nothing stored yet
        hit = len(hashes)
        while True:
            shortest = min(self._group_hit(group, hashes, hit) for group in self.kinds)
            if shortest == hit:
                return hit
            hit = shortest

    def _group_hit(self, group: int, hashes: list[BlockHash], limit: int) -> int:
        _, window = self.kinds[group]
        held = [h in self.blocks.get(group, set()) for h in hashes[:limit]]
        if window is None:
            return held.index(False) if False in held else limit
        needed = -(-(window - 1) // BS)
        for end in range(limit, 0, -1):
            if end >= needed and all(held[end - needed : end]):
                return end
        return held.index(False) if False in held else limit


def hybrid_config(num_blocks: int, window_blocks: int, **extra: object) -> CacheConfig:
    return CacheConfig(
        num_blocks=num_blocks,
        block_size=BS,
        num_kv_heads=1,
        head_dim=8,
        groups=[
            {"kind": "full_attention", "layers": [0, 2]},
            {
                "kind": "sliding_window",
                "sliding_window": WINDOW,
                "layers": [1, 3],
                "num_blocks": window_blocks,
            },
        ],
        **extra,
    )


# Three groups, the window first: the pool's group (the first full-attention one) is group 1,
# and the MLA group is a second tree index with a pool of its own size.
THREE_GROUPS = [
    {"kind": "sliding_window", "sliding_window": WINDOW, "layers": [0], "num_blocks": 20},
    {"kind": "full_attention", "layers": [1]},
    {"kind": "mla_attention", "layers": [2], "num_blocks": 30, "head_dim": 4},
]
# And a second window, longer and in a smaller pool: each window caps the other's prefix (the
# common prefix takes more than one pass to find).
FOUR_GROUPS = [
    *THREE_GROUPS,
    {"kind": "sliding_window_mla", "sliding_window": 17, "layers": [3], "num_blocks": 16},
]


class Hybrid:
    def __init__(
        self, num_blocks: int = 64, window_blocks: int = 64, groups: list[Any] | None = None
    ) -> None:
        config = hybrid_config(num_blocks, window_blocks)
        if groups is not None:
            config = config.model_copy(update={"groups": CacheConfig(groups=groups).groups})
        self.sink = EventSink(
            block_size=BS, medium="GPU", max_events_per_tick=1 << 30, group=pool_group_tag(config)
        )
        self.cache = RankCache(config, self.sink, "u64")
        self.reader = GroupReader()
        self.events: list[Event] = []

    def drain(self) -> list[Event]:
        events = self.sink.drain(new_tick=True)
        self.reader.apply(events)
        self.events += events
        return events

    def store(self, request_id: str, tokens: list[int]) -> tuple[int, list[GroupBlocks]]:
        request = Store(request_id=request_id, token_ids=int_list(tokens))
        _, cached, groups = self.cache.store(request, np.asarray(tokens, dtype=TOKEN_DTYPE))
        self.drain()
        assert groups is not None
        return cached, groups

    def release(self, request_id: str) -> None:
        lease = self.cache.end_lease(request_id)
        for group, blocks in lease.parts():
            self.cache.unpin(blocks, group)
        self.drain()

    def chain(self, tokens: list[int]) -> list[BlockHash]:
        """The prompt's block hashes as published (the shared chain of every group)."""
        from kvpubd.protocol.hashing import chain_digests, root_key

        digests = chain_digests(
            np.asarray(tokens, dtype=TOKEN_DTYPE), BS, root_key(None, None, "sha256"), "sha256"
        )
        return self.cache.wire_hash(digests)

    def held(self, position: int) -> dict[int, set[BlockHash]]:
        """What the cache's indexes hold, per group (0: the pool's)."""
        cache = self.cache
        primary = self.sink.pool_lane.tag
        assert primary is not None
        held = {primary.idx: {self.chain_of(cache.index.digest[b]) for b in _cached(cache.index)}}
        for group in cache.groups:
            assert group.spec.idx is not None
            held[group.spec.idx] = {
                self.chain_of(group.index.digest[b]) for b in _cached(group.index)
            }
        return held

    def chain_of(self, digest: bytes) -> BlockHash:
        return self.cache.wire_hash([digest])[0]


def _cached(index: object) -> list[int]:
    return list(index._block_of.values())  # type: ignore[attr-defined]


def test_a_store_publishes_every_group_with_its_kind_and_window() -> None:
    hybrid = Hybrid()
    tokens = list(range(6 * BS + 1))
    cached, groups = hybrid.store("a", tokens)
    assert cached == 0
    stores = [e for e in hybrid.events if isinstance(e, BlockStored)]
    assert [
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stores
    ] == [
        (0, "full_attention", None),
        (1, "sliding_window", WINDOW),
    ]
    hashes = hybrid.chain(tokens)
    assert stores[0].block_hashes == stores[1].block_hashes == hashes  # one chain, two groups
    assert [(g.group_idx, g.start, len(g.block_ids)) for g in groups] == [(0, 0, 7), (1, 0, 7)]
    # A snapshot repeats the group fields of every group's blocks.
    snapshot = hybrid.cache.block_events(groups[0].block_ids[:6])
    snapshot += hybrid.cache.groups[0].block_events(groups[1].block_ids[:6], "GPU")
    assert {
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in snapshot
    } == {
        (0, "full_attention", None),
        (1, "sliding_window", WINDOW),
    }


def test_a_window_group_holds_only_the_window_of_a_cached_prefix() -> None:
    hybrid = Hybrid()
    tokens = list(range(8 * BS))
    hybrid.store("a", tokens)
    hybrid.release("a")
    cached, groups = hybrid.store("b", [*tokens, 7, 7, 7])
    assert cached == 8 * BS
    full, window = groups
    assert (full.start, len(full.block_ids)) == (0, 9)
    # The 8 cached blocks' window is the last 2; the earlier 6 are skipped (vLLM's nulls).
    assert (window.start, len(window.block_ids)) == (8 - WINDOW_BLOCKS, 3)
    pinned = hybrid.cache.groups[0].pinned_blocks
    assert pinned == WINDOW_BLOCKS


def test_the_prefix_is_what_the_window_group_still_serves() -> None:
    # A window group with room for one prompt: the second evicts the first's blocks there,
    # while the full-attention group keeps them.
    hybrid = Hybrid(num_blocks=64, window_blocks=8)
    first = list(range(8 * BS))
    hybrid.store("a", first)
    hybrid.release("a")
    hybrid.store("b", [1000 + t for t in range(6 * BS)])
    hybrid.release("b")
    expected = hybrid.reader.hit(hybrid.chain(first))
    assert expected < 8
    cached, _ = hybrid.store("c", first)
    assert cached == expected * BS
    assert hybrid.reader.blocks == hybrid.held(0)


@pytest.mark.parametrize("layout", ["two", "three", "four"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_stores_releases_and_resets_keep_every_group_exact(seed: int, layout: str) -> None:
    rng = random.Random(seed)
    layouts = {"three": THREE_GROUPS, "four": FOUR_GROUPS}
    hybrid = Hybrid(num_blocks=48, window_blocks=20, groups=layouts.get(layout))
    window_group = 1 if layout == "two" else 0
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 6) * BS)] for _ in range(4)]
    open_requests: list[str] = []
    for step in range(300):
        action = rng.random()
        if action < 0.55:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(12))]
            expected = hybrid.reader.hit(hybrid.chain(tokens))
            try:
                cached, groups = hybrid.store(f"r{step}", tokens)
            except CacheError as exc:
                assert exc.code == "pool_exhausted"
                hybrid.drain()
                continue
            assert cached == expected * BS, step
            assert groups[window_group].start == max(0, expected - WINDOW_BLOCKS)
            open_requests.append(f"r{step}")
        elif action < 0.95 and open_requests:
            hybrid.release(open_requests.pop(rng.randrange(len(open_requests))))
        elif action >= 0.95:
            hybrid.cache.clear()
            hybrid.sink.cleared()
            hybrid.drain()
            open_requests.clear()
        assert {g: b for g, b in hybrid.reader.blocks.items() if b} == {
            g: b for g, b in hybrid.held(0).items() if b
        }, step


def test_configs_that_cannot_be_served_are_refused() -> None:
    with pytest.raises(ValidationError, match="needs its window"):
        CacheConfig(groups=[{"kind": "sliding_window", "layers": [0]}])
    with pytest.raises(ValidationError, match="full-attention kind"):
        CacheConfig(groups=[{"kind": "sliding_window", "sliding_window": 8, "layers": [0]}])
    with pytest.raises(ValidationError, match="layer 1 is in two groups"):
        CacheConfig(
            groups=[
                {"layers": [0, 1]},
                {"kind": "sliding_window", "sliding_window": 8, "layers": [1]},
            ]
        )
    with pytest.raises(ValidationError, match="host_blocks"):
        hybrid_config(16, 16, host_blocks=8)


def test_computed_tokens_let_a_window_group_go_of_what_fell_out_of_its_window() -> None:
    hybrid = Hybrid()
    hybrid.store("a", list(range(8 * BS + 1)))
    window = hybrid.cache.groups[0]
    assert window.pinned_blocks == 8
    # 33 tokens computed: the next token attends to tokens 25.. (a window of 9), which
    # start in block 6; blocks 0-5 fall out (vLLM's remove_skipped_blocks).
    parts = hybrid.cache.let_window_go("a", 8 * BS + 1)
    assert [(group, len(blocks)) for group, blocks in parts] == [(1, 6)]
    for group, blocks in parts:
        hybrid.cache.unpin(blocks, group)
    assert window.pinned_blocks == 2
    assert hybrid.cache.pinned_blocks == 8 + 1  # the full-attention group keeps all (+ tail)
    assert hybrid.cache.let_window_go("a", 8 * BS + 1) == []  # let go once
    hybrid.release("a")
    assert window.pinned_blocks == 0 and hybrid.cache.pinned_blocks == 0
    # They stay cached: the prompt's last window still serves it.
    cached, _ = hybrid.store("b", list(range(8 * BS)))
    assert cached == 8 * BS


@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and CuPy")
def test_every_group_has_a_pool_of_its_own_geometry_on_the_gpu() -> None:
    config = hybrid_config(64, 32, device="cuda:0")
    sink = EventSink(
        block_size=BS, medium="GPU", max_events_per_tick=1 << 30, group=pool_group_tag(config)
    )
    cache = RankCache(config, sink, "u64")
    try:
        specs = config.group_specs()
        window = cache.groups[0]
        assert (cache.pool.num_blocks, cache.pool.block_bytes) == (64, specs[0].block_bytes)
        assert (window.pool.num_blocks, window.pool.block_bytes) == (32, specs[1].block_bytes)
        assert window.pool.info(0).kind == "cuda_ipc"
        request = Store(request_id="a", token_ids=int_list(range(8 * BS + 1)))
        _, cached, groups = cache.store(request, np.arange(8 * BS + 1, dtype=TOKEN_DTYPE))
        assert cached == 0 and groups is not None
        assert [len(g.block_ids) for g in groups] == [9, 9]
    finally:
        cache.close()


def test_the_common_prefix_is_found_when_each_window_caps_the_other() -> None:
    # Windows of 2 and 4 blocks over a 10-block prompt the full-attention group holds whole:
    # the short window holds blocks 0-5 and 8-9 (it serves 10), the long one 0-7 (it serves
    # 8). At 8 the short window lacks blocks 6-7 and serves only 6, where the long one holds
    # 2-5: the prefix is 6, which one pass over the groups (8) would miss.
    hybrid = Hybrid(
        groups=[
            {"kind": "full_attention", "layers": [0]},
            {"kind": "sliding_window", "sliding_window": 9, "layers": [1]},
            {"kind": "sliding_window", "sliding_window": 17, "layers": [2]},
        ]
    )
    tokens = np.arange(10 * BS, dtype=TOKEN_DTYPE)
    request = Store(request_id="a", token_ids=int_list(tokens.tolist()))
    plan = hybrid.cache.begin_store(request, tokens, [bytes([i]) * 16 for i in range(10)])
    plan.matched = 10
    short, long = plan.groups
    short.located = [i if i < 6 or i >= 8 else None for i in range(10)]
    long.located = [i if i < 8 else None for i in range(10)]
    plan.located = 10
    hybrid.cache._settle_hit(plan)
    assert plan.hit == 6
    assert (short.start, long.start) == (4, 2)
