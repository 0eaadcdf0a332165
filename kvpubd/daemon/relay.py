"""One rank's blocks as an unmodified engine publishes them, republished in canonical form.

In upstream mode the engine owns its KV cache and publishes its own events; a follower
(``kvpubd.upstream``) hands them over in order. The relay keeps every block the engine
stored and has not removed, keyed by (group, medium, hash) in the configured hash format, and
captures what routers need into the rank's sink:

- a store of blocks already live is not repeated (vLLM republishes the blocks a prefix hit
  reuses), a removal of blocks never stored is dropped, and a block whose parent is not live
  (on any medium: the engine stored it under a block that a loss, a restart or a reset made
  kvpubd forget) is not published, nor are its descendants: subscribers see a strict stream;
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

import msgspec

from kvpubd.daemon.published import PublishedRecord
from kvpubd.daemon.sink import EventSink
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
Key = tuple[int | None, str | None, BlockHash]  # group_idx, medium, hash


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
        clears_per_block: bool = False,
        clear_timeout: float = 5.0,
    ) -> None:
        self.sink = sink
        # Publishes the marker and clears (the pipeline's, as for a reset without a fence).
        self._on_engine_clear = on_engine_clear
        self._hash = hash_converter(hash_format)
        # The engine turns a reset into per-block removals (no AllBlocksCleared).
        self._clears_per_block = clears_per_block
        self._clear_timeout = clear_timeout
        self.record = PublishedRecord()
        self._id_of: dict[Key, int] = {}
        self._block: dict[int, BlockStored] = {}  # the live block's one-block store, by id
        self._next_id = 0
        # After a reset: None (not fencing), else the deadline and, for per-block engines,
        # the keys the engine must still remove.
        self._fence_until: float | None = None
        self._fenced_keys: set[Key] = set()
        self._keys_at_clear: set[Key] = set()
        self.dropped_by_reset = 0  # engine events dropped as from before its clear
        self.fences_timed_out = 0
        self.duplicates = 0  # blocks stored again while live, not repeated
        self.unknown_removals = 0  # blocks removed that were never stored, not published
        self.orphans = 0  # blocks stored under a parent that is not live, not published
        self._media: set[str | None] = set()  # of the stores so far (where parents may live)

    def __len__(self) -> int:
        return len(self._block)

    # -- what the control socket does -------------------------------------------------------

    def clear(self) -> PublishedRecord:
        """Forget every block (the pipeline publishes the marker); returns the old record."""
        old, self.record = self.record, PublishedRecord()
        self._keys_at_clear = set(self._id_of) if self._clears_per_block else set()
        self._id_of = {}
        self._block = {}
        return old

    def fence(self) -> None:
        """Drop the engine's events from before its own clear (see the module docstring):
        called right after ``clear`` for a reset on the control socket."""
        self._fence_until = time.monotonic() + self._clear_timeout
        self._fenced_keys = self._keys_at_clear

    @property
    def fencing(self) -> bool:
        return self._fence_until is not None

    # -- what the engine publishes -----------------------------------------------------------

    def restart(self, why: str) -> None:
        """The engine restarted, or batches were lost: what it published before is void."""
        log.warning("upstream: %s; publishing AllBlocksCleared", why)
        self._engine_cleared()

    def apply(self, events: list[Event]) -> None:
        """Capture the engine's events of one batch."""
        if self._fence_until is not None and time.monotonic() > self._fence_until:
            log.warning(
                "upstream: the engine did not clear within %.1f s of a reset; following it "
                "again (its blocks from before are not published)",
                self._clear_timeout,
            )
            self.fences_timed_out += 1
            self._end_fence()
        for event in events:
            if self._fence_until is not None:
                self._fenced(event)
            elif isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            else:
                self._engine_cleared()

    def _fenced(self, event: Event) -> None:
        self.dropped_by_reset += 1
        if isinstance(event, AllBlocksCleared) and not self._clears_per_block:
            self._end_fence()  # the engine's clear: what follows is after it
        elif isinstance(event, BlockRemoved) and self._clears_per_block:
            group, medium = event.group_idx, event.medium
            for block_hash in event.block_hashes:
                self._fenced_keys.discard((group, medium, self._hash(block_hash)))
            if not self._fenced_keys:
                self._end_fence()

    def _end_fence(self) -> None:
        self._fence_until = None
        self._fenced_keys = set()

    def _engine_cleared(self) -> None:
        self._on_engine_clear()

    def _stored(self, event: BlockStored) -> None:
        convert, group, medium = self._hash, event.group_idx, event.medium
        hashes = [convert(h) for h in event.block_hashes]
        parent = None if event.parent_block_hash is None else convert(event.parent_block_hash)
        size = event.block_size
        tokens = event.token_ids
        extra = event.extra_keys
        self._media.add(medium)
        above_live = parent is None or self._live(group, parent)
        run_start: int | None = None
        new_ids: list[int] = []
        for i, block_hash in enumerate(hashes):
            key = (group, medium, block_hash)
            above = parent if i == 0 else hashes[i - 1]
            duplicate = key in self._id_of
            # The block above an orphan may still be live on another medium.
            orphan = (
                not duplicate
                and not above_live
                and (i == 0 or not self._live(group, hashes[i - 1]))
            )
            if duplicate or orphan:
                self.duplicates += duplicate
                self.orphans += orphan
                above_live = duplicate
                if run_start is not None:
                    self._publish_run(event, hashes, run_start, i, new_ids, parent)
                    run_start, new_ids = None, []
                continue
            above_live = True
            block_id = self._next_id
            self._next_id += 1
            self._id_of[key] = block_id
            self._block[block_id] = msgspec.structs.replace(
                event,
                block_hashes=[block_hash],
                parent_block_hash=above,
                token_ids=tokens[i * size : (i + 1) * size],
                extra_keys=None if extra is None or extra[i] is None else [extra[i]],
            )
            new_ids.append(block_id)
            if run_start is None:
                run_start = i
        if run_start is not None:
            self._publish_run(event, hashes, run_start, len(hashes), new_ids, parent)

    def _live(self, group: int | None, block_hash: BlockHash) -> bool:
        """Whether the block is live on some medium (a host tier copy may be stored under a
        device block)."""
        return any((group, medium, block_hash) in self._id_of for medium in self._media)

    def _publish_run(
        self,
        event: BlockStored,
        hashes: list[BlockHash],
        start: int,
        end: int,
        ids: list[int],
        parent: BlockHash | None,
    ) -> None:
        size, extra = event.block_size, event.extra_keys
        self.record.add(ids)
        run = msgspec.structs.replace(
            event,
            block_hashes=hashes[start:end],
            parent_block_hash=parent if start == 0 else hashes[start - 1],
            token_ids=event.token_ids[start * size : end * size],
            extra_keys=None if extra is None else extra[start:end],
        )
        self.sink.relayed(run, end - start)

    def _removed(self, event: BlockRemoved) -> None:
        convert, group, medium = self._hash, event.group_idx, event.medium
        ids: list[int] = []
        hashes: list[BlockHash] = []
        for raw in event.block_hashes:
            block_hash = convert(raw)
            block_id = self._id_of.pop((group, medium, block_hash), None)
            if block_id is None:
                self.unknown_removals += 1
                continue
            ids.append(block_id)
            hashes.append(block_hash)
        if ids:
            named = self.record.discard_named(ids, hashes)
            for block_id in ids:
                del self._block[block_id]
            if named:
                removed = BlockRemoved(block_hashes=named, medium=medium, group_idx=group)
                self.sink.relayed(removed, len(named))

    # -- snapshots ---------------------------------------------------------------------------

    def block_events(self, block_ids: list[int]) -> list[BlockStored]:
        return [self._block[block_id] for block_id in block_ids]
