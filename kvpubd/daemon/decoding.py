"""A request's integer arrays (``protocol/int_arrays.py``) decoded into NumPy, a slice per loop
turn for long ones; an item that is not a valid integer is CacheError ``bad_request``
naming the field and the item."""

from __future__ import annotations

import numpy as np

from kvpubd.daemon.cache import CacheError
from kvpubd.daemon.turns import next_slice
from kvpubd.protocol.hashing import MAX_TOKEN_ID, TOKEN_DTYPE
from kvpubd.protocol.int_arrays import DECODE_SLICE, IntArray, IntArrayDecoder


async def decode_in_slices(decoder: IntArrayDecoder) -> np.ndarray:
    """Every item, ``DECODE_SLICE`` at a time, each slice in its turn (turns.py)."""
    while True:
        await next_slice()
        if _decode_some(decoder):
            return decoder.result


def decode_tokens(tokens: IntArray) -> np.ndarray:
    """Token ids at once, as uint32 (for lists of at most ``DECODE_SLICE``)."""
    decoder = _token_decoder(tokens)
    while not _decode_some(decoder):
        pass
    return decoder.result.astype(TOKEN_DTYPE)


async def decode_tokens_in_slices(tokens: IntArray) -> np.ndarray:
    """Token ids as uint32, ``DECODE_SLICE`` per loop turn."""
    return (await decode_in_slices(_token_decoder(tokens))).astype(TOKEN_DTYPE)


def _token_decoder(tokens: IntArray) -> IntArrayDecoder:
    return tokens.decoder("token_ids", 0, MAX_TOKEN_ID)


def _decode_some(decoder: IntArrayDecoder) -> bool:
    try:
        return decoder.decode_some(DECODE_SLICE)
    except ValueError as exc:
        raise CacheError("bad_request", str(exc)) from None
