"""The cache as a router sees it, rebuilt from published events alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event


class MirrorError(AssertionError):
    """The published stream broke an invariant routers rely on."""


@dataclass
class Mirror:
    """The cache as a router sees it, built only from published events. Applying an event
    that breaks an invariant routers rely on raises MirrorError."""

    block_size: int | None = None
    blocks: dict[BlockHash, BlockStored] = field(default_factory=dict)

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
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
        for i, block_hash in enumerate(event.block_hashes):
            if block_hash in self.blocks:
                raise MirrorError(f"BlockStored repeats live block {block_hash!r}")
            self.blocks[block_hash] = BlockStored(
                [block_hash],
                parent,
                event.token_ids[i * size : (i + 1) * size],
                size,
                event.lora_id,
                event.medium,
                event.lora_name,
            )
            parent = block_hash
