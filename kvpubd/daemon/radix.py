"""A pure-Python radix index over the block hash chain.

A block's chain digest encodes its whole prefix, so the tree is walked with one dict lookup per
block. Nodes are pool block ids: per-block fields live in lists indexed by block id, sized to
the pool once. That keeps inserts cheap (no object per block), keeps the cyclic garbage
collector out of it (a dict of bytes -> int is not tracked), and makes clearing O(1): only the
digest map is replaced and the eviction queue emptied; stale list slots are overwritten on reuse.
Neither of those is one hash table (see block_tables.py): none is rebuilt at once.

Only unpinned leaves are evictable, so every cached block's parent stays cached, and eviction
runs tail-first in least-recently-used order.
"""

from __future__ import annotations

from typing import Any

from kvpubd.daemon.block_tables import DigestDict, LruQueue

ROOT = -1  # parent of a first block


class RadixIndex:
    def __init__(self, capacity: int) -> None:
        self._block_of: DigestDict[int] = DigestDict()
        self.digest: list[bytes] = [b""] * capacity
        self.parent: list[int] = [ROOT] * capacity
        # What each block's store mixed into its identity (LoRA, salt), exactly as published:
        # one shared object per store, kept so that a snapshot repeats the stream.
        self.keys: list[Any] = [None] * capacity
        self._children: list[int] = [0] * capacity
        self._refs: list[int] = [0] * capacity
        # Unpinned leaves, oldest first.
        self._evictable = LruQueue(capacity)
        self._unpinned = 0

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def unpinned(self) -> int:
        """Cached blocks no request holds: all of them can be evicted, leaves first."""
        return self._unpinned

    def refs(self, block_id: int) -> int:
        return self._refs[block_id]

    def match(self, digests: list[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix of ``digests``."""
        return self._block_of.found_prefix(digests)

    def count_unpinned(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` no request pins (in C: no bytecode per block)."""
        return list(map(self._refs.__getitem__, block_ids)).count(0)

    def pin(self, block_ids: list[int]) -> None:
        refs = self._refs
        evictable = self._evictable
        for block_id in block_ids:
            if refs[block_id] == 0:
                self._unpinned -= 1
                evictable.discard(block_id)
            refs[block_id] += 1

    def unpin(self, block_ids: list[int]) -> None:
        # Deepest first, so a released chain is evicted tail-first.
        refs = self._refs
        children = self._children
        evictable = self._evictable
        for block_id in reversed(block_ids):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                self._unpinned += 1
                if children[block_id] == 0:
                    evictable.push(block_id)

    def insert_run(
        self,
        digests: list[bytes],
        block_ids: list[int],
        parent: int,
        keys: Any,
    ) -> None:
        """Add a chain of blocks under ``parent`` (ROOT or a block the caller holds pinned);
        each starts pinned once."""
        count = len(block_ids)
        if len(digests) != count:
            raise ValueError("one digest per block id")
        if not count:
            return
        # One loop writing every field and the digest map (DigestDict's part inline): about
        # 0.8k instructions a block, where a map over each list's __setitem__ (a slot
        # wrapper: a call with an argument tuple per item) cost 3k. The chain's parents are
        # the parent, then each block in turn.
        shards, digest_of, parent_of = self._block_of.shards, self.digest, self.parent
        keys_of, children, refs = self.keys, self._children, self._refs
        above = parent
        for block_id, digest in zip(block_ids, digests, strict=True):
            shards[digest[-1]][digest] = block_id
            digest_of[block_id] = digest
            parent_of[block_id] = above
            keys_of[block_id] = keys
            children[block_id] = 1
            refs[block_id] = 1
            above = block_id
        children[above] = 0
        if parent != ROOT:
            children[parent] += 1

    def evict(self, count: int) -> list[int]:
        """Remove ``count`` least-recently-used unpinned leaves (a parent left childless becomes
        the next); their ``digest`` slots stay readable until the block id is reused."""
        evictable = self._evictable
        shards, digest_of, parent_of = self._block_of.shards, self.digest, self.parent
        children, refs = self._children, self._refs
        evicted: list[int] = []
        append = evicted.append
        while len(evicted) < count:
            block_id = evictable.pop_oldest()
            while True:
                digest = digest_of[block_id]
                del shards[digest[-1]][digest]  # DigestDict's part, inline: per block
                append(block_id)
                parent = parent_of[block_id]
                if parent == ROOT:
                    break
                children[parent] -= 1
                if children[parent] or refs[parent]:
                    break
                if len(evicted) == count:
                    # The parent is now the least recently used leaf: first in line.
                    evictable.push_oldest(parent)
                    break
                # It would be popped next anyway: evict it without queueing it.
                block_id = parent
        self._unpinned -= count
        return evicted

    def clear(self) -> tuple[DigestDict[int]]:
        """Empty the index in O(1); returns the old digest map so that the caller can free it
        later (one deallocation per block)."""
        old = self._block_of
        self._block_of = DigestDict()
        self._evictable.clear()
        self._unpinned = 0
        return (old,)
