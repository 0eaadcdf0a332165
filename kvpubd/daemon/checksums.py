"""A ``checksum`` reply put together across loop turns: the pool checksums a slice of the ids
per step (``checksum_steps``), each step in its turn (turns.py), and each slice's sums are
encoded as they come, so neither the pool's bytes nor a long id list hold a reset back. A
reset in between goes first; blocks it freed are checksummed as zeros (scrubbed first), like
any free block."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import numpy as np

from kvpubd.daemon.turns import next_slice


async def checksum_reply(head: bytes, count: int, steps: Iterator[np.ndarray | None]) -> bytes:
    """The reply: ``head`` (the encoded reply up to its ``checksums`` array, see
    ``control.ok_reply_head``), then the ``count`` sums the steps yield, a step at a time,
    each in its turn (turns.py)."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = [head, packer.pack_array_header(count)]
    while True:
        await next_slice()  # before the step: a step is the work
        try:
            sums = next(steps)
        except StopIteration:
            break
        if sums is not None:
            parts.append(_array_items(packer, sums.tolist()))
    return b"".join(parts)


def _array_items(packer: msgpack.Packer, values: list[int]) -> bytes:
    """``values`` packed as array items, without the array's header (parts of a longer one)."""
    packed: bytes = packer.pack(values)
    count = len(values)
    header = 1 if count < 16 else 3 if count < 1 << 16 else 5
    return packed[header:]
