"""One rank's KV cache: block pool + radix index + open requests, reporting to its sink.

Every operation validates first and mutates after, so a refused request changes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpubd.daemon.encoded import EncodedArray
from kvpubd.daemon.pool import create_pool, rank_device
from kvpubd.daemon.radix import ROOT, RadixIndex
from kvpubd.daemon.settings import CacheConfig
from kvpubd.daemon.sink import EventSink, StoreKeys, store_keys, stored_event
from kvpubd.protocol.control import Store
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

    @property
    def size(self) -> int:
        return len(self.blocks) + (self.tail_block is not None)


BlockIds = list[int] | EncodedArray
StoreResult = tuple[BlockIds, int]  # the reply's block ids, cached tokens


@dataclass(slots=True)
class StorePlan:
    """A store under way: its cached prefix matched, then pinned, then its new blocks inserted,
    each a slice at a time if the caller wants (``match_some``, ``pin_some``, ``insert_some``);
    ``finish_store`` opens its lease. A ``clear`` in between makes it stale (``generation``).

    Between the slices of one plan nothing but a clear may change which blocks are cached or
    pinned, so its match and room check stay true: the store queue holds the rank's other
    stores and unpinning back meanwhile (a release closing a lease frees only its tail block:
    more room, never less)."""

    request_id: RequestId
    tokens: np.ndarray
    digests: list[bytes]
    keys: StoreKeys  # what the store mixes into its blocks' identity, as published
    has_tail: bool
    generation: int
    blocks: list[int] = field(default_factory=list)  # matched, then inserted: the lease's
    matched: int = 0
    matched_unpinned: int = 0  # of the matched blocks, those no request pinned
    matching: bool = True
    pinned: int = 0
    last: int = ROOT  # the block the next inserted run hangs under
    # A store done in slices encodes its reply's ids a slice at a time (see encoded.py).
    reply_ids: EncodedArray | None = None


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
            rank_device(config, rank),
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
        self.tail_blocks = 0  # open leases' tail blocks: kept, so stats never walk the leases
        self.sink = sink
        self.wire_hash = wire_hasher(hash_format)
        self.hash_algorithm = config.hash_algorithm
        self.generation = 0  # bumped by every clear

    @property
    def pinned_blocks(self) -> int:
        return len(self.index) - self.index.unpinned + self.tail_blocks

    def store(self, request: Store, tokens: np.ndarray) -> StoreResult:
        """Match the cached prefix, allocate and pin the rest, in one step (``tokens``: the
        request's, decoded)."""
        algorithm = self.hash_algorithm
        root = root_key(request.lora_id, request.cache_salt, algorithm)
        digests = chain_digests(tokens, self.block_size, root, algorithm)
        plan = self.begin_store(request, tokens, digests)
        everything = len(digests)
        self.match_some(plan, everything)
        self.check_room(plan)
        self.pin_some(plan, everything)
        self.insert_some(plan, everything)
        return self.finish_store(plan)

    def begin_store(
        self, request: Store, tokens: np.ndarray, digests: list[bytes], in_slices: bool = False
    ) -> StorePlan:
        """A plan for a store; nothing changes yet."""
        request_id = request.request_id
        if request_id in self.leases:
            raise CacheError("duplicate_request", f"request {request_id!r} is already open")
        return StorePlan(
            request_id,
            tokens,
            digests,
            store_keys(request.lora_id, request.lora_name, request.cache_salt),
            len(tokens) % self.block_size != 0,
            self.generation,
            reply_ids=EncodedArray() if in_slices else None,
        )

    def match_some(self, plan: StorePlan, limit: int) -> bool:
        """Match up to ``limit`` more blocks of the cached prefix; True once it is complete."""
        if plan.matching:
            wanted = plan.digests[plan.matched : plan.matched + limit]
            found = self.index.match(wanted)
            if found:
                plan.blocks += found
                plan.matched += len(found)
                plan.last = found[-1]
            plan.matched_unpinned += self.index.count_unpinned(found)
            plan.matching = len(found) == len(wanted) and plan.matched < len(plan.digests)
        return not plan.matching

    def check_room(self, plan: StorePlan) -> None:
        """Refuse (changing nothing) a matched plan whose new blocks cannot be had."""
        needed = len(plan.digests) - plan.matched + plan.has_tail
        available = self.pool.free_count + self.index.unpinned - plan.matched_unpinned
        if needed > available:
            raise CacheError(
                "pool_exhausted",
                f"request needs {needed} blocks but only {available} can be freed: "
                f"the other {self.pool.num_blocks - available} are pinned by open requests",
            )

    def pin_some(self, plan: StorePlan, limit: int) -> bool:
        """Pin up to ``limit`` more of the matched blocks, from the root; True once all are."""
        chunk = plan.blocks[plan.pinned : min(plan.pinned + limit, plan.matched)]
        self.index.pin(chunk)
        plan.pinned += len(chunk)
        if plan.reply_ids is not None:
            plan.reply_ids.extend(chunk)
        return plan.pinned == plan.matched

    def insert_some(self, plan: StorePlan, limit: int) -> bool:
        """Insert up to ``limit`` more of the plan's new blocks (evicting as needed) and
        capture them as one stored run; True once all are in. They are pinned at once, so
        later slices never evict them."""
        size, index = self.block_size, self.index
        start = len(plan.blocks)
        digests = plan.digests[start : start + limit]
        if digests:
            shortfall = len(digests) - self.pool.free_count
            if shortfall > 0:
                self._evict(shortfall)
            ids = self.pool.allocate(len(digests))
            parent = plan.last
            index.insert_run(digests, ids, parent, plan.keys)
            tokens = plan.tokens[start * size : (start + len(ids)) * size]
            self.tokens[ids] = tokens.reshape(len(ids), size)
            wire_hash = self.wire_hash
            self.sink.stored(
                parent_block=parent if parent != ROOT else None,
                block_ids=ids,
                hashes=wire_hash(digests),
                parent_hash=wire_hash([index.digest[parent]])[0] if parent != ROOT else None,
                token_ids=tokens,
                keys=plan.keys,
            )
            plan.blocks += ids
            plan.last = ids[-1]
            if plan.reply_ids is not None:
                plan.reply_ids.extend(ids)
        return len(plan.blocks) == len(plan.digests)

    def finish_store(self, plan: StorePlan) -> StoreResult:
        """Allocate the plan's partial tail block and open its lease; returns (block_ids,
        cached tokens)."""
        if plan.has_tail and self.pool.free_count == 0:
            self._evict(1)
        tail = self.pool.allocate(1) if plan.has_tail else []
        self.leases[plan.request_id] = Lease(plan.blocks, tail[0] if tail else None)
        self.tail_blocks += len(tail)
        cached = plan.matched * self.block_size
        if plan.reply_ids is None:
            return plan.blocks + tail, cached
        plan.reply_ids.extend(tail)
        return plan.reply_ids, cached

    def _evict(self, count: int) -> None:
        evicted = self.index.evict(count)
        digest = self.index.digest
        hashes = self.wire_hash(list(map(digest.__getitem__, evicted)))
        self.sink.removed(evicted, hashes)
        self.pool.free(evicted)

    def end_lease(self, request_id: RequestId) -> Lease:
        """Close an open request and free its tail block; its full blocks stay pinned until
        the caller ``unpin``s them (in slices, deepest first, if it wants)."""
        lease = self.leases.pop(request_id, None)
        if lease is None:
            raise CacheError("unknown_request", f"request {request_id!r} is not open")
        if lease.tail_block is not None:
            self.pool.free([lease.tail_block])
            self.tail_blocks -= 1
        return lease

    def unpin(self, block_ids: list[int]) -> None:
        self.index.unpin(block_ids)

    def clear(self) -> tuple[object, ...]:
        """Drop every block and open request in O(1). Returns the old containers: freeing
        them costs O(blocks), so the caller hands them to the reaper."""
        self.generation += 1  # store plans in progress are stale now
        old_leases, self.leases = self.leases, {}
        self.tail_blocks = 0
        old_index = self.index.clear()
        self.pool.free_all()
        return (old_leases, *old_index)

    def block_events(self, block_ids: list[int]) -> list[BlockStored]:
        """Cached blocks as one-block stores, as a snapshot reports them; their token ids are
        views of the cache's rows, valid until the block's slot is reused."""
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
                    # The cache's own row (a view; see snapshot.SnapshotJob._encode).
                    token_ids=tokens[block_id],
                    block_size=size,
                    medium=medium,
                    keys=keys_of[block_id],
                )
            )
        return events
