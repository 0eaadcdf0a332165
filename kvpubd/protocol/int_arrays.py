"""Request fields that are msgpack arrays of integers (``token_ids``, ``block_ids``), located
in the request frame without decoding them, then decoded a slice at a time.

Decoding a list of a million ints in one step (msgpack, then validation, then NumPy) held the
daemon's loop for a few hundred milliseconds. ``IntArray`` is where the array lies in the
frame; ``IntArrayDecoder`` turns ``DECODE_SLICE`` items per call into an int64 array, so that
the caller can take one slice per loop turn.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import msgspec
import numpy as np

# Items decoded per call (one loop turn): msgpack, a type check and NumPy take well under a
# microsecond per item, so a slice stays near a millisecond.
DECODE_SLICE = 8192
# Bytes an integer takes in msgpack at most (0xcf/0xd3 and 8 bytes).
_MAX_INT_BYTES = 9


def array_header(frame: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """(item count, header bytes) of the msgpack array starting at ``frame[pos]``; None if
    the object there is not an array."""
    first = frame[pos]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, 1
    if first == 0xDC and pos + 3 <= len(frame):
        return int.from_bytes(frame[pos + 1 : pos + 3], "big"), 3
    if first == 0xDD and pos + 5 <= len(frame):
        return int.from_bytes(frame[pos + 1 : pos + 5], "big"), 5
    return None


def bin_span(frame: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """Where the data of the msgpack bin at ``frame[pos]`` lies; None if there is none."""
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(frame[pos])
    if width is None:
        return None
    start = pos + 1 + width
    end = start + int.from_bytes(frame[pos + 1 : start], "big")
    return (start, end) if start <= end <= len(frame) else None


def located(raw: msgspec.Raw) -> bytes | IntArray:
    """The integers of an ``IntList`` field (``control.py``): the data of a bin (packed
    uint32, copied out once), or an array located, not decoded. ValueError for anything else
    (``control_frames`` refuses it first)."""
    view = memoryview(raw)
    header = array_header(view, 0) if view else None
    if header is not None:
        count, size = header
        return IntArray(view, size, len(view), count)
    span = bin_span(view, 0) if view else None
    if span is None:
        raise ValueError("not an array of integers")
    return bytes(view[span[0] : span[1]])


@dataclass(frozen=True, slots=True)
class IntArray:
    """``count`` msgpack items in ``frame[start:end]``, meant to be integers; not decoded."""

    frame: bytes | memoryview
    start: int
    end: int
    count: int

    def __len__(self) -> int:
        return self.count

    def decoder(self, field: str, low: int, high: int) -> IntArrayDecoder:
        return IntArrayDecoder(self, field, low, high)

    def decode(self, field: str, low: int, high: int) -> np.ndarray:
        """All items at once (for arrays of at most ``DECODE_SLICE`` items)."""
        decoder = self.decoder(field, low, high)
        while not decoder.decode_some(DECODE_SLICE):
            pass
        return decoder.result


class IntArrayDecoder:
    """Decodes an ``IntArray`` into an int64 array a slice at a time; ValueError (its message
    names ``field`` and the item) for an item that is not an integer in ``low..high``."""

    def __init__(self, array: IntArray, field: str, low: int, high: int) -> None:
        self._array = array
        self._field = field
        self._low = low
        self._high = high
        self._pos = array.start
        self._done = 0
        self.result = np.empty(array.count, dtype=np.int64)

    @property
    def decoded(self) -> int:
        """Items decoded so far."""
        return self._done

    def decode_some(self, limit: int) -> bool:
        """Decode up to ``limit`` more items; True once all are."""
        array = self._array
        count = min(limit, array.count - self._done)
        if count:
            # The next ``count`` items read as an array of their own: msgpack decodes them in
            # one call, from a window that holds them if they are all integers.
            header = msgpack.Packer().pack_array_header(count)
            window = array.frame[self._pos : min(array.end, self._pos + _MAX_INT_BYTES * count)]
            unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(header) + len(window) + 1)
            unpacker.feed(header)
            unpacker.feed(window)
            try:
                items = unpacker.unpack()
            except Exception:  # an item longer than any integer, or not msgpack
                raise ValueError(
                    f"{self._field}: items from {self._done} on are not all integers"
                ) from None
            self._check_types(items)
            try:
                values = np.array(items, dtype=np.int64)
            except OverflowError:
                values = None
            if values is None or int(values.min()) < self._low or int(values.max()) > self._high:
                bad = next(i for i, item in enumerate(items) if not self._low <= item <= self._high)
                raise ValueError(
                    f"{self._field}.{self._done + bad}: {items[bad]} is not in "
                    f"{self._low}..{self._high}"
                )
            self.result[self._done : self._done + count] = values
            self._done += count
            self._pos += unpacker.tell() - len(header)
        if self._done < array.count:
            return False
        if self._pos != array.end:
            raise ValueError(f"{self._field}: the request goes on after its last item")
        return True

    def _check_types(self, items: list[object]) -> None:
        if set(map(type, items)) <= {int}:
            return
        bad = next(i for i, item in enumerate(items) if type(item) is not int)
        raise ValueError(
            f"{self._field}.{self._done + bad}: not an integer ({type(items[bad]).__name__})"
        )
