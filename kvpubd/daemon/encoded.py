"""Replies with a large array encoded ahead, a slice at a time.

A store of 62 500 blocks answers with 62 500 block ids; msgpack encodes them at ~40 ns each, a
few milliseconds in the one step that sends the reply. A store done in slices encodes each
slice's ids as it handles them (``EncodedArray``), so the reply is a join of bytes."""

from __future__ import annotations

from typing import Any, cast

import msgpack

from kvpubd.protocol import control

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


def ok_reply(request_id: Any, fields: dict[str, Any]) -> bytes:
    """``{"ok": true, "id": ..., **fields}`` as msgpack; an EncodedArray value goes in as
    it was encoded."""
    if not any(isinstance(value, EncodedArray) for value in fields.values()):
        return control.ok_reply(request_id, **fields)
    items = {"ok": True, "id": request_id, **fields}
    parts = [_packer.pack_map_header(len(items))]
    for key, value in items.items():
        parts.append(_packer.pack(key))
        parts.append(value.encode() if isinstance(value, EncodedArray) else _packer.pack(value))
    return b"".join(parts)
