"""The host tier at the cache, without sockets: demotion, promotion, host eviction and both
reset scopes, checked against what the events say.

Two readers follow the events: one takes ``AllBlocksCleared`` for every tier (Dynamo, llm-d),
the other for the pool alone (vLLM's documentation of it). Whatever happens, once the
backlog a reset leaves is published, both must hold exactly what the cache holds, tier by
tier; and the strict ``Mirror`` must accept every event on the way."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest

from kvpubd.client import Mirror
from kvpubd.daemon.cache import RankCache
from kvpubd.daemon.kernels import gpu_available
from kvpubd.daemon.settings import CacheConfig
from kvpubd.daemon.sink import EventSink
from kvpubd.protocol.control import Store, int_list
from kvpubd.protocol.hashing import TOKEN_DTYPE
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

BS = 4
POOL, HOST = "GPU", "CPU"


class Reader:
    """A router's index: the blocks of each medium; ``clears`` the media a marker clears
    (None: all)."""

    def __init__(self, clears: str | None) -> None:
        self.clears = clears
        self.media: dict[str | None, set[BlockHash]] = {POOL: set(), HOST: set()}

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                for medium, blocks in self.media.items():
                    if self.clears is None or medium == self.clears:
                        blocks.clear()
            elif isinstance(event, BlockStored):
                self.media[event.medium].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.media[event.medium].difference_update(event.block_hashes)


class Tiered:
    """A cache with a host tier, its sink, and the readers of everything it published."""

    def __init__(self, num_blocks: int, host_blocks: int) -> None:
        config = CacheConfig(
            num_blocks=num_blocks,
            block_size=BS,
            host_blocks=host_blocks,
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
        )
        self.sink = EventSink(
            block_size=BS, medium=POOL, max_events_per_tick=1 << 30, host_medium=HOST
        )
        self.cache = RankCache(config, self.sink, "u64")
        self.readers = [Reader(None), Reader(POOL)]
        self.mirror = Mirror(host_medium=HOST)
        self.events: list[Event] = []
        self.opened = 0

    def drain(self) -> list[Event]:
        events = self.sink.drain(new_tick=True)
        for reader in self.readers:
            reader.apply(events)
        self.mirror.apply(events)
        self.events += events
        return events

    def store(self, tokens: list[int], request_id: str | None = None) -> tuple[list[int], int]:
        self.opened += 1
        request = Store(request_id=request_id or f"r{self.opened}", token_ids=int_list(tokens))
        ids, cached, _ = self.cache.store(request, np.asarray(tokens, dtype=TOKEN_DTYPE))
        assert isinstance(ids, list)  # a store in one step
        return ids, cached

    def store_released(self, tokens: list[int]) -> tuple[list[int], int]:
        request_id = f"r{self.opened + 1}"
        result = self.store(tokens, request_id)
        lease = self.cache.end_lease(request_id)
        self.cache.unpin(lease.blocks)
        return result

    def truth(self) -> dict[str, set[BlockHash]]:
        cache = self.cache
        host = cache.host
        assert host is not None
        return {
            POOL: set(cache.wire_hash(list(cache.index._block_of))),
            HOST: set(cache.wire_hash(list(host.slot_of))),
        }

    def settle(self) -> None:
        """Publish what resets left, then check both readers and the mirror."""
        while self.cache.publish_backlog(7):
            self.drain()
        self.drain()
        truth = self.truth()
        for reader in self.readers:
            assert reader.media == truth, f"reader clearing {reader.clears or 'all'}"
        assert set(self.mirror.blocks) == truth[POOL]
        assert set(self.mirror.host_blocks) == truth[HOST]

    def close(self) -> None:
        self.cache.close()


@pytest.fixture
def tiered() -> Iterator[Tiered]:
    cache = Tiered(num_blocks=8, host_blocks=6)
    yield cache
    cache.close()


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def hashes_of(
    events: list[Event], kind: type[BlockStored | BlockRemoved], medium: str
) -> list[BlockHash]:
    return [h for e in events if isinstance(e, kind) and e.medium == medium for h in e.block_hashes]


def test_an_evicted_block_is_stored_on_the_host_before_its_removal_from_the_pool(
    tiered: Tiered,
) -> None:
    _first, _ = tiered.store_released(prompt(0, 4))
    tiered.drain()
    tiered.store_released(prompt(1000, 8))  # evicts all four
    events = tiered.drain()
    demoted = hashes_of(events, BlockStored, HOST)
    removed = hashes_of(events, BlockRemoved, POOL)
    assert sorted(demoted) == sorted(removed) and len(demoted) == 4
    host_store = next(
        i for i, e in enumerate(events) if isinstance(e, BlockStored) and e.medium == HOST
    )
    pool_removal = next(
        i for i, e in enumerate(events) if isinstance(e, BlockRemoved) and e.medium == POOL
    )
    assert host_store < pool_removal, "no reader may see the blocks on no tier"
    # One run, parents first, with the prompt's tokens: Dynamo links each to the one before.
    (run,) = [e for e in events if isinstance(e, BlockStored) and e.medium == HOST]
    assert run.parent_block_hash is None and list(run.token_ids) == prompt(0, 4)
    tiered.settle()


def test_a_store_whose_prefix_is_on_the_host_copies_it_back_and_counts_it_cached(
    tiered: Tiered,
) -> None:
    cache = tiered.cache
    ids, _ = tiered.store_released(prompt(0, 4))
    data = np.arange(4 * cache.pool.block_bytes, dtype=np.uint64).astype(np.uint8)
    pool_array = cache.pool._array()  # type: ignore[attr-defined]
    pool_array[ids] = data.reshape(4, -1)
    tiered.store_released(prompt(1000, 8))
    tiered.drain()
    again, cached = tiered.store([*prompt(0, 4), 1, 2])  # a partial tail block too
    assert cached == 4 * BS
    assert np.array_equal(pool_array[again[:4]], data.reshape(4, -1)), "promoted bytes differ"
    events = tiered.drain()
    # Back on the pool and still on the host: no host event names them (the blocks the
    # store evicts go to the host meanwhile, around the held ones).
    promoted = set(cache.wire_hash([cache.index.digest[b] for b in again[:4]]))
    assert promoted <= set(hashes_of(events, BlockStored, POOL))
    host_events = hashes_of(events, BlockStored, HOST) + hashes_of(events, BlockRemoved, HOST)
    assert host_events and not promoted & set(host_events)
    tiered.settle()


def test_the_host_tier_evicts_its_least_recently_used_blocks() -> None:
    tiered = Tiered(num_blocks=4, host_blocks=4)
    try:
        a = tiered.store_released(prompt(0, 4))
        tiered.store_released(prompt(100, 4))  # a to the host
        tiered.store_released(prompt(0, 4))  # a back: b to the host, a used last
        tiered.drain()
        tiered.store_released(prompt(200, 4))  # a to the host again (already there)
        tiered.drain()
        tiered.store_released(prompt(300, 4))  # c to the host: b, the oldest, leaves
        events = tiered.drain()
        assert a
        chain = set(tiered.cache.wire_hash(list(tiered.cache.host.slot_of)))  # type: ignore[union-attr]
        assert len(hashes_of(events, BlockRemoved, HOST)) == 4
        assert not chain & set(hashes_of(events, BlockRemoved, HOST))
        tiered.settle()
    finally:
        tiered.close()


@pytest.mark.parametrize("tier", ["all", "gpu"])
def test_after_a_reset_both_readings_of_the_marker_end_exact(tiered: Tiered, tier: str) -> None:
    tiered.store_released(prompt(0, 4))
    tiered.store_released(prompt(1000, 8))
    tiered.drain()
    host_before = len(tiered.cache.host)  # type: ignore[arg-type]
    tiered.cache.clear(every_tier=tier == "all")
    tiered.sink.cleared(every_tier=tier == "all")
    marker_batch = tiered.drain()
    assert marker_batch == [AllBlocksCleared()], "the marker goes out alone, at once"
    assert len(tiered.cache.host) == (0 if tier == "all" else host_before)  # type: ignore[arg-type]
    tiered.settle()


def test_a_block_stored_again_on_the_host_is_not_removed_by_an_earlier_reset(
    tiered: Tiered,
) -> None:
    tiered.store_released(prompt(0, 4))
    tiered.store_released(prompt(1000, 8))  # prompt 0 on the host
    tiered.drain()
    tiered.cache.clear()
    tiered.sink.cleared()
    tiered.drain()
    # Before any removal is published: prompt 0 goes to the host tier again.
    tiered.store_released(prompt(0, 4))
    tiered.store_released(prompt(2000, 8))
    tiered.drain()
    tiered.settle()
    assert len(tiered.readers[1].media[HOST]) == 4


def test_random_operations_keep_both_readings_exact() -> None:
    rng = random.Random(22)
    tiered = Tiered(num_blocks=24, host_blocks=16)
    try:
        open_requests: list[str] = []
        for step in range(600):
            roll = rng.random()
            if roll < 0.55:
                request_id = f"s{step}"
                tokens = prompt(rng.randrange(6) * 1000, rng.randrange(1, 7))
                tokens += [7] * rng.randrange(BS)
                try:
                    tiered.store(tokens, request_id)
                except Exception as exc:  # pool full of pinned blocks: refused, nothing changed
                    assert getattr(exc, "code", None) == "pool_exhausted", exc
                else:
                    tiered.opened += 1
                    open_requests.append(request_id)
            elif roll < 0.9 and open_requests:
                request_id = open_requests.pop(rng.randrange(len(open_requests)))
                tiered.cache.unpin(tiered.cache.end_lease(request_id).blocks)
            elif roll < 0.95:
                every_tier = rng.random() < 0.5
                tiered.cache.clear(every_tier)
                tiered.sink.cleared(every_tier)
                open_requests.clear()
            else:
                tiered.cache.publish_backlog(rng.randrange(1, 9))
            if rng.random() < 0.3:
                tiered.drain()
            if rng.random() < 0.05:
                tiered.settle()
        tiered.settle()
        counts = {type(e).__name__ + ":" + str(getattr(e, "medium", "")) for e in tiered.events}
        assert {"BlockStored:CPU", "BlockRemoved:CPU", "BlockStored:GPU"} <= counts, counts
    finally:
        tiered.close()


@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a GPU")
def test_a_store_that_only_promotes_waits_for_its_copies_on_the_gpu() -> None:
    """On a GPU the copies run behind the loop's back: a store whose blocks come back from the
    host tier, with nothing evicted and nothing to scrub, still hands its reply a fence (it
    once had none, and was answered before the engine could read the promoted bytes)."""
    config = CacheConfig(
        num_blocks=8,
        block_size=BS,
        host_blocks=8,
        device="cuda:0",
        scrub_on_free=False,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
    )
    sink = EventSink(block_size=BS, medium=POOL, max_events_per_tick=1 << 30, host_medium=HOST)
    cache = RankCache(config, sink, "u64")
    try:
        for number, tokens in enumerate([prompt(0, 4), prompt(1000, 8)]):
            request = Store(request_id=f"r{number}", token_ids=int_list(tokens))
            cache.store(request, np.asarray(tokens, dtype=TOKEN_DTYPE))
            cache.unpin(cache.end_lease(f"r{number}").blocks)
        assert cache.host is not None and len(cache.host) == 4  # prompt 0 on the host
        cache.clear(every_tier=False)
        assert cache.copy_fence() is not None  # the demotions': taken, nothing left over
        again = prompt(0, 4)
        _, cached, _ = cache.store(
            Store(request_id="again", token_ids=int_list(again)),
            np.asarray(again, dtype=TOKEN_DTYPE),
        )
        assert cached == 4 * BS
        fence = cache.copy_fence()
        assert fence is not None, "the promotion's copies are not waited for"
    finally:
        cache.close()
