"""One rank's KV cache: block pool + radix index + open requests, reporting to its sink.

Every operation validates first and mutates after, so a refused request changes nothing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpubd.daemon.pool import create_pool
from kvpubd.daemon.radix import ROOT, RadixIndex
from kvpubd.daemon.sink import PLAIN, EventSink, StoreKeys, stored_event
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
        if request_id in self.leases:
            raise CacheError("duplicate_request", f"request {request_id!r} is already open")
        size = self.block_size
        index = self.index
        digests = chain_digests(tokens, size, root_key(lora_id, cache_salt))
        keys = (
            PLAIN
            if lora_id is None and lora_name is None and cache_salt is None
            else StoreKeys.of(lora_id, lora_name, cache_salt)
        )
        matched = index.match(digests)
        new_count = len(digests) - len(matched)
        has_tail = len(tokens) % size != 0
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
        shortfall = needed - self.pool.free_count
        if shortfall > 0:
            self._evict(shortfall)
        block_ids = self.pool.allocate(needed)
        new_ids = block_ids[:new_count]
        parent = matched[-1] if matched else ROOT
        if new_count:
            new_digests = digests[len(matched) :]
            index.insert_run(new_digests, new_ids, parent, keys)
            first = len(matched) * size
            new_tokens = tokens[first : first + new_count * size]
            self.tokens[new_ids] = new_tokens.reshape(new_count, size)
            wire_hash = self.wire_hash
            self.sink.stored(
                parent_block=parent if parent != ROOT else None,
                block_ids=new_ids,
                hashes=wire_hash(new_digests),
                parent_hash=wire_hash([index.digest[parent]])[0] if parent != ROOT else None,
                token_ids=new_tokens,
                keys=keys,
            )
        self.leases[request_id] = Lease(
            matched + new_ids, block_ids[new_count] if has_tail else None
        )
        return matched + block_ids, len(matched) * size

    def _evict(self, count: int) -> None:
        evicted = self.index.evict(count)
        digest = self.index.digest
        hashes = self.wire_hash([digest[block_id] for block_id in evicted])
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
