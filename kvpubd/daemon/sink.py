"""The event sink of one rank: what was captured since the last batch, the per-tick capture
cap, and the record of which blocks are published (so removals and children stay truthful)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvpubd.daemon.block_tables import BlockPositions
from kvpubd.daemon.published import PublishedRecord
from kvpubd.protocol.wire import (
    AllBlocksCleared,
    BlockExtraKeys,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)


class StoreKeys(NamedTuple):
    """What a store mixes into its blocks' identity, exactly as published: one instance per
    store, shared by the index's record of each of its blocks (no object per block)."""

    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None
    # extra_keys entries as vLLM 0.33 publishes them: ``root`` for a prompt's first block
    # (LoRA name, then the salt), ``rest`` for every later block (LoRA name only).
    root: BlockExtraKeys | None
    rest: BlockExtraKeys | None

    @classmethod
    def of(cls, lora_id: int | None, lora_name: str | None, cache_salt: str | None) -> StoreKeys:
        if lora_id is not None and lora_name is None:
            # Routers key LoRA blocks by name (Dynamo ignores lora_id): a stable generated
            # name keeps this adapter's blocks apart from plain ones there too.
            lora_name = f"lora-{lora_id}"
        lora = () if lora_name is None else (lora_name,)
        root = (*lora, cache_salt) if cache_salt is not None else lora
        return cls(lora_id, lora_name, cache_salt, root or None, lora or None)

    def extra_keys(self, count: int, at_root: bool) -> list[BlockExtraKeys | None] | None:
        """The per-block entries of ``count`` consecutive blocks; ``at_root``: the first of
        them is the prompt's first block. None when no block has any."""
        if self.rest is None and (self.root is None or not at_root):
            return None
        if at_root:
            return [self.root, *[self.rest] * (count - 1)]
        return [self.rest] * count


PLAIN = StoreKeys.of(None, None, None)


class GroupTag(NamedTuple):
    """What a hybrid cache's events say of their KV cache group, as vLLM publishes it: the
    group's index on every event, its spec kind and window on stores."""

    idx: int
    kind: str
    sliding_window: int | None


def block_record(capacity: int) -> PublishedRecord[int]:
    """An empty record of blocks by their ids in a pool of ``capacity`` blocks (or slots in
    the host tier); after a clear, ``successor`` gives the next."""
    table = BlockPositions(capacity)
    return PublishedRecord(table, stale=table.stale)


class GroupLane:
    """A KV cache group as its events see it: its tag (None for the one implicit group) and
    the record of its published blocks (by the group's own block ids), in publication order
    (parents before children)."""

    def __init__(self, tag: GroupTag | None, capacity: int) -> None:
        self.tag = tag
        self.published: PublishedRecord[int] = block_record(capacity)


def store_keys(lora_id: int | None, lora_name: str | None, cache_salt: str | None) -> StoreKeys:
    """The record of what one store mixes into its blocks, shared by all of them (one shared
    record for every plain store)."""
    if lora_id is None and lora_name is None and cache_salt is None:
        return PLAIN
    return StoreKeys.of(lora_id, lora_name, cache_salt)


def stored_event(
    *,
    hashes: list[BlockHash],
    parent_hash: BlockHash | None,
    token_ids: list[int],
    block_size: int,
    medium: str,
    keys: StoreKeys,
    group: GroupTag | None = None,
) -> BlockStored:
    """One BlockStored for a run of consecutive blocks stored together (of ``group``, on a
    hybrid cache: a cache of one implicit group publishes no group fields)."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent_hash,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=keys.lora_id,
        medium=medium,
        lora_name=keys.lora_name,
        extra_keys=keys.extra_keys(len(hashes), parent_hash is None),
        group_idx=None if group is None else group.idx,
        kv_cache_spec_kind=None if group is None else group.kind,
        kv_cache_spec_sliding_window=None if group is None else group.sliding_window,
        cache_salt=keys.cache_salt,
    )


def one_block_stores(
    digests: list[bytes],
    parent_digests: list[bytes | None],
    rows: list[np.ndarray],
    keys: list[StoreKeys],
    *,
    wire_hash: Callable[[list[bytes]], list[BlockHash]],
    block_size: int,
    medium: str,
    group: GroupTag | None = None,
) -> list[BlockStored]:
    """Blocks as one-block stores, as a snapshot reports them: their digests, their chain
    parents' (None for a prompt's first block), token rows and keys, by block."""
    hashes = wire_hash(digests)
    parent_hashes = wire_hash([p for p in parent_digests if p is not None])[::-1]
    return [
        stored_event(
            hashes=[block_hash],
            parent_hash=parent_hashes.pop() if parent is not None else None,
            token_ids=row,  # type: ignore[arg-type]
            block_size=block_size,
            medium=medium,
            keys=block_keys,
            group=group,
        )
        for block_hash, parent, row, block_keys in zip(
            hashes, parent_digests, rows, keys, strict=True
        )
    ]


class EventSink:
    def __init__(
        self,
        *,
        block_size: int,
        medium: str,
        max_events_per_tick: int,
        host_medium: str | None = None,
        group: GroupTag | None = None,
    ) -> None:
        self.block_size = block_size
        # The pool's group; a hybrid cache's other groups have lanes of their own (add_lane).
        # Records sized by the cache (size_records), before anything is published.
        self.pool_lane = GroupLane(group, 0)
        self.lanes: list[GroupLane] = []
        self.medium = medium
        self.host_medium = host_medium or ""
        self.max_events_per_tick = max_events_per_tick
        self._pending: list[Event] = []
        # Blocks the pending events name (stored and removed): what the next batch encodes.
        self.pending_blocks = 0
        self._budget = max_events_per_tick
        # The host tier's published blocks, by slot. Its events are never dropped by the
        # per-tick cap (each follows a pool eviction or a reset, which the cap bounds).
        self.host_published: PublishedRecord[int] = block_record(0)
        self.dropped_stored_blocks = 0

    def size_records(self, pool_blocks: int, host_blocks: int) -> None:
        """Records for a pool of ``pool_blocks`` blocks and a host tier of ``host_blocks``
        (the cache's, once, before anything is published)."""
        self.pool_lane.published = block_record(pool_blocks)
        self.host_published = block_record(host_blocks)

    @property
    def published(self) -> PublishedRecord[int]:
        """The pool's published blocks, not yet removed."""
        return self.pool_lane.published

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def stored(
        self,
        *,
        parent_block: int | None,
        block_ids: list[int],
        hashes: list[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: np.ndarray,
        keys: StoreKeys,
    ) -> None:
        """Capture a newly stored contiguous run of the pool's full blocks (see
        ``group_stored``)."""
        self.group_stored(
            self.pool_lane,
            parent_block=parent_block,
            block_ids=block_ids,
            hashes=hashes,
            parent_hash=parent_hash,
            token_ids=token_ids,
            keys=keys,
        )

    def removed(self, block_ids: list[int], hashes: list[BlockHash]) -> None:
        """Capture the pool's removals; only blocks whose store was published are named."""
        self.group_removed(self.pool_lane, block_ids, hashes)

    def add_lane(self, tag: GroupTag, capacity: int) -> GroupLane:
        """A lane for a hybrid cache's group whose pool holds ``capacity`` blocks."""
        lane = GroupLane(tag, capacity)
        self.lanes.append(lane)
        return lane

    def group_stored(
        self,
        lane: GroupLane,
        *,
        parent_block: int | None,
        block_ids: list[int],
        hashes: list[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: np.ndarray,
        keys: StoreKeys,
    ) -> None:
        """Capture a newly stored contiguous run of a group's full blocks.

        A run under an unpublished parent (``parent_block``, in the group) is not published at
        all (its parent's store was dropped); otherwise as many blocks as the tick's budget
        allows, the rest dropped."""
        if parent_block is not None and parent_block not in lane.published:
            self.dropped_stored_blocks += len(block_ids)
            return
        count = min(len(block_ids), self._budget)
        self.dropped_stored_blocks += len(block_ids) - count
        if count == 0:
            return
        self._budget -= count
        self.pending_blocks += count
        lane.published.add(block_ids[:count] if count < len(block_ids) else block_ids)
        self._pending.append(
            stored_event(
                hashes=hashes[:count],
                parent_hash=parent_hash,
                # The cache's uint32 array itself: the encoder writes it without Python ints.
                token_ids=token_ids[: count * self.block_size],  # type: ignore[arg-type]
                block_size=self.block_size,
                medium=self.medium,
                keys=keys,
                group=lane.tag,
            )
        )

    def group_removed(self, lane: GroupLane, block_ids: list[int], hashes: list[BlockHash]) -> None:
        """Capture a group's removals; only blocks whose store was published are named."""
        named = lane.published.discard_named(block_ids, hashes)
        if named:
            self.pending_blocks += len(named)
            group_idx = None if lane.tag is None else lane.tag.idx
            self._pending.append(
                BlockRemoved(block_hashes=named, medium=self.medium, group_idx=group_idx)
            )

    def relayed(self, event: Event, blocks: int) -> None:
        """Capture an event an engine published (upstream mode: see relay.py), naming
        ``blocks`` blocks. Never dropped by the per-tick cap: the engine's rate is bounded
        where its batches are read."""
        self._pending.append(event)
        self.pending_blocks += blocks

    def host_stored(
        self,
        *,
        slots: list[int],
        hashes: list[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: np.ndarray,
        keys: StoreKeys,
        announced: bool = False,
    ) -> None:
        """Capture a run of blocks stored on the host tier (``announced``: stored there
        already, published again after a reset of the pool alone)."""
        if not announced:
            self.host_published.add(slots)
        self.pending_blocks += len(slots)
        self._pending.append(
            stored_event(
                hashes=hashes,
                parent_hash=parent_hash,
                token_ids=token_ids,  # type: ignore[arg-type]
                block_size=self.block_size,
                medium=self.host_medium,
                keys=keys,
            )
        )

    def host_removed(self, slots: list[int] | None, hashes: list[BlockHash]) -> None:
        """Capture removals from the host tier: of ``slots`` (evicted), or of blocks a reset
        cleared (``slots`` None: no longer in the record)."""
        if slots is not None:
            hashes = self.host_published.discard_named(slots, hashes)
        if hashes:
            self.pending_blocks += len(hashes)
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=self.host_medium))

    def cleared(self, every_tier: bool = True) -> tuple[PublishedRecord[int], ...]:
        """Append the reset marker after everything captured; it never counts against the cap.
        Forget what was published (on the host tier too, for ``every_tier``), so a
        repopulated prefix is reported again. Returns the old records, whose deallocation
        (O(blocks)) the caller may defer past the reset reply."""
        self._pending.append(AllBlocksCleared())  # every group's (vLLM's reset)
        old = []
        for lane in (self.pool_lane, *self.lanes):
            old.append(lane.published)
            lane.published = lane.published.successor()
        if every_tier:
            old.append(self.host_published)
            self.host_published = self.host_published.successor()
        self._budget = self.max_events_per_tick
        return tuple(old)

    def drain(self, new_tick: bool = False) -> list[Event]:
        """Take the captured events as one batch; the periodic drain passes ``new_tick`` to
        start a fresh budget (an out-of-tick flush, e.g. for a snapshot, must not)."""
        events, self._pending = self._pending, []
        self.pending_blocks = 0
        if new_tick:
            self._budget = self.max_events_per_tick
        return events
