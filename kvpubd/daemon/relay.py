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
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvpubd.daemon.published import ValuedRecord
from kvpubd.daemon.sink import EventSink
from kvpubd.protocol.wire import (
    FULL_ATTENTION_KINDS,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    token_count,
    token_list,
)

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
Lane = tuple[int | None, str | None]  # group_idx, medium
# One lane's live blocks by hash, in publication order, each with the store that published
# it: a block has no object of its own.
LaneRecord = ValuedRecord[BlockHash, BlockStored]


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
        # Per lane (group_idx, medium), in the order the lanes appeared.
        self._lanes: dict[Lane, LaneRecord] = {}
        self._count = 0  # live blocks, every lane's
        # After a reset: None (not fencing), else the deadline and, for per-block engines,
        # the keys the engine must still remove.
        self._fence_until: float | None = None
        # A per-block engine's blocks at the reset, per lane, that it must still remove.
        self._fenced_lanes: dict[Lane, LaneRecord] = {}
        self.dropped_by_reset = 0  # engine events dropped as from before its clear
        self.fences_timed_out = 0
        self.duplicates = 0  # blocks stored again while live, not repeated
        self.unknown_removals = 0  # blocks removed that were never stored, not published
        self.orphans = 0  # blocks stored under a parent that is not live, not published
        # Blocks of stores whose token_ids do not cover exactly their blocks (vLLM's
        # sliding-window stores that skip blocks): which tokens are whose cannot be told.
        self.non_dense_blocks = 0

    def __len__(self) -> int:
        return self._count

    @property
    def records(self) -> Sequence[LaneRecord]:
        """Each lane's record, in the order the lanes appeared (a snapshot's tiers)."""
        return list(self._lanes.values())

    # -- what the control socket does -------------------------------------------------------

    def clear(self, fence: bool = False) -> None:
        """Forget every block in O(1) (the pipeline publishes the marker); the old containers
        go to the reaper. ``fence``: a reset on the control socket, after which the engine's
        events from before its own clear are dropped (see the module docstring)."""
        old = self._lanes
        self._lanes, self._count = {}, 0
        self._end_fence()
        if fence:
            self._fence_until = time.monotonic() + self._clear_timeout
            if self._clears_per_block:
                # What the engine must remove (retired once it has); holding nothing, it has
                # nothing to remove: no fence.
                self._fenced_lanes = {lane: record for lane, record in old.items() if len(record)}
                for record in self._fenced_lanes.values():
                    record.close_views()  # no snapshot reads it any more
                if not self._fenced_lanes:
                    self._fence_until = None
                return
        self._retire(*old.values())

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
        if self._fence_until is not None:
            for i, event in enumerate(events):
                self._fenced(event)
                if self._fence_until is None:  # the engine's clear: what follows is after it
                    events = events[i + 1 :]
                    break
            else:
                return
        self._follow(events)

    def _follow(self, events: list[Event]) -> None:
        removals: list[BlockHash] = []
        group: int | None = None
        medium: str | None = None
        for event in events:
            if type(event) is BlockRemoved:
                if removals and (event.group_idx != group or event.medium != medium):
                    self._removed((group, medium), removals)
                    removals = []
                group, medium = event.group_idx, event.medium
                removals += event.block_hashes
                continue
            if removals:
                self._removed((group, medium), removals)
                removals = []
            if isinstance(event, BlockStored):
                self._stored(event)
            else:
                self._engine_cleared()
        if removals:
            self._removed((group, medium), removals)

    def _fenced(self, event: Event) -> None:
        self.dropped_by_reset += 1
        if isinstance(event, AllBlocksCleared) and not self._clears_per_block:
            self._end_fence()  # the engine's clear: what follows is after it
        elif isinstance(event, BlockRemoved) and self._clears_per_block:
            lane, fenced = (event.group_idx, event.medium), self._fenced_lanes
            held = fenced.get(lane)
            if held is not None:
                held.forget(self._converted(event.block_hashes))
                if not len(held):
                    self._retire(fenced.pop(lane))
            if not fenced:
                self._end_fence()

    def _end_fence(self) -> None:
        self._fence_until = None
        if self._fenced_lanes:
            self._retire(*self._fenced_lanes.values())
        self._fenced_lanes = {}

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
        size, raw, extra = event.block_size, event.block_hashes, event.extra_keys
        if token_count(event.token_ids) != len(raw) * size or (
            extra is not None and len(extra) != len(raw)
        ):
            self.non_dense_blocks += len(raw)
            return
        hashes = self._converted(raw)
        if event.lora_id is not None and event.lora_name is None:
            # Routers key LoRA blocks by name (Dynamo ignores lora_id): the name kvpubd gives
            # where it owns the pool.
            event = msgspec.structs.replace(event, lora_name=f"lora-{event.lora_id}")
        record = self._lanes.get((event.group_idx, event.medium))
        if record is None:
            record = self._lanes[event.group_idx, event.medium] = ValuedRecord()
        parent = event.parent_block_hash
        if parent is not None and (hashes is not raw):
            parent = self._hash(parent)
        if hashes is not raw or parent is not event.parent_block_hash:
            event = msgspec.structs.replace(event, block_hashes=hashes, parent_block_hash=parent)
        count = len(hashes)
        chained = parent is None or parent in record or self._parent_live(event, parent)
        if chained and self._count + count <= self._max_blocks and record.add_valued(hashes, event):
            # All new (the common case): the event goes out as it came.
            self._count += count
            self.sink.relayed(event, count)
            return
        self._stored_some(event, record, chained)

    def _parent_live(self, event: BlockStored, parent: BlockHash) -> bool:
        """Whether a store's parent is live in its group on another medium (a copy on
        another tier counts), or need not be (a sliding-window group's)."""
        if (
            event.kv_cache_spec_kind is not None
            and event.kv_cache_spec_kind not in FULL_ATTENTION_KINDS
        ):
            return True
        group = event.group_idx
        return any(parent in record for (g, _), record in self._lanes.items() if g == group)

    def _stored_some(self, event: BlockStored, record: LaneRecord, chained: bool) -> None:
        """A store some of whose blocks are live already (vLLM republishes the blocks a prefix
        hit reuses), under a parent that is not live, or past max_blocks: its new blocks go
        out as runs."""
        hashes = event.block_hashes
        run_start: int | None = None
        count = self._count
        seen: set[BlockHash] = set()  # earlier in this store
        for i, block_hash in enumerate(hashes):
            duplicate = block_hash in record or block_hash in seen
            if duplicate or not chained or count >= self._max_blocks:
                if duplicate:
                    self.duplicates += 1
                elif not chained:
                    self.orphans += 1
                else:
                    self.over_limit += 1
                chained = duplicate  # the next block hangs under this one
                if run_start is not None:
                    self._publish_run(event, record, run_start, i)
                    run_start = None
                continue
            if run_start is None:
                run_start = i
            seen.add(block_hash)
            count += 1
        if run_start is not None:
            self._publish_run(event, record, run_start, len(hashes))

    def _publish_run(self, event: BlockStored, record: LaneRecord, start: int, end: int) -> None:
        size, extra, hashes = event.block_size, event.extra_keys, event.block_hashes
        run = plain_store(
            event,
            block_hashes=hashes[start:end],
            parent_block_hash=event.parent_block_hash if start == 0 else hashes[start - 1],
            token_ids=token_list(event.token_ids)[start * size : end * size],
            extra_keys=None if extra is None else extra[start:end],
        )
        added = record.add_valued(run.block_hashes, run)
        assert added, "a run holds new blocks only"
        self._count += end - start
        self.sink.relayed(run, end - start)

    def _removed(self, lane: Lane, raw: list[BlockHash]) -> None:
        record = self._lanes.get(lane)
        hashes = self._converted(raw)
        if record is None:
            self.unknown_removals += len(hashes)
            return
        # Blocks never stored (or forgotten) are not named.
        named = record.discard_named(hashes, hashes)
        self.unknown_removals += len(hashes) - len(named)
        if named:
            self._count -= len(named)
            group, medium = lane
            self.sink.relayed(BlockRemoved(named, medium, group), len(named))

    # -- snapshots ---------------------------------------------------------------------------

    def block_events(self, lane: int, hashes: list[BlockHash]) -> list[BlockStored]:
        """Blocks of the ``lane``-th lane (see records) as one-block stores, each with its
        chain parent's hash."""
        store_of = list(self._lanes.values())[lane].value
        events = []
        tokens: list[int] = []
        where: dict[BlockHash, int] = {}
        last: BlockStored | None = None
        for block_hash in hashes:
            event = store_of(block_hash)
            if event is not last:  # a snapshot meets a store's blocks one after the other
                last, tokens = event, token_list(event.token_ids)
                where = {h: i for i, h in enumerate(event.block_hashes)}
            i = where[block_hash]
            size, extra, hashes = event.block_size, event.extra_keys, event.block_hashes
            events.append(
                plain_store(
                    event,
                    block_hashes=[block_hash],
                    parent_block_hash=hashes[i - 1] if i else event.parent_block_hash,
                    token_ids=tokens[i * size : (i + 1) * size],
                    extra_keys=None if extra is None or extra[i] is None else [extra[i]],
                )
            )
        return events


def plain_store(event: BlockStored, **changes: Any) -> BlockStored:
    """``event`` with ``changes``, as a plain ``BlockStored`` (a ``RelayedStored`` whose token
    ids are replaced by a list is one)."""
    if type(event) is BlockStored:
        return msgspec.structs.replace(event, **changes)
    fields = msgspec.structs.asdict(event)
    fields.update(changes)
    return BlockStored(**fields)
