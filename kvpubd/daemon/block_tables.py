"""Tables with an entry per cached block that no single operation rebuilds at once.

CPython rebuilds a dict's whole hash table in one call when the table fills up, and deletions
fill it as insertions do: a dict under steady churn is rebuilt every few hundred thousand
insertions, in O(entries). Measured on the dev VM at a million entries: 50-150 ms for a dict,
130-220 ms for an OrderedDict, each time holding the loop (a reset waiting behind a store).

- ``ShardedDict`` splits a dict in 256 by a byte of the key, so a rebuild is 1/256 of that
  (0.3 ms at a million entries). Each operation picks its part with one more index: 30-60 ns
  more than on one dict, where the C loops of ``dict.update`` and ``map`` no longer apply.
- ``BlockPositions`` keeps a pool record's log positions in a list indexed by block id:
  nothing is hashed nor rebuilt, and the records that follow one another share it.
- ``LruQueue`` keeps ids in least-recently-used order as a doubly linked list in two lists
  indexed by id (as vLLM's free block queue does): nothing is hashed nor ever rebuilt, and
  clearing is O(1).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, repeat
from operator import and_, itemgetter, lt
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

SHARDS = 256
SHARD_MASK = SHARDS - 1
FREE_STEP = 2000  # entries a retired table lets go of per loop turn (as the reaper's CHUNK)
_LAST_BYTE = itemgetter(-1)


class ShardedDict(Generic[K, V]):
    """A dict in parts by the low byte of each key's hash; ``DigestDict`` takes a byte of the
    key itself, which costs less (hashing a key makes an int object). ``None`` is not a
    value: the lookups of many keys give it for a key that is not here."""

    __slots__ = ("shards",)

    def __init__(self) -> None:
        self.shards: list[dict[K, V]] = [{} for _ in range(SHARDS)]

    floor = 0  # a record's positions in a table of its own start at 0

    def renewed(self, end: int) -> ShardedDict[K, V]:
        """The table of a record that follows one whose positions end at ``end``: a new one
        (this one goes to the reaper with its record)."""
        return type(self)()

    def index(self, key: K) -> int:
        return hash(key) & SHARD_MASK

    def indices(self, keys: Iterable[K]) -> Iterator[int]:
        return map(and_, map(hash, keys), repeat(SHARD_MASK))

    # -- one key -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(map(len, self.shards))  # 256 C calls: for stats, not per block

    def __bool__(self) -> bool:
        return any(self.shards)

    def __contains__(self, key: K) -> bool:
        return key in self.shards[self.index(key)]

    def __getitem__(self, key: K) -> V:
        return self.shards[self.index(key)][key]

    def __delitem__(self, key: K) -> None:
        del self.shards[self.index(key)][key]

    def get(self, key: K) -> V | None:
        return self.shards[self.index(key)].get(key)

    # -- many keys: each key's part found in C, the rest a comprehension (faster here than a
    # chain of maps over dict methods) ----------------------------------------------------------

    def add(self, keys: Sequence[K], values: Iterable[V]) -> None:
        """Set keys that are new (as ``assign``: a table that counts its keys tells)."""
        self.assign(keys, values)

    def assign(self, keys: Sequence[K], values: Iterable[V]) -> None:
        """Set every key to its value, here before or not."""
        shards = self.shards
        for key, index, value in zip(keys, self.indices(keys), values, strict=True):
            shards[index][key] = value

    def add_absent(self, keys: Sequence[K], values: Sequence[V]) -> bool:
        """Add the keys if none is here nor repeats (True), else change nothing (False).
        ``values`` must differ from every value here and from each other (log positions).
        One pass of ``setdefault`` in C: it inserts, or gives the value found."""
        values = list(values)
        parts = map(self.shards.__getitem__, self.indices(keys))
        found = list(map(dict.setdefault, parts, keys, values))
        if found == values:
            return True
        # Undo what this call inserted (a key found here, or repeated, kept another value).
        for key, got, value in zip(keys, found, values, strict=True):
            if got is value:
                del self.shards[self.index(key)][key]
        return False

    def get_many(self, keys: Sequence[K]) -> list[V | None]:
        shards, parts = self.shards, self.indices(keys)
        return [shards[index].get(key) for key, index in zip(keys, parts, strict=True)]

    def found_prefix(self, keys: Sequence[K]) -> list[V]:
        """The values of the keys up to the first that is not here (no lookup past it)."""
        shards, found = self.shards, []
        for key, index in zip(keys, self.indices(keys), strict=True):
            value = shards[index].get(key)
            if value is None:
                break
            found.append(value)
        return found

    def pop_many(self, keys: Sequence[K]) -> list[V | None]:
        """Remove the keys; each one's value, None where it was not here."""
        shards, parts = self.shards, self.indices(keys)
        return [shards[index].pop(key, None) for key, index in zip(keys, parts, strict=True)]

    def pop_some(self, limit: int) -> list[K]:
        """Remove up to ``limit`` keys, any of them; those keys."""
        taken: list[K] = []
        for part in self.shards:
            while part and len(taken) < limit:
                taken.append(part.popitem()[0])
            if len(taken) == limit:
                break
        return taken

    # -- the whole table ---------------------------------------------------------------------

    def __iter__(self) -> Iterator[K]:
        return chain.from_iterable(self.shards)

    def values(self) -> Iterator[V]:
        return chain.from_iterable(map(dict.values, self.shards))

    def free_some(self) -> bool:
        """Let go of up to FREE_STEP entries, whichever parts hold them; True once empty.
        The reaper calls it a loop turn at a time for a retired table: a part at a time
        would free a table of 2000 entries a part (half a million) in one turn, 30 ms."""
        return len(self.pop_some(FREE_STEP)) < FREE_STEP


class DigestDict(ShardedDict[bytes, V]):
    """Keyed by chain digests, in parts by their last byte (a cryptographic hash's output is
    uniform already). Hot loops index ``shards[digest[-1]]`` inline."""

    __slots__ = ()

    def index(self, key: bytes) -> int:
        return key[-1]

    def indices(self, keys: Iterable[bytes]) -> Iterator[int]:
        return map(_LAST_BYTE, keys)


class BlockPositions:
    """Log positions by block id, for the published record of a pool (or a host tier): a
    list indexed by block id, so nothing is hashed, nor ever rebuilt. The successive records
    of one pool share it (``renewed``): a record's positions start above every position an
    earlier one gave, so what an earlier record left reads as absent and a clear is O(1).

    As a table of the record: a block's position or None (``get``); ``get_many`` gives the
    raw slots, which are a current position only where the block is here; the id
    ``capacity`` is never set (a key the record never holds, its stale mark)."""

    __slots__ = ("_count", "_pos", "floor")

    def __init__(self, capacity: int) -> None:
        self._pos = [-1] * (capacity + 1)
        self.floor = 0  # positions below it are absent
        self._count = 0

    @property
    def stale(self) -> int:
        return len(self._pos) - 1

    def renewed(self, floor: int) -> BlockPositions:
        """This table, emptied in O(1) for a record whose positions start at ``floor``."""
        if floor < self.floor:
            raise ValueError("a renewed record's positions must start above the last ones")
        self.floor, self._count = floor, 0
        return self

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block_id: int) -> bool:
        return self._pos[block_id] >= self.floor

    def get(self, block_id: int) -> int | None:
        position = self._pos[block_id]
        return position if position >= self.floor else None

    def __delitem__(self, block_id: int) -> None:
        if self._pos[block_id] < self.floor:
            raise KeyError(block_id)
        self._pos[block_id] = -1
        self._count -= 1

    def add(self, block_ids: Sequence[int], positions: Iterable[int]) -> None:
        """Set the positions of distinct block ids (a store's), counting those not here."""
        slots = map(self._pos.__getitem__, block_ids)
        self._count += list(map(lt, slots, repeat(self.floor))).count(True)
        self.assign(block_ids, positions)

    def assign(self, block_ids: Sequence[int], positions: Iterable[int]) -> None:
        pos = self._pos
        for block_id, position in zip(block_ids, positions, strict=True):
            pos[block_id] = position

    def get_many(self, block_ids: Sequence[int]) -> list[int]:
        return list(map(self._pos.__getitem__, block_ids))

    def pop_many(self, block_ids: Sequence[int]) -> list[int | None]:
        pos, floor, found = self._pos, self.floor, []
        for block_id in block_ids:
            position = pos[block_id]
            pos[block_id] = -1
            found.append(position if position >= floor else None)
        self._count -= len(found) - found.count(None)
        return found

    def reapable(self) -> tuple[()]:
        return ()  # shared with the next record: nothing to free


class LruQueue:
    """Ids ``0 .. capacity-1`` in least-recently-used order, each at most once."""

    __slots__ = ("_end", "_epoch", "_len", "_mark", "_next", "_prev")

    def __init__(self, capacity: int) -> None:
        # Node ``capacity`` is the list's end: its next is the oldest id, its prev the newest.
        self._end = capacity
        self._prev = [capacity] * (capacity + 1)
        self._next = [capacity] * (capacity + 1)
        # An id is queued while its mark is the epoch: clearing starts a new epoch, in O(1).
        self._mark = [0] * capacity
        self._epoch = 1
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, item: int) -> bool:
        return self._mark[item] == self._epoch

    def __iter__(self) -> Iterator[int]:
        """Oldest first (O(n): for tests)."""
        nxt, end = self._next, self._end
        item = nxt[end]
        while item != end:
            yield item
            item = nxt[item]

    def push(self, item: int) -> None:
        """Queue ``item`` as the most recently used (it must not be queued)."""
        prev, end = self._prev, self._end
        newest = prev[end]
        prev[item] = newest
        self._next[item] = end
        self._next[newest] = item
        prev[end] = item
        self._mark[item] = self._epoch
        self._len += 1

    def push_oldest(self, item: int) -> None:
        """Queue ``item`` first in line (it must not be queued)."""
        nxt, end = self._next, self._end
        oldest = nxt[end]
        nxt[item] = oldest
        self._prev[item] = end
        self._prev[oldest] = item
        nxt[end] = item
        self._mark[item] = self._epoch
        self._len += 1

    def discard(self, item: int) -> bool:
        """Take ``item`` out if it is queued."""
        if self._mark[item] != self._epoch:
            return False
        before, after = self._prev[item], self._next[item]
        self._next[before] = after
        self._prev[after] = before
        self._mark[item] = 0
        self._len -= 1
        return True

    def touch(self, item: int) -> None:
        """Make a queued ``item`` the most recently used."""
        if self.discard(item):
            self.push(item)

    def pop_oldest(self) -> int:
        """Take out the least recently used id (IndexError when empty)."""
        if not self._len:
            raise IndexError("pop from an empty LruQueue")
        item = self._next[self._end]
        self.discard(item)
        return item

    def clear(self) -> None:
        """Empty the queue in O(1)."""
        self._epoch += 1
        self._prev[self._end] = self._next[self._end] = self._end
        self._len = 0
