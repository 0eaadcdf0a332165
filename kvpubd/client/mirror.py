"""The cache as a router sees it, rebuilt from published events alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from kvpubd.protocol.wire import (
    FULL_ATTENTION_KINDS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)

Blocks = dict[BlockHash, BlockStored]


class MirrorError(AssertionError):
    """The published stream broke an invariant routers rely on."""


class GroupKind(NamedTuple):
    """A KV cache group as its stores describe it: ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window``."""

    kind: str | None
    sliding_window: int | None

    @property
    def full_attention(self) -> bool:
        """Whether the group keeps every block of a prompt (its stores' parents included)."""
        return self.kind in FULL_ATTENTION_KINDS


@dataclass
class Mirror:
    """The cache as a router sees it, built only from published events. Applying an event
    that breaks an invariant routers rely on raises MirrorError.

    Events without ``group_idx`` (every event of a daemon without ``cache.groups``) are the
    pool's, in ``blocks``. Those of a hybrid model's KV cache groups are kept per group, in
    ``group_blocks[group_idx]``: the same hash may be live in several groups (every group
    hashes the same chain), so a group's blocks are told apart by ``group_idx`` alone. A group
    has an entry while it holds a block; ``group(idx)`` reads any group, ``None`` meaning
    ``blocks``. ``group_kinds`` is what each group's stores said of it (learned anew after
    every clear); a store that says otherwise raises. Every group is held to the same rules
    as ``blocks`` (no store of a live block, no removal of a block the group does not hold,
    ``block_size`` tokens per block), except one: a store's parent must be live in its group
    only for a group of a full-attention kind. A sliding-window group (or one of another kind)
    lets blocks go that later ones chain from, so its parent may be gone.

    With ``host_medium``, events naming it are the host tier's (``host_blocks``, not split by
    group: a daemon with ``cache.groups`` has no host tier). ``AllBlocksCleared`` clears every
    group and both tiers, as Dynamo and llm-d read it; the removals of cleared host blocks
    that follow it (for readers that take the marker for the pool alone) are then accepted,
    once each. A host block's parent may be on either tier or on none (it was on the pool when
    the block was copied out), so it is not checked.
    """

    # The stream's block size; None: the first BlockStored after a clear sets it (a restart
    # may change it, and it starts with a clear).
    block_size: int | None = None
    blocks: Blocks = field(default_factory=dict)
    group_blocks: dict[int, Blocks] = field(default_factory=dict)
    group_kinds: dict[int, GroupKind] = field(default_factory=dict)
    host_medium: str | None = None
    host_blocks: Blocks = field(default_factory=dict)
    _learned_size: bool = field(default=False, repr=False)
    # Host blocks a clear dropped whose removal may still come (see above).
    _cleared_host: set[BlockHash] = field(default_factory=set, repr=False)

    def group(self, group_idx: int | None) -> Blocks:
        """The blocks a group holds (``None``: the events without ``group_idx``); empty for a
        group that holds none. Read only: the mirror's own dict, or a fresh empty one."""
        if group_idx is None:
            return self.blocks
        return self.group_blocks.get(group_idx, {})

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
                self.group_blocks.clear()
                self.group_kinds.clear()
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
        group_idx = None if host else event.group_idx
        if host:
            blocks = self.host_blocks
        elif group_idx is None:
            blocks = self.blocks
        else:
            blocks = self.group_blocks.get(group_idx, {})
        for block_hash in event.block_hashes:
            if block_hash in blocks:
                del blocks[block_hash]
            elif host and block_hash in self._cleared_host:
                self._cleared_host.discard(block_hash)
            else:
                where = "" if group_idx is None else f" of group {group_idx}"
                raise MirrorError(f"BlockRemoved names unknown block {block_hash!r}{where}")
        if group_idx is not None and not blocks:
            self.group_blocks.pop(group_idx, None)

    def _learn_group(self, event: BlockStored) -> GroupKind:
        assert event.group_idx is not None
        said = GroupKind(event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
        known = self.group_kinds.setdefault(event.group_idx, said)
        if known != said:
            raise MirrorError(
                f"group {event.group_idx} is {known.kind} (window {known.sliding_window}); a "
                f"store says {said.kind} (window {said.sliding_window})"
            )
        return said

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        if self.block_size is not None and size != self.block_size:
            raise MirrorError(f"block_size {size} != {self.block_size}")
        if len(event.token_ids) != len(event.block_hashes) * size:
            raise MirrorError("token_ids length is not blocks x block_size")
        host = self._on_host(event)
        group_idx = None if host else event.group_idx
        check_parent = not host
        if host:
            blocks = self.host_blocks
        elif group_idx is None:
            blocks = self.blocks
        else:
            check_parent = self._learn_group(event).full_attention
            blocks = self.group_blocks.get(group_idx) or {}
        parent = event.parent_block_hash
        where = "" if group_idx is None else f" in group {group_idx}"
        if parent is not None and check_parent and parent not in blocks:
            hint = ""
            # Two media live in one map: a host tier not told of (walked on this error only).
            media = {event.medium, *(block.medium for block in blocks.values())}
            if self.host_medium is None and len(media) > 1:
                named = ", ".join(sorted(map(str, media)))
                hint = f" (stores name media {named}: with a host tier, pass host_medium)"
            raise MirrorError(f"BlockStored parent {parent!r} is not live{where}{hint}")
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
                raise MirrorError(f"BlockStored repeats live block {block_hash!r}{where}")
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
        if group_idx is not None and blocks:
            self.group_blocks[group_idx] = blocks  # a group's entry: while it holds a block
        if self.block_size is None:
            self.block_size, self._learned_size = size, True
