"""The record of which blocks a rank has published and not removed, in publication order, with
frozen views that cost O(1) to take.

Routers rely on it: a removal is published only for a published block, a store only under a
published parent. Snapshots read it: a frozen view is the published state at one seq, read a
slice at a time across loop turns while the cache goes on changing.

The order is an append-only log of block ids; ``_entry[b]`` is the log position of block
``b``'s current publication, so a log entry is current iff ``_entry.get(log[p]) == p``. A view
taken at log length ``end`` sees entries ``p < end`` that were current then: still current
now, or removed since, in which case the view saved the block's data when it was removed
(``capture``), before its slot could be reused.

Stale entries go a slice at a time while no view is open. A block removed with no view open is
marked stale in place (with a key the record never holds: None, or the pool's capacity for
block ids). Blocks mostly go oldest first (an engine's or the pool's eviction), so stale
entries gather at the front of the log: they are trimmed there first, the few current ones
among them moved to the end of the slice, nothing else renumbered (positions count from the
log's first entry ever, ``_base`` being that of ``_log[0]``). Once the trimmed
front is half the log, what follows it is copied to a new log, positions kept. Only when stale
entries are left in the middle is the log compacted: its current entries copied to a new log
and renumbered from the first position they can take (positions only ever grow). Every step
is a slice (COMPACT_STEP entries) and an old log goes to the reaper: a million entries moved
or freed at once would hold the loop for milliseconds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from itertools import compress, repeat
from operator import eq, sub
from typing import Any, Generic, Protocol, TypeVar, cast

from kvpubd.daemon.block_tables import ShardedDict

T = TypeVar("T")
# A block's id: the pool's slot number; the relay keys its blocks by the engine's hashes.
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
KC = TypeVar("KC", contravariant=True)  # a table's key, as the record hands it in

COMPACT_SLACK = 4096  # stale log entries tolerated beyond the live count before compacting
# Log entries trimmed or compacted per call: about a millisecond where each is looked up in a
# million-entry dict of scattered keys (the relay's hashes), far less where it is marked stale.
COMPACT_STEP = 4096


class PositionTable(Protocol[KC]):
    """What a record keeps its blocks' log positions in (block_tables.py): a ShardedDict of
    any keys, or BlockPositions of a pool's block ids. ``floor``: where the record's
    positions start; ``renewed(end)``: the empty table of the record that follows one whose
    positions end at ``end`` (BlockPositions: itself, shared)."""

    @property
    def floor(self) -> int: ...
    def renewed(self, end: int) -> PositionTable[KC]: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: KC) -> bool: ...
    def __delitem__(self, key: KC) -> None: ...
    def get(self, key: KC) -> int | None: ...
    def add(self, keys: Sequence[KC], values: Iterable[int]) -> None: ...
    def assign(self, keys: Sequence[KC], values: Iterable[int]) -> None: ...
    def get_many(self, keys: Sequence[KC]) -> Sequence[int | None]: ...
    def pop_many(self, keys: Sequence[KC]) -> list[int | None]: ...


class FrozenView(Generic[K]):
    """The published blocks at the moment the view was taken. ``capture(block_id)`` is called
    for a block removed while the view is open, before any of its data can be overwritten."""

    def __init__(self, record: PublishedRecord[K], capture: Callable[[K], Any]) -> None:
        # Nothing is trimmed nor compacted while a view is open: the log's base is fixed.
        self.record = record
        self.end = record._base + len(record._log)
        self.count = len(record)
        self.cursor = record._base + record._head
        self.saved: dict[int, Any] = {}  # log position -> data captured at removal
        self._capture = capture
        self.open = True

    def removed(self, position: int, block_id: K) -> None:
        if self.cursor <= position < self.end:
            self.saved[position] = self._capture(block_id)

    def take(self, limit: int) -> Iterator[tuple[K, Any]]:
        """The next blocks of the view in publication order: (block id, data saved at
        removal, or None while the block is still live). Up to ``limit`` log entries."""
        log, entry, saved = self.record._log, self.record._entry, self.saved
        base = self.record._base
        start = self.cursor
        stop = min(self.end, start + limit)
        self.cursor = stop
        for position in range(start, stop):
            block_id: Any = log[position - base]  # the stale mark where trimmed: never current
            if entry.get(block_id) == position:
                yield block_id, None
            elif position in saved:
                yield block_id, saved.pop(position)

    @property
    def finished(self) -> bool:
        return self.cursor >= self.end

    def close(self) -> None:
        if self.open:
            self.open = False
            self.record._views.remove(self)


class PublishedRecord(Generic[K]):
    def __init__(self, entries: PositionTable[K] | None = None, stale: Any = None) -> None:
        # Not one dict: a dict under churn is rebuilt at once, milliseconds per 100k entries.
        # ``entries``: an empty table (BlockPositions: a pool's block ids, no hashing).
        self._entry: PositionTable[K] = ShardedDict() if entries is None else entries
        # Marks a log entry stale: a key never held, that ``entries`` can look up.
        self._stale = stale
        # Trimmed entries are stale until the log is copied past them.
        self._log: list[Any] = []
        # The position of _log[0]. Positions only grow, also across compactions, and a
        # successor's start above its predecessor's (BlockPositions relies on both).
        self._base = self._entry.floor
        self._head = 0  # _log[:_head] is trimmed
        self._views: list[FrozenView[K]] = []
        # Compaction in progress: the new log, the position of its first entry, and how far
        # the old one has been read; renumbering (holes left) or copying (a trimmed front).
        self._new_log: list[Any] | None = None
        self._new_base = 0
        self._read = 0
        self._renumber = True

    def __contains__(self, block_id: K) -> bool:
        return block_id in self._entry

    def __len__(self) -> int:
        return len(self._entry)

    def __iter__(self) -> Iterator[K]:
        """Live blocks in publication order (O(log); for tests and small tools)."""
        entry, base, log = self._entry, self._base, cast(list[K], self._log)
        return (b for i, b in enumerate(log) if entry.get(b) == base + i)  # stale: never current

    def add(self, block_ids: Sequence[K]) -> None:
        log = self._log
        position = self._base + len(log)
        self._entry.add(block_ids, range(position, position + len(block_ids)))
        log.extend(block_ids)

    def discard(self, block_id: K) -> bool:
        """Forget a published block; False when it was not published."""
        position = self._entry.get(block_id)
        if position is None:
            return False
        for view in self._views:  # while the block is still here to capture
            view.removed(position, block_id)
        del self._entry[block_id]
        return True

    def discard_named(self, block_ids: Sequence[K], names: list[T]) -> list[T]:
        """Forget the published ones of ``block_ids``; the ``names`` of those (same order)."""
        if self._views:
            discard = self.discard
            return [
                name for block_id, name in zip(block_ids, names, strict=True) if discard(block_id)
            ]
        # No view to tell: ``names`` itself when all were published.
        found: list[Any] = self._entry.pop_many(block_ids)
        if None in found:
            names = [
                name for position, name in zip(found, names, strict=True) if position is not None
            ]
            found = [position for position in found if position is not None]
        if self._new_log is None:
            # Marked stale where they stand: trimming and compaction then pass them without
            # looking each up (a miss in a large dict of scattered keys costs about 0.3 us).
            log, base = self._log, self._base
            deque(map(log.__setitem__, map(sub, found, repeat(base)), repeat(self._stale)), 0)
        return names

    def freeze(self, capture: Callable[[K], Any]) -> FrozenView[K] | None:
        """A view of the blocks published now, or None while a compaction is under way
        (``compact_some`` finishes it; ask again on a later turn)."""
        if self._new_log is not None:
            return None
        view = FrozenView(self, capture)
        self._views.append(view)
        return view

    @property
    def needs_compaction(self) -> bool:
        return self._new_log is not None or (
            not self._views and len(self._log) - self._head > 2 * len(self) + COMPACT_SLACK
        )

    def compact_some(
        self, step: int = COMPACT_STEP, retire: Callable[..., None] | None = None
    ) -> bool:
        """Trim or compact up to ``step`` log entries; True when done. Blocks published
        meanwhile are appended to the log and moved with the rest. ``retire``: takes a whole
        old log to free it a slice at a time (the reaper)."""
        if self._new_log is None:
            if self._views:
                return True
            more = self._trim_front(step)
            head = self._head
            if head > COMPACT_SLACK and head >= len(self._log) // 2:
                # Half the log is a trimmed front: copy what follows it to a new log, a
                # slice at a time, positions kept (cutting it off in place is one memmove
                # of the whole log, milliseconds at a million entries).
                self._new_log, self._read, self._renumber = [], head, False
                self._new_base = self._base + head
            elif more or not self.needs_compaction:
                return not more and not self.needs_compaction
            else:
                self._new_log, self._read, self._renumber = [], head, True
                self._new_base = self._base + head
        new_log, log, entry, base = self._new_log, self._log, self._entry, self._base
        start, stop = self._read, min(len(log), self._read + step)
        chunk: list[Any] = log[start:stop]
        if self._renumber:
            # The current entries of the slice, renumbered in order behind those kept before.
            current = self._current(chunk, base + start)
            kept = list(compress(chunk, current))
            first = self._new_base + len(new_log)
            entry.assign(kept, range(first, first + len(kept)))
            new_log += kept
            self._moved(start, stop, current)
        else:
            new_log += chunk
            self._moved(start, stop, None)
        self._read = stop
        if stop < len(log):
            return False
        self._log, self._new_log, self._base, self._head = new_log, None, self._new_base, 0
        old = self._moved_all()
        if retire is not None:
            retire(log, *old)
        return not self.needs_compaction  # a copied log may still have holes

    def _trim_front(self, step: int) -> bool:
        """Trim the front of the log, ``step`` entries at most, while it is mostly stale: its
        few current entries (a prefix every prompt shares, published early and never evicted)
        move to the end of the slice, renumbered in order, and the rest is trimmed, its
        objects freed here. True when the whole slice was taken (more may follow)."""
        log, entry, head = self._log, self._entry, self._head
        chunk: list[Any] = log[head : head + step]
        if not chunk:
            return False
        first = self._base + head
        if chunk.count(self._stale) == len(chunk):  # all stale (the common case): no lookups
            current: list[bool] = []
            kept: list[Any] = []
        else:
            current = self._current(chunk, first)
            kept = list(compress(chunk, current))
            if len(kept) * 4 > len(chunk):
                return False  # the front is mostly current: compaction's work, if any
        end = head + len(chunk)
        start = end - len(kept)  # the new head
        log[head:end] = [*repeat(self._stale, start - head), *kept]
        entry.assign(kept, range(self._base + start, self._base + end))
        self._trimmed(head, end, current)
        self._head = start
        return True

    def _current(self, chunk: list[Any], first: int) -> list[bool]:
        """Which of the log entries ``chunk``, from position ``first`` on, are current (paid
        again for every block a busy rank stores)."""
        return list(map(eq, self._entry.get_many(chunk), range(first, first + len(chunk))))

    def _trimmed(self, head: int, end: int, current: list[bool]) -> None:
        """The log's entries from ``head`` to ``end`` were trimmed, the ``current`` ones moved
        to the end of that span (for a subclass that keeps more per entry)."""

    def _moved(self, start: int, stop: int, current: list[bool] | None) -> None:
        """Compaction moved the ``current`` entries of log[start:stop] (None: all of them;
        for a subclass that keeps more per entry)."""

    def _moved_all(self) -> tuple[Any, ...]:
        """Compaction finished: the new log is the log. Returns what the old log had beside
        it (for the reaper)."""
        return ()

    def successor(self) -> PublishedRecord[K]:
        """An empty record to follow this one after a clear, in O(1) (its table, when shared,
        renewed: this record is not read any more)."""
        end = self._base + len(self._log)  # above every position given (see _base)
        return PublishedRecord(self._entry.renewed(end), self._stale)

    def close_views(self) -> None:
        for view in list(self._views):
            view.close()

    def reapable(self) -> tuple[Any, ...]:
        """The containers the reaper frees piecemeal once this record is retired."""
        self.close_views()
        return (self._entry, self._log, self._new_log or [])


class ValuedRecord(PublishedRecord[K], Generic[K, V]):
    """A record that also keeps a value with each block, found by the block's id: the
    relay's, whose blocks have no object of their own, keeps the store that published each.
    Blocks are published through ``add_valued`` only."""

    def __init__(self) -> None:
        self._keyed: ShardedDict[K, int] = ShardedDict()
        super().__init__(self._keyed)
        # Live blocks, counted here: a ShardedDict's len asks each of its parts.
        self._count = 0
        self._values: list[V | None] = []  # aligned with the log
        self._new_values: list[V | None] = []  # the new log's, while a compaction is under way

    def add_valued(self, block_ids: Sequence[K], value: V) -> bool:
        """Publish blocks, all with ``value``, if none is published already nor repeats
        (True); else change nothing (False)."""
        count, position = len(block_ids), self._base + len(self._log)
        if not self._keyed.add_absent(block_ids, range(position, position + count)):
            return False
        self._count += count
        self._log.extend(block_ids)
        self._values.extend(repeat(value, count))
        return True

    def successor(self) -> ValuedRecord[K, V]:
        return ValuedRecord()

    def value(self, block_id: K) -> V:
        position = self._keyed[block_id]
        # While a compaction is under way, an entry it moved lies in the new log (whose first
        # position is _new_base); one it has not, past where it has read, in the old.
        moved = position - self._new_base
        if self._new_log is not None and moved < len(self._new_log):
            return cast(V, self._new_values[moved])  # a live block's: never trimmed
        return cast(V, self._values[position - self._base])

    def __len__(self) -> int:
        return self._count

    def discard(self, block_id: K) -> bool:
        found = super().discard(block_id)
        self._count -= found
        return found

    def discard_named(self, block_ids: Sequence[K], names: list[T]) -> list[T]:
        if self._views:  # one ``discard`` at a time, counted there
            return super().discard_named(block_ids, names)
        named = super().discard_named(block_ids, names)
        self._count -= len(named)
        return named

    def forget(self, block_ids: Sequence[K]) -> None:
        """Drop blocks without telling views (a record no snapshot reads any more)."""
        found = self._entry.pop_many(block_ids)
        self._count -= len(found) - found.count(None)

    def _moved(self, start: int, stop: int, current: list[bool] | None) -> None:
        values = self._values[start:stop]
        self._new_values += values if current is None else compress(values, current)

    def _moved_all(self) -> tuple[Any, ...]:
        old = self._values
        self._values, self._new_values = self._new_values, []
        return (old,)

    def _trimmed(self, head: int, end: int, current: list[bool]) -> None:
        values = self._values
        kept = list(compress(values[head:end], current))
        values[head:end] = [*repeat(None, end - head - len(kept)), *kept]

    def reapable(self) -> tuple[Any, ...]:
        return (*super().reapable(), self._values, self._new_values)
