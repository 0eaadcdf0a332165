"""The cache as a router sees it, rebuilt from published events alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event


class MirrorError(AssertionError):
    """The published stream broke an invariant routers rely on."""


@dataclass
class Mirror:
    """The cache as a router sees it, built only from published events. Applying an event
    that breaks an invariant routers rely on raises MirrorError."""

    # The stream's block size; None: the first BlockStored after a clear sets it (a restart
    # may change it, and it starts with a clear).
    block_size: int | None = None
    blocks: dict[BlockHash, BlockStored] = field(default_factory=dict)
    _learned_size: bool = field(default=False, repr=False)

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
                if self._learned_size:
                    self.block_size, self._learned_size = None, False
            elif isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if block_hash not in self.blocks:
                        raise MirrorError(f"BlockRemoved names unknown block {block_hash!r}")
                    del self.blocks[block_hash]

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        if self.block_size is not None and size != self.block_size:
            raise MirrorError(f"block_size {size} != {self.block_size}")
        if len(event.token_ids) != len(event.block_hashes) * size:
            raise MirrorError("token_ids length is not blocks x block_size")
        parent = event.parent_block_hash
        if parent is not None and parent not in self.blocks:
            raise MirrorError(f"BlockStored parent {parent!r} is not live")
        extra_keys = event.extra_keys
        if extra_keys is not None and len(extra_keys) != len(event.block_hashes):
            raise MirrorError("extra_keys has not one entry per block")
        for i, block_hash in enumerate(event.block_hashes):
            if block_hash in self.blocks:
                raise MirrorError(f"BlockStored repeats live block {block_hash!r}")
            # The block as a one-block store: what a snapshot of the daemon reports.
            self.blocks[block_hash] = msgspec.structs.replace(
                event,
                block_hashes=[block_hash],
                parent_block_hash=parent,
                token_ids=event.token_ids[i * size : (i + 1) * size],
                extra_keys=None if extra_keys is None or extra_keys[i] is None else [extra_keys[i]],
            )
            parent = block_hash
        if self.block_size is None:
            self.block_size, self._learned_size = size, True
