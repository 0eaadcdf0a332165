"""Replies with a large array encoded ahead, a slice at a time.

A store of 62 500 blocks answers with 62 500 block ids; msgpack encodes them at ~40 ns each, a
few milliseconds in the one step that sends the reply. A store done in slices encodes each
slice's ids as it handles them (``EncodedArray``), so the reply is a join of bytes."""

from __future__ import annotations

from typing import cast

import msgpack
import msgspec

_packer = msgpack.Packer(use_bin_type=True)


def _header_size(count: int) -> int:
    """Bytes of a msgpack array header for ``count`` items (fixarray, array 16, array 32)."""
    return 1 if count < 16 else 3 if count < 1 << 16 else 5


class EncodedArray:
    """A msgpack array of ints, encoded as items are added."""

    __slots__ = ("_parts", "count")

    def __init__(self) -> None:
        self.count = 0
        self._parts: list[bytes] = []

    def extend(self, items: list[int]) -> None:
        if items:
            packed = msgpack.packb(items)
            self._parts.append(packed[_header_size(len(items)) :])
            self.count += len(items)

    def encode(self) -> bytes:
        return cast(bytes, _packer.pack_array_header(self.count)) + b"".join(self._parts)

    def decode(self) -> list[int]:
        """The items (for tests and logs; replies use ``encode``)."""
        items: list[int] = msgpack.unpackb(self.encode())
        return items


def reply_ids(ids: list[int] | EncodedArray) -> list[int]:
    """Block ids for a ``StoreReply``: an EncodedArray goes in as it was encoded (msgspec
    writes a ``Raw`` as is), so the reply's encoding is a join of bytes. Only encoding reads
    the reply, so the Raw standing in for the list is never seen as one."""
    if isinstance(ids, EncodedArray):
        return cast(list[int], msgspec.Raw(ids.encode()))
    return ids
