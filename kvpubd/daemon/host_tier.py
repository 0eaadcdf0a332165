"""The host tier of one rank: blocks evicted from the pool are copied here (demoted) instead of
being dropped, and a store whose prefix is here copies those blocks back (promoted), keeping
the copy here. Blocks leave least recently used first.

Slots are indexed like the pool's blocks: per-slot fields live in lists and arrays sized once,
and clearing is O(1). A slot that a store under way will promote from is held: it is out of
the eviction order until the store let go of it.

What a reset leaves to publish lives here too, published a slice at a time after its marker:

- a reset of every tier: the removal of each block the tier held (readers that take
  ``AllBlocksCleared`` for the pool alone, as vLLM documents it, still hold them);
- a reset of the pool alone: the store of each block the tier still holds (readers that take
  the marker for every tier, as Dynamo and llm-d do, dropped them).

Either list only shrinks by what the tier does meanwhile: a block stored again is no longer
removed, a block evicted (its removal published) or stored again (published) is not
announced.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpubd.daemon.block_tables import DigestDict, LruQueue
from kvpubd.daemon.pool import BlockPool, HostPool
from kvpubd.daemon.tier_copy import TierCopier, create_copier
from kvpubd.protocol.hashing import TOKEN_DTYPE


class HostTier:
    def __init__(
        self,
        capacity: int,
        block_size: int,
        block_bytes: int,
        medium: str,
        primary: BlockPool,
        pool_name: str | None = None,
    ) -> None:
        self.capacity = capacity
        self.medium = medium
        self.pool = HostPool(capacity, block_bytes, scrub_on_free=False, name=pool_name)
        try:
            self.copier: TierCopier = create_copier(primary, self.pool)
        except BaseException:
            self.pool.close()
            raise
        # Neither map nor queue is one hash table, so none is rebuilt at once (block_tables.py).
        self.slot_of: DigestDict[int] = DigestDict()
        self.digest: list[bytes] = [b""] * capacity
        # The chain parent's digest, whichever tier holds it (None: a prompt's first block).
        self.parent_digest: list[bytes | None] = [None] * capacity
        self.keys: list[Any] = [None] * capacity  # the store's StoreKeys, as published
        self.tokens = np.zeros((capacity, block_size), dtype=TOKEN_DTYPE)
        self._stored_in: list[int] = [0] * capacity  # the announce epoch of its store
        self._holds: list[int] = [0] * capacity
        self._lru = LruQueue(capacity)  # live, unheld slots, oldest first
        self._watermark = 0  # slots at and above it were never used since the last clear
        self.generation = 0  # bumped by every clear
        # A reset of the pool alone announces the blocks stored before it: slots below
        # _announce_end not yet scanned, from _announce_next on.
        self._epoch = 0
        self._announce_next = 0
        self._announce_end = 0
        # Blocks of cleared tiers whose removal is still to publish (digest -> old slot).
        self._removals: list[DigestDict[int]] = []

    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def held(self) -> int:
        """Live slots a store under way will promote from."""
        return len(self.slot_of) - len(self._lru)

    def match(self, digests: list[bytes]) -> list[int]:
        """The slots of the longest prefix of ``digests`` held here."""
        if not digests or digests[0] not in self.slot_of:
            return []  # the usual case: no lookup of every block of a new prompt
        found = self.slot_of.get_many(digests)
        if None in found:
            del found[found.index(None) :]
        return found  # type: ignore[return-value]

    def hold(self, slots: list[int]) -> None:
        holds, lru = self._holds, self._lru
        for slot in slots:
            if holds[slot] == 0:
                lru.discard(slot)
            holds[slot] += 1

    def let_go(self, slots: list[int], generation: int) -> None:
        """Undo ``hold`` (made at ``generation``: a clear since let go of everything). A slot
        let go of is the most recently used."""
        if generation != self.generation:
            return
        holds, lru = self._holds, self._lru
        for slot in slots:
            holds[slot] -= 1
            if holds[slot] == 0:
                lru.push(slot)

    def touch(self, slot: int) -> None:
        """The block in ``slot`` was used: last in line for eviction."""
        if self._holds[slot] == 0:
            self._lru.touch(slot)

    def take(self, count: int) -> tuple[list[int], list[int]]:
        """Up to ``count`` slots for new blocks, unused ones first, then by evicting the least
        recently used; returns (slots, the evicted ones among them). An evicted slot's fields
        stay readable until ``fill``. (A slot only leaves by eviction, so no free list.)"""
        fresh = min(count, self.capacity - self._watermark)
        taken = list(range(self._watermark, self._watermark + fresh))
        self._watermark += fresh
        lru = self._lru
        pop = lru.pop_oldest
        evicted = [pop() for _ in range(min(count - fresh, len(lru)))]
        self.slot_of.pop_many(list(map(self.digest.__getitem__, evicted)))
        return taken + evicted, evicted

    def fill(
        self,
        slots: list[int],
        digests: list[bytes],
        parents: list[bytes | None],
        keys: list[Any],
        tokens: np.ndarray,
    ) -> None:
        """Record the blocks copied into ``slots`` (taken), most recently used last."""
        count = len(slots)
        self.slot_of.assign(digests, slots)
        push = self._lru.push
        for slot in slots:
            push(slot)
        digest_of, parent_of, keys_of = self.digest, self.parent_digest, self.keys
        stored_in, holds, epoch = self._stored_in, self._holds, self._epoch
        first = slots[0]
        if slots == list(range(first, first + count)):
            # Consecutive slots (fresh ones, and evictions in the order they were filled):
            # slice assignments, in C.
            end = first + count
            digest_of[first:end] = digests
            parent_of[first:end] = parents
            keys_of[first:end] = keys
            stored_in[first:end] = [epoch] * count
            holds[first:end] = [0] * count
        else:
            for slot, digest, parent, key in zip(slots, digests, parents, keys, strict=True):
                digest_of[slot] = digest
                parent_of[slot] = parent
                keys_of[slot] = key
                stored_in[slot] = epoch
                holds[slot] = 0
        self.tokens[slots] = tokens
        for removals in self._removals:
            # Stored again after a clear: its removal must not follow the new store.
            removals.pop_many(digests)

    def clear(self) -> tuple[object, ...]:
        """Drop every block in O(1); their removals become due (``next_removals``). Returns
        the old containers for the reaper (none: the old map is emptied by ``next_removals``,
        and the queue and per-slot lists are reused)."""
        self.generation += 1
        if self.slot_of:  # a flood of resets leaves no list of empty ones behind
            self._removals.append(self.slot_of)
        self.slot_of = DigestDict()
        self._lru.clear()
        self._watermark = 0
        self._announce_next = self._announce_end = 0
        return ()

    def announce_all(self) -> None:
        """The pool alone was reset: every block held now is to be announced again."""
        self._epoch += 1
        self._announce_next, self._announce_end = 0, self._watermark

    @property
    def backlog(self) -> bool:
        """Removals or announcements are still to publish."""
        return bool(self._removals) or self._announce_next < self._announce_end

    def next_removals(self, limit: int) -> list[bytes]:
        """Up to ``limit`` digests of cleared blocks whose removal is due."""
        taken: list[bytes] = []
        removals = self._removals
        while removals and len(taken) < limit:
            taken += removals[-1].pop_some(limit - len(taken))
            if not removals[-1]:
                removals.pop()
        return taken

    def next_announcements(self, limit: int) -> list[int]:
        """Up to ``limit`` slots scanned further; those whose blocks are to be announced."""
        start = self._announce_next
        stop = min(self._announce_end, start + limit)
        self._announce_next = stop
        slot_of, digest, stored_in, epoch = self.slot_of, self.digest, self._stored_in, self._epoch
        return [
            slot
            for slot in range(start, stop)
            if stored_in[slot] < epoch and slot_of.get(digest[slot]) == slot
        ]

    def close(self) -> None:
        self.copier.close()
        self.pool.close()
