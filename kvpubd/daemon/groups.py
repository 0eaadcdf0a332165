"""A hybrid cache's other KV cache groups: each with a pool, an index and token rows of its own.

Every group is keyed by the same chain digests (vLLM hashes a prompt once; a group's blocks
differ only by ``group_idx``). A store first matches the pool's group (``RankCache``), then
locates its blocks in every other group; the prefix the store may skip is the longest one
every group can serve, found as vLLM's hybrid coordinator finds it (each group's hit capped
by the others', until none shrinks it):

- a full-attention group serves any prefix of the blocks it caches from the first;
- a sliding-window group serves a prefix when it caches the ``window_blocks`` blocks before
  its end (``cdiv(window - 1, block_size)``, vLLM's ``sliding_window_contiguous_blocks``),
  or every block of a shorter one. It holds only the blocks from that many before the
  prefix's end; the earlier ones are skipped (vLLM's null blocks).

Past the common prefix a group holds every block of the prompt: those it caches already are
reused (pinned), the others handed out and published as stored, a run at a time. A window
group's index may evict any unpinned block (see window_index), so its stores never wait on
their parent's publication.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpubd.daemon.pool import BlockPool
from kvpubd.daemon.radix import ROOT, RadixIndex
from kvpubd.daemon.settings import CacheConfig, GroupSpec
from kvpubd.daemon.sink import EventSink, GroupLane, GroupTag, StoreKeys, one_block_stores
from kvpubd.daemon.window_index import WindowIndex
from kvpubd.protocol.hashing import TOKEN_DTYPE
from kvpubd.protocol.wire import BlockHash, BlockStored


def pool_group_tag(config: CacheConfig) -> GroupTag | None:
    """What the events of the pool's group (the first full-attention one) say of it; None
    for a cache of one implicit group."""
    spec = config.group_specs()[config.primary_group]
    return None if spec.idx is None else GroupTag(spec.idx, spec.kind, spec.sliding_window)


@dataclass(slots=True)
class GroupPlan:
    """One group's part of a store under way (see StorePlan): its blocks located, then the
    reused ones pinned, then its lease's blocks filled in position order."""

    located: list[int | None] = field(default_factory=list)  # by position, None: not cached
    # A tree index's cached prefix, in blocks, and whether a miss ended it (nothing after a
    # miss is cached there).
    prefix: int = 0
    missed: bool = False
    start: int = 0  # the first position the store holds (a window group skips the rest)
    reused: list[int] = field(default_factory=list)  # cached blocks held, pinned first
    pinned: int = 0
    blocks: list[int] = field(default_factory=list)  # the lease's, positions start..


@dataclass(slots=True)
class GroupLease:
    blocks: list[int]  # positions start.. of the prompt's full blocks
    tail_block: int | None
    start: int


class SecondaryGroup:
    def __init__(
        self,
        spec: GroupSpec,
        block_size: int,
        pool: BlockPool,
        sink: EventSink,
        wire_hash: Callable[[list[bytes]], list[BlockHash]],
    ) -> None:
        self.spec = spec
        self.block_size = block_size
        self.windowed = spec.windowed
        window = spec.sliding_window or 1
        # Blocks before a prefix's end a window group needs to serve it (vLLM's count).
        self.window_blocks = -(-(window - 1) // block_size) if self.windowed else 0
        self.index: RadixIndex | WindowIndex = (
            WindowIndex(spec.num_blocks) if self.windowed else RadixIndex(spec.num_blocks)
        )
        # Token ids of each cached block, by block id (for snapshots).
        self.tokens = np.zeros((spec.num_blocks, block_size), dtype=TOKEN_DTYPE)
        self.pool = pool
        self.sink = sink
        assert spec.idx is not None
        tag = GroupTag(spec.idx, spec.kind, spec.sliding_window)
        self.lane: GroupLane = sink.add_lane(tag, spec.num_blocks)
        self.wire_hash = wire_hash

    # -- a store ------------------------------------------------------------------------------

    def locate_some(self, plan: GroupPlan, digests: list[bytes]) -> None:
        """Locate the next positions' blocks (``digests``: those positions' digests)."""
        index = self.index
        if isinstance(index, WindowIndex):
            plan.located += index.locate(digests)
        elif plan.missed:
            plan.located += [None] * len(digests)
        else:
            found: list[int | None] = list(index.match(digests))
            plan.missed = len(found) < len(digests)
            plan.prefix += len(found)
            plan.located += found + [None] * (len(digests) - len(found))

    def hit(self, plan: GroupPlan, limit: int) -> int:
        """The longest prefix of at most ``limit`` blocks this group can serve."""
        if not self.windowed:
            return min(limit, plan.prefix)
        located = plan.located
        limit = min(limit, len(located))
        needed = self.window_blocks
        run = 0
        for position in range(limit - 1, -1, -1):  # from the end: vLLM's search
            if located[position] is None:
                run = 0
                continue
            run += 1
            if run >= needed:
                return position + run
        return run  # the blocks from the first: a hit even when fewer than the window

    def prepare(self, plan: GroupPlan, hit: int) -> None:
        """Fix what the store holds once the common prefix (``hit`` blocks) is known."""
        plan.start = max(0, hit - self.window_blocks) if self.windowed else 0
        plan.reused = [block for block in plan.located[plan.start :] if block is not None]

    def room(self, plan: GroupPlan, has_tail: bool) -> tuple[int, int]:
        """(blocks the store needs, blocks that can be had) in this group."""
        needed = len(plan.located) - plan.start - len(plan.reused) + has_tail
        unpinned_reused = self.index.count_unpinned(plan.reused)
        return needed, self.pool.free_count + self.index.unpinned - unpinned_reused

    def pin_some(self, plan: GroupPlan, limit: int) -> int:
        """Pin up to ``limit`` more of the reused blocks; how many were."""
        chunk = plan.reused[plan.pinned : plan.pinned + limit]
        self.index.pin(chunk)
        plan.pinned += len(chunk)
        return len(chunk)

    def insert_some(
        self,
        plan: GroupPlan,
        digests: list[bytes],
        tokens: np.ndarray,
        keys: StoreKeys,
        limit: int,
    ) -> int:
        """Hold up to ``limit`` more positions (of ``digests``, the whole prompt's): a cached
        block as located, a run of uncached ones newly handed out, inserted and captured as
        one store. Returns how many positions were held."""
        located = plan.located
        first = position = plan.start + len(plan.blocks)
        end = min(len(located), position + limit)
        while position < end:
            block = located[position]
            if block is not None:
                plan.blocks.append(block)
                position += 1
                continue
            run_end = position + 1
            while run_end < end and located[run_end] is None:
                run_end += 1
            self._store_run(plan, position, run_end, digests, tokens, keys)
            position = run_end
        return end - first

    def _store_run(
        self,
        plan: GroupPlan,
        first: int,
        end: int,
        digests: list[bytes],
        tokens: np.ndarray,
        keys: StoreKeys,
    ) -> None:
        run = digests[first:end]
        ids = self._allocate(len(run))
        size = self.block_size
        rows = tokens[first * size : end * size]
        self.tokens[ids] = rows.reshape(len(ids), size)
        # The chain parent: the previous position's block (cached in this group or not).
        parent_digest = digests[first - 1] if first else None
        parent_block: int | None = None
        index = self.index
        if isinstance(index, WindowIndex):
            index.insert_run(run, ids, parent_digest, keys)
        else:
            parent = plan.blocks[-1] if first else ROOT  # held: a tree group holds all
            index.insert_run(run, ids, parent, keys)
            parent_block = None if parent == ROOT else parent
        self.sink.group_stored(
            self.lane,
            parent_block=parent_block,
            block_ids=ids,
            hashes=self.wire_hash(run),
            parent_hash=None if parent_digest is None else self.wire_hash([parent_digest])[0],
            token_ids=rows,
            keys=keys,
        )
        plan.blocks += ids

    def allocate_tail(self) -> int:
        return self._allocate(1)[0]

    def _allocate(self, count: int) -> list[int]:
        shortfall = count - self.pool.free_count
        if shortfall > 0:
            evicted = self.index.evict(shortfall)
            digest = self.index.digest
            hashes = self.wire_hash(list(map(digest.__getitem__, evicted)))
            self.sink.group_removed(self.lane, evicted, hashes)
            self.pool.free(evicted)
        return self.pool.allocate(count)

    # -- leases, resets, snapshots ----------------------------------------------------------

    def free_tail(self, block_id: int) -> None:
        self.pool.free([block_id])

    def unpin(self, block_ids: list[int]) -> None:
        self.index.unpin(block_ids)

    def clear(self) -> tuple[object, ...]:
        """Forget every block in O(1); the old containers, for the reaper."""
        old = self.index.clear()
        self.pool.free_all()
        return old

    def parent_digests(self, block_ids: list[int]) -> list[bytes | None]:
        index = self.index
        if isinstance(index, WindowIndex):
            return list(map(index.parent_digest.__getitem__, block_ids))
        digest, parent = index.digest, index.parent
        return [None if parent[b] == ROOT else digest[parent[b]] for b in block_ids]

    def block_events(self, block_ids: list[int], medium: str) -> list[BlockStored]:
        """Cached blocks as one-block stores, as a snapshot reports them (token ids are
        views of the group's rows, valid until the block's slot is reused)."""
        index, tokens = self.index, self.tokens
        return one_block_stores(
            [index.digest[b] for b in block_ids],
            self.parent_digests(block_ids),
            [tokens[b] for b in block_ids],
            [index.keys[b] for b in block_ids],
            wire_hash=self.wire_hash,
            block_size=self.block_size,
            medium=medium,
            group=self.lane.tag,
        )

    @property
    def pinned_blocks(self) -> int:
        return len(self.index) - self.index.unpinned

    def close(self) -> None:
        self.pool.close()
