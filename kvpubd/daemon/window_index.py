"""The index of a sliding-window KV cache group: chain digest -> block, with no tree.

A sliding-window group frees the blocks that fall out of a request's window while the later
ones stay in use, so, unlike the radix index, any unpinned block may be evicted: a cached
block's chain parent may be gone (as in vLLM's block pool, whose free queue holds any block
no request references). A block keeps its chain parent's digest, so that a snapshot repeats
the ``parent_block_hash`` its store was published with.

Per-block fields live in lists indexed by block id, sized to the pool once (see radix.py); the
digest map and the eviction queue are tables no operation rebuilds at once (block_tables.py).
"""

from __future__ import annotations

from typing import Any

from kvpubd.daemon.block_tables import DigestDict, LruQueue


class WindowIndex:
    def __init__(self, capacity: int) -> None:
        self._block_of: DigestDict[int] = DigestDict()
        self.digest: list[bytes] = [b""] * capacity
        self.parent_digest: list[bytes | None] = [None] * capacity
        self.keys: list[Any] = [None] * capacity
        self._refs: list[int] = [0] * capacity
        # Unpinned blocks, least recently used first.
        self._evictable = LruQueue(capacity)

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def unpinned(self) -> int:
        return len(self._evictable)

    def locate(self, digests: list[bytes]) -> list[int | None]:
        """The cached block of each digest, None where there is none."""
        return self._block_of.get_many(digests)

    def count_unpinned(self, block_ids: list[int]) -> int:
        return list(map(self._refs.__getitem__, block_ids)).count(0)

    def pin(self, block_ids: list[int]) -> None:
        refs, evictable = self._refs, self._evictable
        for block_id in block_ids:
            if refs[block_id] == 0:
                evictable.discard(block_id)
            refs[block_id] += 1

    def unpin(self, block_ids: list[int]) -> None:
        # Deepest first, as vLLM frees a request's blocks (the tail is evicted first).
        refs, evictable = self._refs, self._evictable
        for block_id in reversed(block_ids):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                evictable.push(block_id)

    def insert_run(
        self, digests: list[bytes], block_ids: list[int], parent: bytes | None, keys: Any
    ) -> None:
        """Add consecutive blocks of a chain, the first under the block of digest ``parent``
        (cached or not; None for a prompt's first block); each starts pinned once."""
        if len(digests) != len(block_ids):
            raise ValueError("one digest per block id")
        self._block_of.assign(digests, block_ids)
        digest_of, parent_of, keys_of, refs = self.digest, self.parent_digest, self.keys, self._refs
        above = parent
        for block_id, digest in zip(block_ids, digests, strict=True):
            digest_of[block_id] = digest
            parent_of[block_id] = above
            keys_of[block_id] = keys
            refs[block_id] = 1
            above = digest

    def evict(self, count: int) -> list[int]:
        """Remove the ``count`` least recently used unpinned blocks; their ``digest`` slots stay
        readable until the block id is reused."""
        pop_oldest, digest_of = self._evictable.pop_oldest, self.digest
        evicted = [pop_oldest() for _ in range(count)]
        self._block_of.pop_many(list(map(digest_of.__getitem__, evicted)))
        return evicted

    def clear(self) -> tuple[DigestDict[int]]:
        """Empty the index in O(1); returns the old digest map for the caller to free later."""
        old = self._block_of
        self._block_of = DigestDict()
        self._evictable.clear()
        return (old,)
