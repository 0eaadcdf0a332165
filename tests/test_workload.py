"""Randomized workloads (hypothesis) against one real daemon per test.

Each example starts with a forced reset, then runs stores (prompts from a few shared prefixes,
partial tail blocks, optional LoRA id / cache salt), releases, resets, pause/resume and floods
that force evictions. The oracle needs no model of the cache:

- a Mirror built only from the published stream equals the daemon's ``snapshot``, and applying
  the stream raises no MirrorError (removals name live blocks, parents are live, token counts
  are blocks x block_size);
- stream seqs are gap-free and every reset marker ends its batch;
- refusals (pool_exhausted, busy) change nothing, and pool_exhausted only when the pinned
  blocks leave too little room; blocks pinned by open requests keep their ids and stay cached;
- the stats counters agree with the open requests and the snapshot.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpubd.client import ControlError, Mirror, Received
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.streams import reference_chain, seq_of

BS = 16  # the test daemon's block_size
PREFIX_BLOCKS = 10
FAMILIES = [[f * 10_000 + i for i in range(PREFIX_BLOCKS * BS)] for f in range(3)]
CACHE_FIELDS = (
    "blocks_capacity",
    "blocks_used",
    "blocks_free",
    "blocks_cached",
    "blocks_pinned",
    "blocks_published",
    "requests_open",
    "dropped_stored_blocks",
)

BlockKey = tuple[BlockHash, BlockHash | None, tuple[int, ...], int | None]


def common_prefix(a: list[BlockHash], b: list[BlockHash]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Open:
    block_ids: list[int]
    hashes: list[BlockHash]
    has_tail: bool


class Workload:
    """Drives one daemon and checks it; one instance serves every example of a test."""

    def __init__(self, daemon: Daemon, *, capped: bool = False) -> None:
        self.daemon = daemon
        self.capped = capped
        self.client = daemon.client()
        self.sub = daemon.subscriber()
        self.total: int = daemon.settings["cache"]["num_blocks"]
        # The next seq the stream must deliver (gap-free from the run's first).
        self.next_seq: int = self.client.stats().ranks[0].first_seq
        self.ahead: list[Received] = []
        self.markers: set[int] = set()
        self.tokens = itertools.count(1_000_000, BS)  # unique blocks for floods
        self.ids = itertools.count()
        self.open: dict[str | int, Open] = {}
        self.mirror = Mirror(block_size=BS)
        self.example_marker = 0
        self.removals = 0
        self.exhausted = 0
        self.dropped_at_start = 0

    def close(self) -> None:
        self.sub.close()
        self.client.close()

    # -- the stream ---------------------------------------------------------------------

    def read_to(self, seq: int, timeout: float = 5.0) -> None:
        """Apply every batch up to ``seq`` to the Mirror, checking seqs are gap-free. Batches
        are taken one at a time, so a failed check leaves the stream in step for the next
        example."""
        deadline = time.monotonic() + timeout
        while self.next_seq <= seq:
            if not self.ahead:
                if time.monotonic() > deadline:
                    raise AssertionError(f"stream stuck before seq {self.next_seq} (want {seq})")
                self.ahead = self.sub.receive(0.02) or self.sub.catch_up()
                continue
            self.accept(self.ahead.pop(0))
        assert self.sub.counters.lost == 0, "replay could not fill a gap"

    def accept(self, got: Received) -> None:
        expected, self.next_seq = self.next_seq, got.seq + 1
        assert got.seq == expected, f"got seq {got.seq}, expected {expected}"
        events = got.batch.events
        if got.seq in self.markers:
            assert events and isinstance(events[-1], AllBlocksCleared), "marker must end its batch"
        if got.seq < self.example_marker:
            return  # an earlier example's stream
        if got.seq == self.example_marker:
            events = events[-1:]  # this example starts at its marker
        self.removals += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        self.mirror.apply(events)

    def mirror_keys(self) -> set[BlockKey]:
        return {
            (e.block_hashes[0], e.parent_block_hash, tuple(e.token_ids), e.lora_id)
            for e in self.mirror.blocks.values()
        }

    # -- operations -------------------------------------------------------------------

    def cache_stats(self) -> dict[str, int]:
        rank = self.client.stats().ranks[0]
        return {key: getattr(rank, key) for key in CACHE_FIELDS}

    def begin(self) -> None:
        """Isolate an example: resume, force a reset and start a fresh Mirror at its marker."""
        self.client.resume()
        markers = self.client.reset(force=True).markers
        assert [m.rank for m in markers] == [0]
        self.example_marker = seq_of(markers[0])
        self.markers.add(self.example_marker)
        self.open.clear()
        self.mirror = Mirror(block_size=BS)
        self.removals = 0
        self.exhausted = 0
        self.read_to(self.example_marker)
        self.dropped_at_start = self.cache_stats()["dropped_stored_blocks"]

    def store(self, prompt: list[int], lora_id: int | None, salt: str | None) -> str | None:
        """Store a prompt under a fresh request id; None when the pool is exhausted."""
        rid = f"s{next(self.ids)}"
        need = math.ceil(len(prompt) / BS)
        before = self.cache_stats()
        room = self.total - before["blocks_pinned"]
        try:
            reply = self.client.store(rid, prompt, lora_id=lora_id, cache_salt=salt)
        except ControlError as exc:
            assert exc.code == "pool_exhausted", exc
            assert need > room, (
                f"{need} blocks refused though only {before['blocks_pinned']} pinned"
            )
            assert self.cache_stats() == before, "a refused store changed the cache"
            self.exhausted += 1
            return None
        ids, cached = reply.block_ids, reply.num_cached_tokens
        hashes = reference_chain(prompt, lora_id, salt)
        assert len(ids) == need and len(set(ids)) == need
        assert all(0 <= i < self.total for i in ids)
        assert cached % BS == 0 and cached <= len(hashes) * BS
        # Blocks pinned by open requests stay cached under the same ids: a shared prefix with
        # any open request is matched, and a block id names one block hash at a time.
        id_to_hash: dict[int, BlockHash | None] = {}
        hash_to_id: dict[BlockHash, int] = {}
        for other in self.open.values():
            shared = common_prefix(hashes, other.hashes)
            assert cached >= shared * BS, "an open request's pinned prefix was not matched"
            for i, block_id in enumerate(other.block_ids):
                h = other.hashes[i] if i < len(other.hashes) else None  # None: a tail block
                id_to_hash[block_id] = h
                if h is not None:
                    hash_to_id[h] = block_id
        for i, block_id in enumerate(ids):
            h = hashes[i] if i < len(hashes) else None
            if block_id in id_to_hash:
                assert h is not None and id_to_hash[block_id] == h, "block id shared wrongly"
            if h is not None and h in hash_to_id:
                assert hash_to_id[h] == block_id, "pinned block moved"
        self.open[rid] = Open(ids, hashes, len(prompt) % BS != 0)
        assert self.cache_stats()["requests_open"] == before["requests_open"] + 1
        return rid

    def release(self, pick: int) -> None:
        if not self.open:
            with pytest.raises(ControlError) as info:
                self.client.release("nobody")
            assert info.value.code == "unknown_request"
            return
        rid = sorted(self.open, key=str)[pick % len(self.open)]
        held = self.open.pop(rid)
        reply = self.client.release(rid)
        assert reply.released == len(held.block_ids)

    def flood(self, blocks: int) -> None:
        """Store and release ``blocks`` never-seen blocks: forces evictions when the pool is
        full (or pool_exhausted when the pinned blocks leave too little room)."""
        prompt = [next(self.tokens) + j for _ in range(blocks) for j in range(BS)]
        rid = self.store(prompt, None, None)
        if rid is not None:
            held = self.open.pop(rid)
            assert self.client.release(rid).released == len(held.block_ids)

    def reset(self, force: bool) -> None:
        if self.open and not force:
            before = self.cache_stats()
            with pytest.raises(ControlError) as info:
                self.client.reset()
            assert info.value.code == "busy"
            assert self.cache_stats() == before
            return
        markers = self.client.reset(force=force).markers
        self.markers.update(seq_of(m) for m in markers)
        self.open.clear()

    def check(self) -> None:
        """Mirror == snapshot, and the stats agree with the open requests and the snapshot."""
        snap = self.client.snapshot()
        assert snap.epoch == self.daemon.epoch
        self.read_to(snap.seq)
        keys = []
        for e in snap.events:
            assert isinstance(e, BlockStored) and len(e.block_hashes) == 1
            keys.append((e.block_hashes[0], e.parent_block_hash, tuple(e.token_ids), e.lora_id))
        assert len(keys) == len(set(keys)), "snapshot repeats a block"
        assert self.mirror_keys() == set(keys)

        stats = self.cache_stats()
        pinned_full = {h for r in self.open.values() for h in r.hashes}
        tails = sum(r.has_tail for r in self.open.values())
        assert stats["blocks_used"] + stats["blocks_free"] == self.total
        assert stats["requests_open"] == len(self.open)
        assert stats["blocks_pinned"] == len(pinned_full) + tails
        assert stats["blocks_used"] == stats["blocks_cached"] + tails
        assert stats["blocks_published"] == len(keys) <= stats["blocks_cached"]
        if not self.capped:
            assert stats["blocks_published"] == stats["blocks_cached"]
            assert stats["dropped_stored_blocks"] == self.dropped_at_start
            assert pinned_full <= set(self.mirror.blocks), "a pinned block is not cached"

    def run(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "store":
            _, family, cut, tail, lora_id, salt = op
            self.store(FAMILIES[family][:cut] + tail, lora_id, salt)
        elif kind == "release":
            self.release(op[1])
        elif kind == "flood":
            self.flood(op[1])
        elif kind == "reset":
            self.reset(op[1])
        elif kind == "pause":
            assert self.client.pause().paused is True
        elif kind == "resume":
            assert self.client.resume().paused is False
        elif kind == "check":
            self.check()
        else:  # pragma: no cover
            raise AssertionError(op)

    def fill_and_evict(self) -> None:
        """Two floods of every unpinned block: the second evicts the first."""
        while self.open and self.cache_stats()["blocks_pinned"] == self.total:
            self.release(0)  # leave room to flood
        for _ in range(2):
            room = self.total - self.cache_stats()["blocks_pinned"]
            if room:
                self.flood(room)


KINDS = ["store"] * 8 + ["release"] * 4 + ["flood"] * 2 + ["reset", "pause", "resume", "check"]


@st.composite
def operation(draw: st.DrawFn) -> tuple[Any, ...]:
    """One operation; stores dominate so that prefixes are shared and the pool fills."""
    kind = draw(st.sampled_from(KINDS))
    if kind == "store":
        return (
            kind,
            draw(st.integers(0, len(FAMILIES) - 1)),
            draw(st.integers(0, PREFIX_BLOCKS * BS)),
            draw(st.lists(st.integers(0, 2), max_size=40)),
            draw(st.sampled_from([None, None, None, 7])),
            draw(st.sampled_from([None, None, None, "salt"])),
        )
    if kind == "release":
        return (kind, draw(st.integers(0, 1000)))
    if kind == "flood":
        return (kind, draw(st.integers(1, 40)))
    if kind == "reset":
        return (kind, draw(st.booleans()))
    return (kind,)


operations = st.lists(operation(), min_size=20, max_size=60)
workload_settings = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture
def workload(start_daemon: DaemonFactory) -> Iterator[Workload]:
    w = Workload(start_daemon())
    yield w
    w.close()


@pytest.fixture
def tiny_workload(start_daemon: DaemonFactory) -> Iterator[Workload]:
    w = Workload(start_daemon(cache={"num_blocks": 24}))
    yield w
    w.close()


@pytest.fixture
def capped_workload(start_daemon: DaemonFactory) -> Iterator[Workload]:
    w = Workload(start_daemon(events={"max_events_per_tick": 8}), capped=True)
    yield w
    w.close()


@workload_settings
@given(ops=operations)
def test_random_workload_mirror_equals_snapshot(workload: Workload, ops: list[Any]) -> None:
    """Any mix of stores, releases, resets, pauses and evictions publishes a stream whose
    Mirror equals the snapshot, with every invariant held."""
    w = workload
    w.begin()
    for op in ops:
        w.run(op)
    w.fill_and_evict()
    w.check()
    assert w.removals > 0, "the floods must have evicted published blocks"
    assert w.daemon.alive()


@workload_settings
@given(ops=operations)
def test_random_workload_tiny_pool_exhausts_cleanly(
    tiny_workload: Workload, ops: list[Any]
) -> None:
    """With 24 blocks, stores hit pool_exhausted; each refusal changes nothing and the stream
    still mirrors the snapshot."""
    w = tiny_workload
    w.begin()
    for op in ops:
        w.run(op)
    w.fill_and_evict()
    w.check()
    for _ in range(4):  # pin 8 fresh blocks at a time until the pool refuses
        if w.store([next(w.tokens) + j for _ in range(8) for j in range(BS)], None, None) is None:
            break
    assert w.exhausted > 0
    w.check()


@workload_settings
@given(ops=operations)
def test_random_workload_with_capture_cap(capped_workload: Workload, ops: list[Any]) -> None:
    """With max_events_per_tick = 8 and pauses, dropped stores, their descendants and their
    removals stay off the stream, and the Mirror still equals the snapshot."""
    w = capped_workload
    w.begin()
    w.client.pause()
    w.flood(10)  # fresh budget after the reset: 8 published, 2 dropped
    for op in ops:
        w.run(op)
    w.fill_and_evict()
    w.check()
    assert w.cache_stats()["dropped_stored_blocks"] - w.dropped_at_start >= 2
