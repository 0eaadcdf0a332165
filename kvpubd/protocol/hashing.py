"""The block hash chain and its wire forms.

``digest_i = H(digest_{i-1} or root_key || token ids of block i)``; token ids are hashed as
little-endian uint32. The root key mixes the LoRA id and the cache salt, so equal prefixes
under another adapter or salt never share blocks. ``H`` is sha256 (32-byte digests), or with
``xxhash`` xxh3_128 (16 bytes), the two hash families vLLM offers for prefix caching.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sized
from hashlib import sha256
from typing import Literal, cast

import msgpack
import numpy as np
from xxhash import xxh3_128_digest

from kvpubd.protocol.wire import BlockHash

HashFormat = Literal["u64", "i64", "bytes"]
HashAlgorithm = Literal["sha256", "xxhash"]
TOKEN_DTYPE = np.dtype("<u4")
MAX_TOKEN_ID = (1 << 32) - 1


@functools.lru_cache(maxsize=4096)  # a few adapters and salts serve most requests
def root_key(
    lora_id: int | None, cache_salt: str | None, algorithm: HashAlgorithm = "sha256"
) -> bytes:
    key = msgpack.packb(["kvpubd-root-v1", lora_id, cache_salt])
    return xxh3_128_digest(key) if algorithm == "xxhash" else sha256(key).digest()


def token_count(token_ids: Sized) -> int:
    """Tokens in packed uint32 bytes, or items in a list of them."""
    return (
        len(token_ids) // TOKEN_DTYPE.itemsize if isinstance(token_ids, bytes) else len(token_ids)
    )


def tokens_array(token_ids: list[int] | bytes) -> np.ndarray:
    """Token ids as a uint32 array; raises ValueError for ids outside 0..2^32-1. ``bytes`` are
    taken as packed little-endian uint32 (the fast form: no per-token decoding)."""
    if isinstance(token_ids, bytes):
        if len(token_ids) % TOKEN_DTYPE.itemsize:
            raise ValueError("as bytes, token ids must be packed little-endian uint32")
        return np.frombuffer(token_ids, dtype=TOKEN_DTYPE)
    arr = np.asarray(token_ids, dtype=np.int64) if token_ids else np.zeros(0, np.int64)
    if arr.ndim != 1:
        raise ValueError("token_ids must be a flat list of integers")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in 0..{MAX_TOKEN_ID}")
    return arr.astype(TOKEN_DTYPE)


def chain_digests(
    tokens: np.ndarray, block_size: int, root: bytes, algorithm: HashAlgorithm = "sha256"
) -> list[bytes]:
    """Digests of every full block of ``tokens`` (uint32), in prefix order; ``root`` is the
    digest the chain hangs from (``root_key`` of the same algorithm, or a block's digest)."""
    full = (len(tokens) // block_size) * block_size
    # Each block's bytes as one item of a void dtype: one C call splits them all (slicing
    # a bytes copy of the tokens in a list comprehension cost more than the xxhash calls).
    whole = np.ascontiguousarray(tokens[:full], dtype=TOKEN_DTYPE)
    blocks: list[bytes] = whole.view(f"V{block_size * TOKEN_DTYPE.itemsize}").tolist()
    digests: list[bytes] = []
    append = digests.append  # locals: these loops run once per block
    prev = root
    if algorithm == "xxhash":
        digest = xxh3_128_digest
        for block in blocks:
            prev = digest(prev + block)
            append(prev)
    else:
        hash_ = sha256
        for block in blocks:
            prev = hash_(prev + block).digest()
            append(prev)
    return digests


def _words(digests: list[bytes]) -> int:
    """64-bit words per digest (4 for sha256, 2 for xxh3_128)."""
    return len(digests[0]) // 8 if digests else 1


def _u64(digests: list[bytes]) -> list[BlockHash]:
    # The digest's last 8 bytes read big-endian (sha256: its low 64 bits).
    words = _words(digests)
    return cast(
        list[BlockHash], np.frombuffer(b"".join(digests), dtype=">u8")[words - 1 :: words].tolist()
    )


def _i64(digests: list[bytes]) -> list[BlockHash]:
    # First 8 bytes, signed.
    words = _words(digests)
    return cast(list[BlockHash], np.frombuffer(b"".join(digests), dtype=">i8")[::words].tolist())


def _raw(digests: list[bytes]) -> list[BlockHash]:
    return list(digests)


WIRE_HASHERS: dict[str, Callable[[list[bytes]], list[BlockHash]]] = {
    "u64": _u64,
    "i64": _i64,
    "bytes": _raw,
}


def wire_hasher(hash_format: HashFormat) -> Callable[[list[bytes]], list[BlockHash]]:
    """The function that turns block digests into their published hashes, all at once."""
    return WIRE_HASHERS[hash_format]
