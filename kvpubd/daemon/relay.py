"""One rank's blocks as an unmodified engine publishes them, republished in canonical form.

In upstream mode the engine owns its KV cache and publishes its own events; a follower
(``kvpubd.upstream``) hands them over in order. The relay keeps every block the engine
stored and has not removed, keyed by (group, medium, hash) in the configured hash format, and
captures what routers need into the rank's sink:

- a store of blocks already live is not repeated (vLLM republishes the blocks a prefix hit
  reuses), a removal of blocks never stored is dropped, and a block stored under a parent
  that is not live (on any medium: the engine stored it under a block a loss, a restart or a
  reset made kvpubd forget) is not published, nor are its descendants: subscribers see a
  strict stream, in chains they can follow. Sliding-window groups are exempt: their parents
  may be gone for good reasons;
- an engine restart, or batches the follower lost, void what the engine published before:
  the relay forgets it and publishes ``AllBlocksCleared`` (subscribers then hold a subset of
  the engine's blocks, never a block it dropped);
- after a reset on the control socket (whose marker the pipeline publishes at once), the
  engine's own events from before its clear are dropped: up to and including its
  ``AllBlocksCleared``, or, for an engine that sends per-block removals instead (TensorRT-LLM),
  until it has removed every block it held at the reset; at most ``clear_timeout`` seconds
  either way.

Each block is a one-block store under an id of its own, in a published record, so snapshots,
replays of lost history and the snapshot endpoint read the relay as they read a pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from itertools import repeat

import msgspec

from kvpubd.daemon.published import PublishedRecord
from kvpubd.daemon.sink import EventSink
from kvpubd.protocol.wire import (
    FULL_ATTENTION_KINDS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
Lane = tuple[int | None, str | None]  # group_idx, medium


def hash_converter(hash_format: str) -> Callable[[BlockHash], BlockHash]:
    """An engine's block hash (an int of any sign, or bytes) in ``hash_format``, the same way
    for every event (bytes as kvpubd's own digests: u64 their last 8 bytes, i64 their first)."""
    if hash_format == "u64":
        return lambda h: h & MASK64 if isinstance(h, int) else int.from_bytes(h[-8:], "big")
    if hash_format == "i64":

        def signed(h: BlockHash) -> int:
            if isinstance(h, bytes):
                return int.from_bytes(h[:8], "big", signed=True)
            h &= MASK64
            return h - (1 << 64) if h >> 63 else h

        return signed
    return lambda h: (h & MASK64).to_bytes(8, "big") if isinstance(h, int) else h


class Relay:
    def __init__(
        self,
        sink: EventSink,
        hash_format: str,
        on_engine_clear: Callable[[], None],
        retire: Callable[..., None],
        clears_per_block: bool = False,
        clear_timeout: float = 5.0,
        max_blocks: int = 1 << 62,
    ) -> None:
        self.sink = sink
        # Publishes the marker and clears (the pipeline's, as for a reset without a fence).
        self._on_engine_clear = on_engine_clear
        # Frees old containers a slice at a time (the reaper): dropping a million-block dict
        # in one step would hold the loop.
        self._retire = retire
        # An engine that stores without end cannot grow the daemon without bound: stores
        # past this many live blocks are not kept nor published (subscribers hold a subset).
        self._max_blocks = max_blocks
        self.over_limit = 0
        self._hash = hash_converter(hash_format)
        self._u64 = hash_format == "u64"
        # The engine turns a reset into per-block removals (no AllBlocksCleared).
        self._clears_per_block = clears_per_block
        self._clear_timeout = clear_timeout
        self.record = PublishedRecord()
        # Per lane (group_idx, medium): each live block's id by hash.
        self._ids: dict[Lane, dict[BlockHash, int]] = {}
        # Each live block by id: the event that published it and its place in that event.
        self._block: dict[int, tuple[BlockStored, int]] = {}
        self._next_id = 0
        # After a reset: None (not fencing), else the deadline and, for per-block engines,
        # the keys the engine must still remove.
        self._fence_until: float | None = None
        # A per-block engine's blocks at the reset, per lane, that it must still remove.
        self._fenced_keys: dict[Lane, dict[BlockHash, int]] = {}
        self.dropped_by_reset = 0  # engine events dropped as from before its clear
        self.fences_timed_out = 0
        self.duplicates = 0  # blocks stored again while live, not repeated
        self.unknown_removals = 0  # blocks removed that were never stored, not published
        self.orphans = 0  # blocks stored under a parent that is not live, not published
        # Blocks of stores whose token_ids do not cover exactly their blocks (vLLM's
        # sliding-window stores that skip blocks): which tokens are whose cannot be told.
        self.non_dense_blocks = 0

    def __len__(self) -> int:
        return len(self._block)

    # -- what the control socket does -------------------------------------------------------

    def clear(self, fence: bool = False) -> None:
        """Forget every block in O(1) (the pipeline publishes the marker); the old containers
        go to the reaper. ``fence``: a reset on the control socket, after which the engine's
        events from before its own clear are dropped (see the module docstring)."""
        old_ids = self._ids
        self._retire(self.record, self._block)
        self.record, self._ids, self._block = PublishedRecord(), {}, {}
        self._end_fence()
        if fence:
            self._fence_until = time.monotonic() + self._clear_timeout
            if self._clears_per_block:
                # What the engine must remove (retired after); holding nothing, it has
                # nothing to remove: no fence.
                self._fenced_keys = {lane: ids for lane, ids in old_ids.items() if ids}
                if not self._fenced_keys:
                    self._fence_until = None
                return
        self._retire(*old_ids.values())

    @property
    def fencing(self) -> bool:
        return self._fence_until is not None

    # -- what the engine publishes -----------------------------------------------------------

    def restart(self, why: str) -> None:
        """The engine restarted, or batches were lost: what it published before is void (a
        restarted engine holds nothing from before a reset either: no fence is left)."""
        log.warning("upstream: %s; publishing AllBlocksCleared", why)
        self._engine_cleared()

    def apply(self, events: list[Event]) -> None:
        """Capture the engine's events of one batch. Removals back to back in one lane are
        taken (and republished) as one: vLLM reports each evicted block in an event of its
        own."""
        if self._fence_until is not None and time.monotonic() > self._fence_until:
            log.warning(
                "upstream: the engine did not clear within %.1f s of a reset; following it "
                "again (its blocks from before are not published)",
                self._clear_timeout,
            )
            self.fences_timed_out += 1
            self._end_fence()
        removals: list[BlockHash] = []
        lane: tuple[int | None, str | None] | None = None
        for event in events:
            if self._fence_until is not None:
                self._fenced(event)
                continue
            if type(event) is BlockRemoved:
                here = (event.group_idx, event.medium)
                if here != lane and removals:
                    self._removed(lane, removals)
                    removals = []
                lane = here
                removals += event.block_hashes
                continue
            if removals:
                self._removed(lane, removals)
                removals = []
            if type(event) is BlockStored:
                self._stored(event)
            else:
                self._engine_cleared()
        if removals:
            self._removed(lane, removals)

    def _fenced(self, event: Event) -> None:
        self.dropped_by_reset += 1
        if isinstance(event, AllBlocksCleared) and not self._clears_per_block:
            self._end_fence()  # the engine's clear: what follows is after it
        elif isinstance(event, BlockRemoved) and self._clears_per_block:
            lane, fenced = (event.group_idx, event.medium), self._fenced_keys
            held = fenced.get(lane)
            if held is not None:
                for block_hash in self._converted(event.block_hashes):
                    held.pop(block_hash, None)
                if not held:
                    del fenced[lane]
            if not fenced:
                self._end_fence()

    def _end_fence(self) -> None:
        self._fence_until = None
        if self._fenced_keys:
            self._retire(*self._fenced_keys.values())
        self._fenced_keys = {}

    def _engine_cleared(self) -> None:
        self._on_engine_clear()

    def _converted(self, raw: list[BlockHash]) -> list[BlockHash]:
        """The hashes in the configured format (the list itself when they are already)."""
        if self._u64 and raw:
            try:  # in C: ints all in range (bytes among ints do not compare)
                if min(raw) >= 0 and max(raw) <= MASK64:  # type: ignore[operator]
                    return raw
            except TypeError:
                pass
        convert = self._hash
        return [convert(h) for h in raw]

    def _stored(self, event: BlockStored) -> None:
        size, raw = event.block_size, event.block_hashes
        if len(event.token_ids) != len(raw) * size:
            self.non_dense_blocks += len(raw)
            return
        hashes = self._converted(raw)
        if event.lora_id is not None and event.lora_name is None:
            # Routers key LoRA blocks by name (Dynamo ignores lora_id): the name kvpubd gives
            # where it owns the pool.
            event = msgspec.structs.replace(event, lora_name=f"lora-{event.lora_id}")
        ids = self._ids.setdefault((event.group_idx, event.medium), {})
        parent = event.parent_block_hash
        if parent is not None and (hashes is not raw):
            parent = self._hash(parent)
        if hashes is not raw or parent is not event.parent_block_hash:
            event = msgspec.structs.replace(event, block_hashes=hashes, parent_block_hash=parent)
        first = self._next_id
        count = len(hashes)
        chained = parent is None or self._live(event, parent)
        if (
            chained
            and len(self._block) + count <= self._max_blocks
            and ids.keys().isdisjoint(hashes)
        ):
            # All new (the common case): the event goes out as it came, each block kept as
            # (event, index) with no object of its own.
            new_ids = list(range(first, first + count))
            self._next_id += count
            ids.update(zip(hashes, new_ids, strict=True))
            self._publish(event, new_ids)
            return
        self._stored_some(event, ids, chained)

    def _live(self, event: BlockStored, parent: BlockHash) -> bool:
        """Whether a store's parent is live in its group, on any medium (a copy on another
        tier counts), or need not be (a sliding-window group's)."""
        if (
            event.kv_cache_spec_kind is not None
            and event.kv_cache_spec_kind not in FULL_ATTENTION_KINDS
        ):
            return True
        group = event.group_idx
        return any(parent in ids for (g, _), ids in self._ids.items() if g == group)

    def _stored_some(self, event: BlockStored, ids: dict[BlockHash, int], chained: bool) -> None:
        """A store some of whose blocks are live already (vLLM republishes the blocks a prefix
        hit reuses), under a parent that is not live, or past max_blocks: its new blocks go
        out as runs."""
        hashes = event.block_hashes
        run_start: int | None = None
        live = len(self._block)
        for i, block_hash in enumerate(hashes):
            duplicate = block_hash in ids
            if duplicate or not chained or live >= self._max_blocks:
                if duplicate:
                    self.duplicates += 1
                elif not chained:
                    self.orphans += 1
                else:
                    self.over_limit += 1
                chained = duplicate  # the next block hangs under this one
                if run_start is not None:
                    self._publish_run(event, run_start, i)
                    run_start = None
                continue
            if run_start is None:
                run_start = i
            ids[block_hash] = self._next_id
            self._next_id += 1
            live += 1
        if run_start is not None:
            self._publish_run(event, run_start, len(hashes))

    def _publish_run(self, event: BlockStored, start: int, end: int) -> None:
        size, extra, hashes = event.block_size, event.extra_keys, event.block_hashes
        run = msgspec.structs.replace(
            event,
            block_hashes=hashes[start:end],
            parent_block_hash=event.parent_block_hash if start == 0 else hashes[start - 1],
            token_ids=event.token_ids[start * size : end * size],
            extra_keys=None if extra is None else extra[start:end],
        )
        new_ids = list(range(self._next_id - (end - start), self._next_id))
        # Ids were taken in order while the run grew: they are the last ones handed out.
        self._publish(run, new_ids)

    def _publish(self, event: BlockStored, new_ids: list[int]) -> None:
        """Keep the store's blocks (ids in its order) and capture it."""
        self._block.update(zip(new_ids, zip(repeat(event), range(len(new_ids))), strict=True))
        self.record.add(new_ids)
        self.sink.relayed(event, len(new_ids))

    def _removed(self, lane: tuple[int | None, str | None] | None, raw: list[BlockHash]) -> None:
        assert lane is not None
        ids = self._ids.get(lane)
        hashes = self._converted(raw)
        found: list[int] = []
        named: list[BlockHash] = []
        if ids is not None:
            pop = ids.pop
            for block_hash in hashes:
                block_id = pop(block_hash, None)
                if block_id is not None:
                    found.append(block_id)
                    named.append(block_hash)
        self.unknown_removals += len(hashes) - len(found)
        if not found:
            return
        named = self.record.discard_named(found, named)
        block = self._block
        for block_id in found:
            del block[block_id]
        if named:
            group, medium = lane
            self.sink.relayed(BlockRemoved(named, medium, group), len(named))

    # -- snapshots ---------------------------------------------------------------------------

    def block_events(self, block_ids: list[int]) -> list[BlockStored]:
        """The blocks as one-block stores, each with its chain parent's hash."""
        events = []
        replace = msgspec.structs.replace
        for event, i in map(self._block.__getitem__, block_ids):
            size, extra = event.block_size, event.extra_keys
            hashes = event.block_hashes
            events.append(
                replace(
                    event,
                    block_hashes=[hashes[i]],
                    parent_block_hash=hashes[i - 1] if i else event.parent_block_hash,
                    token_ids=event.token_ids[i * size : (i + 1) * size],
                    extra_keys=None if extra is None or extra[i] is None else [extra[i]],
                )
            )
        return events
