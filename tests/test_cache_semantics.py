"""Deterministic cache semantics against a real daemon: block ids and prefix matches, what a
store publishes, LRU eviction order, refusals that change nothing, separate LoRA / salt caches,
the capture cap, and the stats counters. Every check reads the real published stream."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvpubd.client import ControlError, Mirror, Received, SnapshotReply, StatsReply
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.streams import reference_chain, vllm_extra_keys

BS = 16  # the test daemon's block_size
MEDIUM = "CPU"  # NumPy pool
CACHE_FIELDS = (
    "blocks_used",
    "blocks_free",
    "blocks_cached",
    "blocks_pinned",
    "blocks_published",
    "requests_open",
    "dropped_stored_blocks",
)

BlockKey = tuple[BlockHash, BlockHash | None, tuple[int, ...], int | None]


def toks(n: int, start: int) -> list[int]:
    """``n`` token ids from ``start``; distinct starts give prompts that share no block."""
    return list(range(start, start + n))


def stored(
    tokens: list[int],
    first: int,
    count: int,
    lora_id: int | None = None,
    salt: str | None = None,
    lora_name: str | None = None,
) -> BlockStored:
    """The BlockStored event expected for blocks ``first .. first+count-1`` of ``tokens``."""
    hashes = reference_chain(tokens, lora_id, salt)
    return BlockStored(
        hashes[first : first + count],
        hashes[first - 1] if first else None,
        tokens[first * BS : (first + count) * BS],
        BS,
        lora_id,
        MEDIUM,
        lora_name,
        extra_keys=vllm_extra_keys(first, count, lora_name, salt),
        cache_salt=salt,
    )


def removed_hashes(events: list[Event]) -> list[BlockHash]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def cache_stats(stats: StatsReply) -> dict[str, int]:
    return {key: getattr(stats.ranks[0], key) for key in CACHE_FIELDS}


class Probe:
    """A control client, a live subscriber and a Mirror of one daemon (rank 0).

    ``sync()`` takes a snapshot (which publishes everything captured), reads the stream up to
    the snapshot's seq and returns the events published since the previous ``sync``; every
    time, the Mirror built from the stream must equal the snapshot."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.client = daemon.client()
        self.sub = daemon.subscriber()
        self.mirror = Mirror(block_size=BS)
        self.next_seq: int = self.client.stats().ranks[0].first_seq
        self.sync()

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sub.close()
        self.client.close()

    def _read_until(self, seq: int, timeout: float = 5.0) -> list[Received]:
        out: list[Received] = []
        deadline = time.monotonic() + timeout
        while (last := self.sub.last_seq()) is None or last < seq:
            if time.monotonic() > deadline:
                raise AssertionError(f"stream did not reach seq {seq}")
            got = self.sub.receive(0.02)
            out.extend(got or self.sub.catch_up())
        return out

    def sync(self) -> list[Event]:
        snap = self.client.snapshot()
        assert snap.epoch == self.daemon.epoch
        events: list[Event] = []
        for got in self._read_until(snap.seq):
            assert got.seq == self.next_seq, "stream seqs must be gap-free"
            self.next_seq += 1
            self.mirror.apply(got.batch.events)
            events.extend(got.batch.events)
        assert self.sub.counters.lost == 0
        assert self.mirror_keys() == self.snapshot_keys(snap)
        return events

    def mirror_keys(self) -> set[BlockKey]:
        return {
            (e.block_hashes[0], e.parent_block_hash, tuple(e.token_ids), e.lora_id)
            for e in self.mirror.blocks.values()
        }

    @staticmethod
    def snapshot_keys(snap: SnapshotReply) -> set[BlockKey]:
        keys = []
        for e in snap.events:
            assert isinstance(e, BlockStored) and len(e.block_hashes) == 1
            keys.append((e.block_hashes[0], e.parent_block_hash, tuple(e.token_ids), e.lora_id))
        assert len(keys) == len(set(keys)), "snapshot repeats a block"
        return set(keys)

    def published_hashes(self) -> set[BlockHash]:
        return set(self.mirror.blocks)

    def cache_stats(self) -> dict[str, int]:
        return cache_stats(self.client.stats())


def expect_error(code: str, call: Any, *args: Any, **kwargs: Any) -> ControlError:
    with pytest.raises(ControlError) as info:
        call(*args, **kwargs)
    assert info.value.code == code, info.value
    return info.value


def test_store_returns_block_ids_and_repeat_store_matches(daemon: Daemon) -> None:
    """A store allocates ceil(len/16) blocks and publishes one BlockStored for the full ones;
    the same prompt again matches every full block (same ids) and publishes nothing."""
    prompt = toks(50, 0)
    with Probe(daemon) as p:
        first = p.client.store("a", prompt)
        assert first.rank == 0 and first.num_cached_tokens == 0
        ids = first.block_ids
        assert len(ids) == 4 and len(set(ids)) == 4
        assert p.sync() == [stored(prompt, 0, 3)]

        p.client.release("a")
        again = p.client.store("b", prompt)
        assert again.num_cached_tokens == 3 * BS
        assert len(again.block_ids) == 4 and again.block_ids[:3] == ids[:3]
        # while "b" is open, a third store shares the full blocks but owns its own tail
        shared = p.client.store("c", prompt)
        assert shared.num_cached_tokens == 3 * BS and shared.block_ids[:3] == ids[:3]
        assert shared.block_ids[3] != again.block_ids[3]
        assert p.sync() == []


def test_short_prompt_publishes_nothing(daemon: Daemon) -> None:
    """A prompt shorter than one block pins a tail block but publishes no event; an exact
    block publishes exactly that block."""
    with Probe(daemon) as p:
        reply = p.client.store("short", toks(15, 0))
        assert len(reply.block_ids) == 1 and reply.num_cached_tokens == 0
        assert p.sync() == []
        assert p.cache_stats()["blocks_cached"] == 0

        exact = toks(BS, 100)
        reply = p.client.store("exact", exact)
        assert len(reply.block_ids) == 1 and reply.num_cached_tokens == 0
        assert p.sync() == [stored(exact, 0, 1)]


def test_extending_a_cached_prefix_publishes_only_new_blocks(daemon: Daemon) -> None:
    """A store that extends a cached prefix publishes one BlockStored holding only the new
    full blocks, whose parent is the last cached block's hash."""
    base = toks(32, 0)
    longer = base + toks(40, 500)  # 4 full blocks + 8-token tail
    diverged = base[:BS] + toks(56, 900)  # shares only block 0
    with Probe(daemon) as p:
        p.client.store("base", base)
        assert p.sync() == [stored(base, 0, 2)]

        reply = p.client.store("longer", longer)
        assert reply.num_cached_tokens == 2 * BS and len(reply.block_ids) == 5
        assert p.sync() == [stored(longer, 2, 2)]
        assert stored(longer, 2, 2).parent_block_hash == reference_chain(base)[-1]

        reply = p.client.store("diverged", diverged)
        assert reply.num_cached_tokens == BS
        assert p.sync() == [stored(diverged, 1, 3)]


def test_lru_evicts_oldest_released_chain_tail_first(start_daemon: DaemonFactory) -> None:
    """When the pool is full, the least recently released chain is evicted tail-first, pinned
    blocks never are, and the removals precede the new store in stream order."""
    daemon = start_daemon(cache={"num_blocks": 8})
    pinned, a, b = toks(BS, 3000), toks(3 * BS, 1000), toks(3 * BS, 2000)
    c, d = toks(3 * BS, 4000), toks(2 * BS, 5000)
    ha, hb, hp = reference_chain(a), reference_chain(b), reference_chain(pinned)
    with Probe(daemon) as p:
        p.client.store("pinned", pinned)
        p.client.store("a", a)
        p.client.store("b", b)
        p.sync()
        p.client.release("a")
        p.client.release("b")

        p.client.store("c", c)  # 1 block free: evicts 2
        events = p.sync()
        assert removed_hashes(events) == [ha[2], ha[1]]
        last_removal = max(i for i, e in enumerate(events) if isinstance(e, BlockRemoved))
        assert events[last_removal + 1 :] == [stored(c, 0, 3)]

        p.client.store("d", d)  # 0 free: a's root goes first, then b's tail
        events = p.sync()
        assert removed_hashes(events) == [ha[0], hb[2]]
        assert events.index(stored(d, 0, 2)) > max(
            i for i, e in enumerate(events) if isinstance(e, BlockRemoved)
        )
        assert p.published_hashes() == {
            hp[0],
            hb[0],
            hb[1],
            *reference_chain(c),
            *reference_chain(d),
        }


def test_matching_a_released_chain_refreshes_its_recency(start_daemon: DaemonFactory) -> None:
    """Re-using a released chain makes it the most recently used: the other one is evicted."""
    daemon = start_daemon(cache={"num_blocks": 6})
    a, b, c = toks(2 * BS, 0), toks(2 * BS, 100), toks(4 * BS, 200)
    with Probe(daemon) as p:
        p.client.store("a", a)
        p.client.store("b", b)
        p.client.release("a")
        p.client.release("b")
        assert p.client.store("a2", a).num_cached_tokens == 2 * BS
        p.client.release("a2")
        p.sync()

        p.client.store("c", c)  # 2 free: evicts 2 of b, none of a
        events = p.sync()
        assert removed_hashes(events) == reference_chain(b)[::-1]
        assert p.published_hashes() == {*reference_chain(a), *reference_chain(c)}


def test_pool_exhausted_changes_nothing(start_daemon: DaemonFactory) -> None:
    """A store that cannot be satisfied because open requests pin the pool answers
    pool_exhausted with a clear message, publishes nothing, evicts nothing and opens nothing."""
    daemon = start_daemon(cache={"num_blocks": 8})
    p1, p2 = toks(5 * BS, 0), toks(2 * BS + 8, 1000)  # 5 blocks; 2 blocks + tail
    with Probe(daemon) as p:
        p.client.store("p1", p1)
        p.client.store("p2", p2)
        p.sync()
        before = p.cache_stats()
        assert before["blocks_pinned"] == 8 and before["blocks_free"] == 0

        err = expect_error("pool_exhausted", p.client.store, "x", toks(BS, 5000))
        assert "pinned" in err.message and "1" in err.message
        assert p.cache_stats() == before
        assert p.sync() == []
        expect_error("unknown_request", p.client.release, "x")

        # a prefix of a pinned prompt needs no new block: it fits even in a full pool
        reply = p.client.store("p1-prefix", p1[: 3 * BS])
        assert reply.num_cached_tokens == 3 * BS
        p.client.release("p1-prefix")

        p.client.release("p2")  # 2 cached unpinned blocks + 1 free tail
        before = p.cache_stats()
        assert before["blocks_free"] == 1 and before["blocks_pinned"] == 5
        expect_error("pool_exhausted", p.client.store, "y", toks(4 * BS, 6000))
        assert p.cache_stats() == before
        assert p.sync() == [], "a refused store must not evict"
        assert set(reference_chain(p2)) <= p.published_hashes()

        p.client.store("z", toks(3 * BS, 7000))
        assert removed_hashes(p.sync()) == reference_chain(p2)[::-1]


def test_duplicate_and_unknown_request_ids(daemon: Daemon) -> None:
    """An open request id cannot be stored again; releasing an id that is not open fails; both
    refusals change nothing."""
    with Probe(daemon) as p:
        p.client.store("r1", toks(40, 0))
        p.sync()
        before = p.cache_stats()
        expect_error("duplicate_request", p.client.store, "r1", toks(40, 100))
        assert p.cache_stats() == before
        assert p.sync() == []

        expect_error("unknown_request", p.client.release, "never-opened")
        p.client.release("r1")
        expect_error("unknown_request", p.client.release, "r1")
        assert p.cache_stats()["requests_open"] == 0
        assert p.client.store("r1", toks(40, 0)).num_cached_tokens == 2 * BS


def test_lora_and_cache_salt_keep_separate_caches(daemon: Daemon) -> None:
    """The same tokens under another LoRA id or cache salt hash differently and never match."""
    prompt = toks(2 * BS, 0)
    variants = [(None, None), (1, None), (2, None), (None, "a"), (None, "b"), (1, "a")]
    with Probe(daemon) as p:
        seen_ids: set[int] = set()
        for i, (lora, salt) in enumerate(variants):
            name = None if lora is None else f"adapter-{lora}"
            reply = p.client.store(f"r{i}", prompt, lora_id=lora, lora_name=name, cache_salt=salt)
            assert reply.num_cached_tokens == 0
            assert seen_ids.isdisjoint(reply.block_ids)
            seen_ids.update(reply.block_ids)
        expected = [
            stored(prompt, 0, 2, lora, salt, None if lora is None else f"adapter-{lora}")
            for lora, salt in variants
        ]
        assert p.sync() == expected
        assert len({h for e in expected for h in e.block_hashes}) == 2 * len(variants)

        again = p.client.store("again", prompt, lora_id=1, cache_salt="a")
        assert again.num_cached_tokens == 2 * BS
        assert p.sync() == []


def next_tick(p: Probe) -> None:
    """Resume until a periodic drain has taken the pending events (a drain starts a fresh
    capture budget; snapshots do not), then pause again."""
    assert p.client.stats().ranks[0].events_pending > 0
    p.client.resume()
    wait_for(lambda: p.client.stats().ranks[0].events_pending == 0, what="a periodic drain")
    p.client.pause()


def test_capture_cap_drops_stores_descendants_and_their_removals(
    start_daemon: DaemonFactory,
) -> None:
    """Over max_events_per_tick the first blocks are published and the rest dropped and
    counted; descendants of dropped blocks are not published even with budget left, nor are
    the dropped blocks' evictions."""
    daemon = start_daemon(cache={"num_blocks": 16}, events={"max_events_per_tick": 4})
    prompt = toks(10 * BS, 0)
    longer = prompt + toks(2 * BS, 5000)
    h = reference_chain(longer)
    fillers = [toks(4 * BS, 10_000 + 1000 * i) for i in range(4)]
    with Probe(daemon) as p:
        p.client.pause()  # one tick until resumed; nothing stored yet, so the budget is full
        p.client.store("r1", prompt)
        next_tick(p)
        assert p.sync() == [stored(prompt, 0, 4)]
        assert p.cache_stats()["dropped_stored_blocks"] == 6

        # a fresh budget of 4, yet the extension of a dropped block is not published
        assert p.client.store("r2", longer).num_cached_tokens == 10 * BS
        assert p.sync() == []
        stats = p.cache_stats()
        assert stats["dropped_stored_blocks"] == 8 and stats["blocks_published"] == 4
        p.client.release("r1")
        p.client.release("r2")

        # 4 free blocks, then 3 rounds of 4 evictions: the 8 dropped blocks go silently
        # (tail-first), then the 4 published ones are removed.
        expected_removed: list[list[BlockHash]] = [[], [], [], h[3::-1]]
        for i, filler in enumerate(fillers):
            p.client.store(f"f{i}", filler)
            next_tick(p)
            events = p.sync()
            assert removed_hashes(events) == expected_removed[i]
            assert [e for e in events if isinstance(e, BlockStored)] == [stored(filler, 0, 4)]
        assert p.published_hashes() == {x for f in fillers for x in reference_chain(f)}
        assert p.cache_stats()["dropped_stored_blocks"] == 8


def test_stats_counters_follow_stores_and_releases(daemon: Daemon) -> None:
    """blocks_used / blocks_free / blocks_pinned / blocks_cached / requests_open stay exact as
    requests share a prefix, release, and reset."""
    a = toks(3 * BS + 2, 0)  # 3 full + tail
    b = a[: 3 * BS] + toks(20, 700)  # shares 3, 1 new full + tail

    def check(used: int, pinned: int, cached: int, published: int, open_: int) -> None:
        stats = p.cache_stats()
        assert stats == {
            "blocks_used": used,
            "blocks_free": 256 - used,
            "blocks_cached": cached,
            "blocks_pinned": pinned,
            "blocks_published": published,
            "requests_open": open_,
            "dropped_stored_blocks": 0,
        }

    with Probe(daemon) as p:
        check(0, 0, 0, 0, 0)
        p.client.store("a", a)
        p.sync()
        check(4, 4, 3, 3, 1)
        p.client.store("b", b)
        p.sync()
        check(6, 6, 4, 4, 2)
        p.client.release("a")
        check(5, 5, 4, 4, 1)
        p.client.release("b")
        check(4, 0, 4, 4, 0)
        p.client.store("c", toks(8, 9000))
        check(5, 1, 4, 4, 1)
        p.client.reset(force=True)
        assert isinstance(p.sync()[-1], AllBlocksCleared)
        check(0, 0, 0, 0, 0)
