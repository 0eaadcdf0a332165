"""One rank's KV cache: block pool + radix index + open requests, reporting to its sink.

Every operation validates first and mutates after, so a refused request changes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpubd.daemon.pool import create_pool
from kvpubd.daemon.radix import ROOT, RadixIndex
from kvpubd.daemon.sink import EventSink, StoreKeys, store_keys, stored_event
from kvpubd.protocol.config import CacheConfig
from kvpubd.protocol.hashing import TOKEN_DTYPE, HashFormat, chain_digests, root_key, wire_hasher
from kvpubd.protocol.wire import BlockStored

RequestId = str | int


class CacheError(Exception):
    """A refused operation; ``code`` is the control protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class Lease:
    """The blocks an open request pins: its full blocks (cached) and its partial tail block."""

    blocks: list[int]
    tail_block: int | None


@dataclass(slots=True)
class StorePlan:
    """A store under way: checked and its prefix pinned, its new blocks inserted so far."""

    request_id: RequestId
    tokens: np.ndarray
    digests: list[bytes]
    keys: StoreKeys  # what the store mixes into its blocks' identity, as published
    matched: list[int]
    has_tail: bool
    generation: int
    last: int  # the block the next inserted run hangs under
    new_ids: list[int] = field(default_factory=list)


class RankCache:
    def __init__(
        self,
        config: CacheConfig,
        sink: EventSink,
        hash_format: HashFormat,
        rank: int = 0,
        pool_name: str | None = None,
    ) -> None:
        self.block_size = config.block_size
        self.pool = create_pool(
            config.device,
            config.num_blocks,
            config.block_bytes,
            config.scrub_on_free,
            rank,
            pool_name,
        )
        self.index = RadixIndex(config.num_blocks)
        # Token ids of each cached block, indexed by block id (kept for snapshots).
        self.tokens = np.zeros((config.num_blocks, config.block_size), dtype=TOKEN_DTYPE)
        self.leases: dict[RequestId, Lease] = {}
        self.sink = sink
        self.wire_hash = wire_hasher(hash_format)
        self.hash_algorithm = config.hash_algorithm
        self.generation = 0  # bumped by every clear

    @property
    def pinned_blocks(self) -> int:
        tails = sum(1 for lease in self.leases.values() if lease.tail_block is not None)
        return len(self.index) - self.index.unpinned + tails

    def store(
        self,
        request_id: RequestId,
        tokens: np.ndarray,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> tuple[list[int], int]:
        """Match the cached prefix, allocate and pin the rest; return (block_ids, cached tokens)."""
        algorithm = self.hash_algorithm
        root = root_key(lora_id, cache_salt, algorithm)
        digests = chain_digests(tokens, self.block_size, root, algorithm)
        plan = self.plan_store(request_id, tokens, digests, lora_id, lora_name, cache_salt)
        self.insert_some(plan, len(digests))
        return self.finish_store(plan)

    def plan_store(
        self,
        request_id: RequestId,
        tokens: np.ndarray,
        digests: list[bytes],
        lora_id: int | None,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> StorePlan:
        """Check that a store can be done and pin its cached prefix; nothing else changes. The
        plan is then carried out by ``insert_some`` (in slices, if the caller wants) and
        ``finish_store``; a ``clear`` in between makes it stale (``plan.stale``)."""
        if request_id in self.leases:
            raise CacheError("duplicate_request", f"request {request_id!r} is already open")
        index = self.index
        matched = index.match(digests)
        new_count = len(digests) - len(matched)
        has_tail = len(tokens) % self.block_size != 0
        needed = new_count + has_tail
        reusable = index.unpinned - sum(1 for block in matched if index.refs(block) == 0)
        available = self.pool.free_count + reusable
        if needed > available:
            raise CacheError(
                "pool_exhausted",
                f"request needs {needed} blocks but only {available} can be freed: "
                f"the other {self.pool.num_blocks - available} are pinned by open requests",
            )
        index.pin(matched)
        return StorePlan(
            request_id,
            tokens,
            digests,
            store_keys(lora_id, lora_name, cache_salt),
            matched,
            has_tail,
            self.generation,
            matched[-1] if matched else ROOT,
        )

    def insert_some(self, plan: StorePlan, limit: int) -> bool:
        """Insert up to ``limit`` more of the plan's new blocks (evicting as needed); True
        once all are in. They are pinned at once, so later slices never evict them."""
        size, index = self.block_size, self.index
        start = len(plan.matched) + len(plan.new_ids)
        digests = plan.digests[start : start + limit]
        if digests:
            shortfall = len(digests) - self.pool.free_count
            if shortfall > 0:
                self._evict(shortfall)
            ids = self.pool.allocate(len(digests))
            index.insert_run(digests, ids, plan.last, plan.keys)
            self.tokens[ids] = plan.tokens[start * size : (start + len(ids)) * size].reshape(
                len(ids), size
            )
            plan.new_ids += ids
            plan.last = ids[-1]
        return len(plan.matched) + len(plan.new_ids) == len(plan.digests)

    def finish_store(self, plan: StorePlan) -> tuple[list[int], int]:
        """Allocate the plan's partial tail block, capture its stored run as one event and open
        its lease; returns (block_ids, cached tokens)."""
        size, index = self.block_size, self.index
        new_ids, matched = plan.new_ids, plan.matched
        if plan.has_tail and self.pool.free_count == 0:
            self._evict(1)
        tail = self.pool.allocate(1) if plan.has_tail else []
        if new_ids:
            parent = matched[-1] if matched else ROOT
            first = len(matched) * size
            new_tokens = plan.tokens[first : first + len(new_ids) * size]
            wire_hash = self.wire_hash
            self.sink.stored(
                parent_block=parent if parent != ROOT else None,
                block_ids=new_ids,
                hashes=wire_hash(plan.digests[len(matched) :]),
                parent_hash=wire_hash([index.digest[parent]])[0] if parent != ROOT else None,
                token_ids=new_tokens,
                keys=plan.keys,
            )
        self.leases[plan.request_id] = Lease(matched + new_ids, tail[0] if tail else None)
        return matched + new_ids + tail, len(matched) * size

    def _evict(self, count: int) -> None:
        evicted = self.index.evict(count)
        digest = self.index.digest
        hashes = self.wire_hash(list(map(digest.__getitem__, evicted)))
        self.sink.removed(evicted, hashes)
        self.pool.free(evicted)

    def release(self, request_id: RequestId) -> int:
        """Unpin an open request's blocks; returns how many it held."""
        lease = self.leases.pop(request_id, None)
        if lease is None:
            raise CacheError("unknown_request", f"request {request_id!r} is not open")
        self.index.unpin(lease.blocks)
        if lease.tail_block is not None:
            self.pool.free([lease.tail_block])
        return len(lease.blocks) + (lease.tail_block is not None)

    def clear(self) -> tuple[object, ...]:
        """Drop every block and open request in O(1). Returns the old containers: freeing
        them costs O(blocks), so the caller hands them to the reaper."""
        self.generation += 1  # store plans in progress are stale now
        old_leases, self.leases = self.leases, {}
        old_index = self.index.clear()
        self.pool.free_all()
        return (old_leases, *old_index)

    def block_events(self, block_ids: list[int]) -> list[BlockStored]:
        """Cached blocks as one-block stores, as a snapshot reports them."""
        size = self.block_size
        medium = self.sink.medium
        index = self.index
        digest, parent_of, keys_of, tokens = index.digest, index.parent, index.keys, self.tokens
        parents = [parent_of[b] for b in block_ids]
        hashes = self.wire_hash([digest[b] for b in block_ids])
        parent_hashes = self.wire_hash([digest[p] for p in parents if p != ROOT])[::-1]
        events = []
        for block_id, block_hash, parent in zip(block_ids, hashes, parents, strict=True):
            events.append(
                stored_event(
                    hashes=[block_hash],
                    parent_hash=parent_hashes.pop() if parent != ROOT else None,
                    token_ids=tokens[block_id].tolist(),
                    block_size=size,
                    medium=medium,
                    keys=keys_of[block_id],
                )
            )
        return events
