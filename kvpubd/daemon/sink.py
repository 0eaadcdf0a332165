"""The event sink of one rank: what was captured since the last batch, the per-tick capture
cap, and the record of which blocks are published (so removals and children stay truthful)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvpubd.daemon.published import PublishedRecord
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event


class EventSink:
    def __init__(self, *, block_size: int, medium: str, max_events_per_tick: int) -> None:
        self.block_size = block_size
        self.medium = medium
        self.max_events_per_tick = max_events_per_tick
        self._pending: list[Event] = []
        self._budget = max_events_per_tick
        # Published and not yet removed, in publication order (parents before children).
        self.published = PublishedRecord()
        self.dropped_stored_blocks = 0

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def stored(
        self,
        parent_block: int | None,
        block_ids: list[int],
        hashes: list[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: np.ndarray,
        lora_id: int | None,
        lora_name: str | None,
    ) -> None:
        """Capture a newly stored contiguous run of full blocks.

        A run under an unpublished parent is not published at all (its parent's store was
        dropped); otherwise as many blocks as the tick's budget allows, the rest dropped."""
        if parent_block is not None and parent_block not in self.published:
            self.dropped_stored_blocks += len(block_ids)
            return
        count = min(len(block_ids), self._budget)
        self.dropped_stored_blocks += len(block_ids) - count
        if count == 0:
            return
        self._budget -= count
        self.published.add(block_ids[:count])
        self._pending.append(
            BlockStored(
                hashes[:count],
                parent_hash,
                token_ids[: count * self.block_size].tolist(),
                self.block_size,
                lora_id,
                self.medium,
                lora_name,
            )
        )

    def removed(self, blocks: Iterable[tuple[int, BlockHash]]) -> None:
        """Capture removals; only blocks whose store was published are named."""
        discard = self.published.discard
        hashes = [block_hash for block_id, block_hash in blocks if discard(block_id)]
        if hashes:
            self._pending.append(BlockRemoved(hashes, self.medium))

    def cleared(self) -> PublishedRecord:
        """Append the reset marker after everything captured; it never counts against the cap.
        Forget what was published, so a repopulated prefix is reported again. Returns the old
        record, whose deallocation (O(blocks)) the caller may defer past the reset reply."""
        self._pending.append(AllBlocksCleared())
        old, self.published = self.published, PublishedRecord()
        self._budget = self.max_events_per_tick
        return old

    def drain(self, new_tick: bool = False) -> list[Event]:
        """Take the captured events as one batch; the periodic drain passes ``new_tick`` to
        start a fresh budget (an out-of-tick flush, e.g. for a snapshot, must not)."""
        events, self._pending = self._pending, []
        if new_tick:
            self._budget = self.max_events_per_tick
        return events
