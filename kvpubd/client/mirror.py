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
    that breaks an invariant routers rely on raises MirrorError.

    With ``host_medium``, events naming it are the host tier's (``host_blocks``), the rest
    the pool's (``blocks``). ``AllBlocksCleared`` clears both, as Dynamo and llm-d read it;
    the removals of cleared host blocks that follow it (for readers that take the marker for
    the pool alone) are then accepted, once each. A host block's parent may be on either
    tier or on none (it was on the pool when the block was copied out), so it is not checked.
    """

    # The stream's block size; None: the first BlockStored after a clear sets it (a restart
    # may change it, and it starts with a clear).
    block_size: int | None = None
    blocks: dict[BlockHash, BlockStored] = field(default_factory=dict)
    host_medium: str | None = None
    host_blocks: dict[BlockHash, BlockStored] = field(default_factory=dict)
    _learned_size: bool = field(default=False, repr=False)
    # Host blocks a clear dropped whose removal may still come (see above).
    _cleared_host: set[BlockHash] = field(default_factory=set, repr=False)

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
                self._cleared_host.update(self.host_blocks)
                self.host_blocks.clear()
                if self._learned_size:
                    self.block_size, self._learned_size = None, False
            elif isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)

    def _on_host(self, event: BlockStored | BlockRemoved) -> bool:
        return self.host_medium is not None and event.medium == self.host_medium

    def _remove(self, event: BlockRemoved) -> None:
        host = self._on_host(event)
        blocks = self.host_blocks if host else self.blocks
        for block_hash in event.block_hashes:
            if block_hash in blocks:
                del blocks[block_hash]
            elif host and block_hash in self._cleared_host:
                self._cleared_host.discard(block_hash)
            else:
                raise MirrorError(f"BlockRemoved names unknown block {block_hash!r}")

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        if self.block_size is not None and size != self.block_size:
            raise MirrorError(f"block_size {size} != {self.block_size}")
        if len(event.token_ids) != len(event.block_hashes) * size:
            raise MirrorError("token_ids length is not blocks x block_size")
        host = self._on_host(event)
        blocks = self.host_blocks if host else self.blocks
        parent = event.parent_block_hash
        if parent is not None and not host and parent not in blocks:
            raise MirrorError(f"BlockStored parent {parent!r} is not live")
        extra_keys = event.extra_keys
        if extra_keys is not None and len(extra_keys) != len(event.block_hashes):
            raise MirrorError("extra_keys has not one entry per block")
        for i, block_hash in enumerate(event.block_hashes):
            if block_hash in blocks:
                live = blocks[block_hash].medium
                if live != event.medium:  # two tiers in one dict: say how to tell them apart
                    raise MirrorError(
                        f"BlockStored of {block_hash!r} on medium {event.medium!r}, live on "
                        f"{live!r}: for a daemon with a host tier, pass host_medium"
                    )
                raise MirrorError(f"BlockStored repeats live block {block_hash!r}")
            if host:
                self._cleared_host.discard(block_hash)  # stored again: no removal follows
            # The block as a one-block store: what a snapshot of the daemon reports.
            blocks[block_hash] = msgspec.structs.replace(
                event,
                block_hashes=[block_hash],
                parent_block_hash=parent,
                token_ids=event.token_ids[i * size : (i + 1) * size],
                extra_keys=None if extra_keys is None or extra_keys[i] is None else [extra_keys[i]],
            )
            parent = block_hash
        if self.block_size is None:
            self.block_size, self._learned_size = size, True
