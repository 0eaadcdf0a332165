"""The KV block pool: one contiguous ``[num_blocks, block_bytes]`` array and its free list."""

from __future__ import annotations

import numpy as np


class PoolExhausted(Exception):
    pass


class BlockPool:
    """Host-memory pool (NumPy). Blocks below ``_watermark`` have been handed out at least once
    since the last reset; the rest are free without being on the free list, which makes
    ``free_all`` O(1)."""

    def __init__(self, num_blocks: int, block_bytes: int, scrub_on_free: bool) -> None:
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.scrub_on_free = scrub_on_free
        self.data = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        self._free: list[int] = []
        self._watermark = 0
        # Blocks freed but not yet zeroed; scrubbed before they can be handed out again.
        self._dirty: list[int] = []
        self._dirty_below = 0  # every block below this watermark is dirty (after free_all)

    @property
    def free_count(self) -> int:
        return len(self._free) + (self.num_blocks - self._watermark)

    @property
    def used_count(self) -> int:
        return self.num_blocks - self.free_count

    def allocate(self, count: int) -> list[int]:
        if count > self.free_count:
            raise PoolExhausted(f"need {count} blocks, {self.free_count} free")
        self.scrub_pending()
        free = self._free
        take = min(count, len(free))
        ids = free[len(free) - take :]
        del free[len(free) - take :]
        rest = count - take
        if rest:
            ids.extend(range(self._watermark, self._watermark + rest))
            self._watermark += rest
        return ids

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
        if self.scrub_on_free:
            self._dirty.extend(block_ids)

    def free_all(self) -> None:
        """Every block free again, in O(1); the scrub is left for ``scrub_pending``."""
        if self.scrub_on_free:
            self._dirty_below = max(self._dirty_below, self._watermark)
            # Every handed-out block lies below the watermark: the range scrub covers them all.
            self._dirty = []
        self._free = []
        self._watermark = 0

    def scrub_pending(self) -> None:
        """Zero every block freed since the last scrub."""
        if self._dirty_below:
            self.data[: self._dirty_below] = 0
            self._dirty_below = 0
        if self._dirty:
            self.data[np.asarray(self._dirty, dtype=np.int64)] = 0
            self._dirty = []

    def close(self) -> None:
        self.data = np.zeros((0, self.block_bytes), dtype=np.uint8)
