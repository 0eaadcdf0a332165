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
  ``AllBlocksCleared`` (its last, where resets while fencing called it again), or, for an
  engine that sends per-block removals instead (TensorRT-LLM), until it has removed every
  block it held at the first reset; at most ``clear_timeout`` seconds after the last reset
  either way, and never while batches received from the engine wait behind the one applied.
  A loss meanwhile, or seqs that went back with no sign of a new engine, leave the fence on; a
  restarted engine ends it.

The live blocks are one published record, in publication order, each entry keeping the store
that published it (a block has no object of its own): snapshots, replays of lost history and the
snapshot endpoint read the relay as they read a pool, each block a one-block store.
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
from kvpubd.upstream.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
PART_BLOCKS = 1024  # blocks of one engine store republished as one event at most
Lane = tuple[int | None, str | None]  # group_idx, medium
# A block's key: its hash in the first lane the engine stored in since the relay was last
# cleared (vLLM's GPU group 0: the common case, no object made per block), (lane number,
# hash) in any other (the same hash may be live in two groups or on two media).
BlockKey = BlockHash | tuple[int, BlockHash]
# Every live block by key, in publication order (parents before children, across lanes),
# each with the store that published it: a block has no object of its own.
Blocks = ValuedRecord[BlockKey, BlockStored]


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
        self._blocks: Blocks = ValuedRecord()
        self._lanes: dict[Lane, int] = {}  # each lane's number, in the order they appeared
        # After a reset: None (not fencing), else the deadline and, for per-block engines,
        # the keys the engine must still remove.
        self._fence_until: float | None = None
        # Of an engine that clears with AllBlocksCleared: its clears the fence still waits for
        # (one per reset that called the engine while a fence was on: each makes one more).
        self._clears_due = 0
        # While a loss or a restart not known for one voids the blocks: a fence stays on.
        self._keeping_fence = False
        self._restarts_log = ThrottledLog(log)  # a flood of restarts is not a flood of lines
        # A per-block engine's blocks at the reset that it must still remove, and their lanes.
        self._fence_blocks: tuple[Blocks, dict[Lane, int]] | None = None
        self._decoded: tuple[BlockStored, list[Any], dict[BlockHash, int]] | None = None
        self.dropped_by_reset = 0  # engine events dropped as from before its clear
        self.fences_timed_out = 0
        self.duplicates = 0  # blocks stored again while live, not repeated
        self.unknown_removals = 0  # blocks removed that were never stored, not published
        self.orphans = 0  # blocks stored under a parent that is not live, not published
        # Blocks of stores whose token_ids do not cover exactly their blocks (vLLM's
        # sliding-window stores that skip blocks): which tokens are whose cannot be told.
        self.non_dense_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def records(self) -> Sequence[Blocks]:
        """The record of the live blocks (a snapshot's one tier)."""
        return [self._blocks]

    # -- what the control socket does -------------------------------------------------------

    def clear(self, fence: bool = False, engine_called: bool = False) -> None:
        """Forget every block in O(1) (the pipeline publishes the marker); the old containers
        go to the reaper. ``fence``: a reset on the control socket, after which the engine's
        events from before its own clear are dropped (see the module docstring);
        ``engine_called``: the reset asked the engine to clear (upstream.reset_url)."""
        old, lanes = self._blocks, self._lanes
        self._blocks, self._lanes, self._decoded = ValuedRecord(), {}, None
        if self._keeping_fence or (fence and self._fence_until is not None):
            # A loss, or a reset while fencing (nothing was followed since the fence began):
            # the engine's clear is still to come, and after a second call, one more.
            if fence:
                self._fence_until = time.monotonic() + self._clear_timeout
                self._clears_due += int(engine_called)
            self._retire(old)
            return
        self._end_fence()
        if fence:
            self._fence_until = time.monotonic() + self._clear_timeout
            self._clears_due = 1
            if self._clears_per_block and len(old):
                # What the engine must remove (retired once it has).
                old.close_views()  # no snapshot reads it any more
                self._fence_blocks = (old, lanes)
                return
            if self._clears_per_block:
                self._fence_until = None  # holding nothing, it has nothing to remove
        self._retire(old)

    @property
    def fencing(self) -> bool:
        return self._fence_until is not None

    # -- what the engine publishes -----------------------------------------------------------

    def restart(self, why: str, new_engine: bool = True) -> None:
        """The engine restarted, or batches were lost: what it published before is void. A
        fence ends only when ``new_engine`` (a restarted engine holds nothing from before a
        reset): a loss may have taken the engine's clear or not, and seqs that only went back
        (an engine out of order, or restarted behind a proxy) may be followed by its history
        from seq 0, from before the reset."""
        self._restarts_log.warning("upstream: %s; publishing AllBlocksCleared", why)
        self._keeping_fence = not new_engine
        try:
            self._engine_cleared()
        finally:
            self._keeping_fence = False

    def apply(self, events: list[Event], caught_up: bool = True) -> None:
        """Capture the engine's events of one batch. Removals back to back in one lane are
        taken (and republished) as one: vLLM reports each evicted block in an event of its
        own. ``caught_up``: no batch of the engine's is received and waiting behind this one;
        a fence times out only then (its clear may be in a backlog longer than the timeout,
        and the backlog's batches from before it would go out after the marker)."""
        if self._fence_until is not None and caught_up and time.monotonic() > self._fence_until:
            log.warning(
                "upstream: the engine did not clear within %s s of a reset; following it "
                "again (its blocks from before are not published)",
                round(self._clear_timeout, 3),
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
            self._clears_due -= 1
            if self._clears_due <= 0:
                self._end_fence()  # the engine's (last) clear: what follows is after it
        elif isinstance(event, BlockRemoved) and self._fence_blocks is not None:
            held, lanes = self._fence_blocks
            number = lanes.get((event.group_idx, event.medium))
            if number is not None:
                held.forget(_keys(number, self._converted(event.block_hashes)))
            if not len(held):
                self._end_fence()

    def _end_fence(self) -> None:
        self._fence_until = None
        self._clears_due = 0
        if self._fence_blocks is not None:
            self._retire(self._fence_blocks[0])
        self._fence_blocks = None

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
        if not raw:
            return  # a store of no blocks: nothing to republish (subscribers refuse one)
        if len(raw) > PART_BLOCKS:
            # Republished in parts, chained, as kvpubd's own stores go out (a batch holds
            # 1024 blocks at most: one engine store of a million went out whole). One that
            # cannot be cut goes on whole, to the checks below.
            parts = in_parts(event, PART_BLOCKS)
            if len(parts) > 1:
                for part in parts:
                    self._stored(part)
                return
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
        lane = (event.group_idx, event.medium)
        number = self._lanes.get(lane)
        if number is None:
            number = self._lanes[lane] = len(self._lanes)
        parent = event.parent_block_hash
        if parent is not None:
            parent = self._hash(parent)
        if hashes is not raw or parent != event.parent_block_hash:
            event = msgspec.structs.replace(event, block_hashes=hashes, parent_block_hash=parent)
        count, blocks = len(hashes), self._blocks
        parent_key = None if parent is None else _key(number, parent)
        if parent_key is not None and parent_key in blocks:
            # Under a parent of another block size (an engine's bug): as under a parent not
            # live, for a chain's blocks all have one size (kvpubd's client refuses others).
            chained = blocks.value(parent_key).block_size == size
        else:
            chained = parent is None or self._parent_live(event, parent)
        if (
            chained
            and len(blocks) + count <= self._max_blocks
            and blocks.add_valued(_keys(number, hashes), event)
        ):
            # All new (the common case): the event goes out as it came.
            self.sink.relayed(event, count)
            return
        self._stored_some(event, number, chained)

    def _parent_live(self, event: BlockStored, parent: BlockHash) -> bool:
        """Whether a store's parent is live in its group on another medium (a copy on
        another tier counts), or need not be (a sliding-window group's)."""
        if (
            event.kv_cache_spec_kind is not None
            and event.kv_cache_spec_kind not in FULL_ATTENTION_KINDS
        ):
            return True
        group, blocks = event.group_idx, self._blocks
        return any(_key(n, parent) in blocks for (g, _), n in self._lanes.items() if g == group)

    def _stored_some(self, event: BlockStored, number: int, chained: bool) -> None:
        """A store some of whose blocks are live already (vLLM republishes the blocks a prefix
        hit reuses), under a parent that is not live, or past max_blocks: its new blocks go
        out as runs."""
        hashes, blocks = event.block_hashes, self._blocks
        run_start: int | None = None
        count = len(blocks)
        seen: set[BlockHash] = set()  # earlier in this store
        for i, block_hash in enumerate(hashes):
            duplicate = _key(number, block_hash) in blocks or block_hash in seen
            if duplicate or not chained or count >= self._max_blocks:
                if duplicate:
                    self.duplicates += 1
                elif not chained:
                    self.orphans += 1
                else:
                    self.over_limit += 1
                chained = duplicate  # the next block hangs under this one
                if run_start is not None:
                    self._publish_run(event, number, run_start, i)
                    run_start = None
                continue
            if run_start is None:
                run_start = i
            seen.add(block_hash)
            count += 1
        if run_start is not None:
            self._publish_run(event, number, run_start, len(hashes))

    def _publish_run(self, event: BlockStored, number: int, start: int, end: int) -> None:
        size, extra, hashes = event.block_size, event.extra_keys, event.block_hashes
        run = plain_store(
            event,
            block_hashes=hashes[start:end],
            parent_block_hash=event.parent_block_hash if start == 0 else hashes[start - 1],
            token_ids=token_list(event.token_ids)[start * size : end * size],
            extra_keys=None if extra is None else extra[start:end],
        )
        added = self._blocks.add_valued(_keys(number, run.block_hashes), run)
        assert added, "a run holds new blocks only"
        self.sink.relayed(run, end - start)

    def _removed(self, lane: Lane, raw: list[BlockHash]) -> None:
        number = self._lanes.get(lane)
        hashes = self._converted(raw)
        if number is None:
            self.unknown_removals += len(hashes)
            return
        # Blocks never stored (or forgotten) are not named.
        named = self._blocks.discard_named(_keys(number, hashes), hashes)
        self.unknown_removals += len(hashes) - len(named)
        if named:
            group, medium = lane
            self.sink.relayed(BlockRemoved(named, medium, group), len(named))

    # -- snapshots ---------------------------------------------------------------------------

    def block_events(self, keys: list[BlockKey]) -> list[BlockStored]:
        """The blocks as one-block stores, each with its chain parent's hash."""
        store_of = self._blocks.value
        events = []
        for key in keys:
            block_hash = key[1] if isinstance(key, tuple) else key
            event = store_of(key)
            tokens, where = self._decode(event)
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

    def _decode(self, event: BlockStored) -> tuple[list[Any], dict[BlockHash, int]]:
        """A store's token ids as a list and its blocks' places, kept for the next call: a
        snapshot (a slice at a time) or an engine's evictions while one is open (a block at
        a time) meet a store's blocks one after the other."""
        decoded = self._decoded
        if decoded is None or decoded[0] is not event:
            where = {h: i for i, h in enumerate(event.block_hashes)}
            decoded = self._decoded = (event, token_list(event.token_ids), where)
        return decoded[1], decoded[2]


def _key(number: int, block_hash: BlockHash) -> BlockKey:
    return block_hash if number == 0 else (number, block_hash)


def _keys(number: int, hashes: list[BlockHash]) -> list[BlockKey]:
    return hashes if number == 0 else [(number, h) for h in hashes]  # type: ignore[return-value]


def plain_store(event: BlockStored, **changes: Any) -> BlockStored:
    """``event`` with ``changes``, as a plain ``BlockStored`` (a ``RelayedStored`` whose token
    ids are replaced by a list is one)."""
    if type(event) is BlockStored:
        return msgspec.structs.replace(event, **changes)
    fields = msgspec.structs.asdict(event)
    fields.update(changes)
    return BlockStored(**fields)


def in_parts(event: BlockStored, blocks: int) -> list[BlockStored]:
    """``event`` as stores of ``blocks`` blocks at most, each under the last block of the one
    before; whole where its tokens are not exactly its blocks' (the relay then skips it) or do
    not decode as integers (they go on as they came)."""
    hashes, size, extra = event.block_hashes, event.block_size, event.extra_keys
    tokens = token_list(event.token_ids)
    if (
        len(tokens) != len(hashes) * size
        or (tokens and tokens[0] is None)
        or (extra is not None and len(extra) != len(hashes))
    ):
        return [event]
    parts: list[BlockStored] = []
    parent = event.parent_block_hash
    for start in range(0, len(hashes), blocks):
        end = min(start + blocks, len(hashes))
        parts.append(
            msgspec.structs.replace(
                event,
                block_hashes=hashes[start:end],
                parent_block_hash=parent,
                token_ids=tokens[start * size : end * size],
                extra_keys=None if extra is None else extra[start:end],
            )
        )
        parent = hashes[end - 1]
    return parts
