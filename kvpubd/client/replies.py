"""The control requests the clients send, and the typed replies they return.

Requests and replies are the protocol's own structs (``kvpubd.protocol.control``), the ones
the daemon decodes and encodes. Each op is one ``Call``: the request and the reply type.
``ControlClient`` and ``AsyncControlClient`` run the same calls, so both return exactly these
types."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from kvpubd.protocol.control import (
    Batch,
    BatchReply,
    Checksum,
    ChecksumReply,
    Computed,
    ComputedReply,
    ControlError,
    ControlReply,
    ControlRequest,
    HostTierInfo,
    Marker,
    Pause,
    PauseReply,
    Ping,
    PingReply,
    PoolInfo,
    PoolInfoRequest,
    RankEndpoints,
    RankStats,
    Release,
    ReleaseReply,
    Reset,
    ResetReply,
    ResetTier,
    Resume,
    Snapshot,
    SnapshotReply,
    Stats,
    StatsReply,
    Store,
    StoreReply,
    int_list,
    packed_uint32,
)
from kvpubd.protocol.hashing import MAX_TOKEN_ID

__all__ = [
    "BatchReply",
    "Call",
    "ChecksumReply",
    "ComputedReply",
    "ControlError",
    "HostTierInfo",
    "Marker",
    "PauseReply",
    "PingReply",
    "PoolInfo",
    "RankEndpoints",
    "RankStats",
    "ReleaseReply",
    "ResetReply",
    "SnapshotReply",
    "StatsReply",
    "StoreReply",
]

T = TypeVar("T", bound=ControlReply)

RequestId = str | int


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One control request and the type of its reply (its ``id`` is set when sent)."""

    request: ControlRequest
    reply: type[T]


# The requests, one function per op (their parameters are the protocol's fields); the control
# clients make each one a method that sends it and returns its typed reply.


def ping() -> Call[PingReply]:
    """The daemon's version, epoch (changes at every start), ranks and endpoints."""
    return Call(Ping(), PingReply)


def stats() -> Call[StatsReply]:
    """The counters of every rank."""
    return Call(Stats(), StatsReply)


def store_request(
    request_id: RequestId,
    token_ids: Sequence[int] | np.ndarray | bytes,
    *,
    rank: int | None = None,
    lora_id: int | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> Store:
    """A ``store`` as ``batch`` takes it (``store``'s parameters). A NumPy array of token ids
    travels as packed uint32 bytes (the fast form)."""
    if isinstance(token_ids, np.ndarray):
        # The fast form: no per-token decoding.
        tokens = packed_uint32(_uint32_bytes(token_ids))
    elif isinstance(token_ids, bytes):
        tokens = packed_uint32(token_ids)
    else:
        tokens = int_list(token_ids)
    return Store(
        request_id=request_id,
        rank=rank,
        lora_id=lora_id,
        lora_name=lora_name,
        cache_salt=cache_salt,
        token_ids=tokens,
    )


def _uint32_bytes(tokens: np.ndarray) -> bytes:
    """The array's token ids packed as little-endian uint32; ValueError where a cast would
    change one (a float, or an id out of range, wrapped silently: another prompt's blocks)."""
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(
            f"token_ids: an array of token ids must be flat, of an integer dtype, "
            f"not {tokens.ndim}-dimensional {tokens.dtype}"
        )
    if tokens.size and not (tokens.dtype.kind == "u" and tokens.dtype.itemsize <= 4):
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high > MAX_TOKEN_ID:
            raise ValueError(f"token_ids: {low if low < 0 else high} is not in 0..{MAX_TOKEN_ID}")
    return tokens.astype("<u4").tobytes()


def release_request(request_id: RequestId) -> Release:
    """A ``release`` as ``batch`` takes it."""
    return Release(request_id=request_id)


def batch(requests: Sequence[Store | Release], rank: int | None = None) -> Call[BatchReply]:
    """Several stores and releases in one message (``store_request``, ``release_request``;
    at most 256), each handled as if sent alone, in order; ``rank`` is that of every store
    naming none. The reply's ``replies`` are their reply maps in the same order: ``ok`` true
    with the op's fields (``block_ids``, ``num_cached_tokens`` of a store, ``released`` of a
    release), or false with the ``error``. Store tokens as NumPy arrays or packed bytes: they
    travel as they are."""
    return Call(Batch(rank=rank, requests=list(requests)), BatchReply)


def store(
    request_id: RequestId,
    token_ids: Sequence[int] | np.ndarray | bytes,
    *,
    rank: int | None = None,
    lora_id: int | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> Call[StoreReply]:
    """Store a prompt on ``rank`` (default: the daemon's first rank) and pin its blocks until
    ``release(request_id)``. The longest cached prefix is reused; ``lora_id``/``lora_name``
    and ``cache_salt`` separate prompts that must not share blocks. A NumPy array of token ids
    travels as packed uint32 bytes (the fast form)."""
    request = store_request(
        request_id,
        token_ids,
        rank=rank,
        lora_id=lora_id,
        lora_name=lora_name,
        cache_salt=cache_salt,
    )
    return Call(request, StoreReply)


def release(request_id: RequestId) -> Call[ReleaseReply]:
    """Unpin the blocks of a stored request (they stay cached until evicted)."""
    return Call(Release(request_id=request_id), ReleaseReply)


def computed(request_id: RequestId, num_computed_tokens: int) -> Call[ComputedReply]:
    """Say that ``num_computed_tokens`` of a stored request are computed: on a hybrid cache,
    its sliding-window groups unpin the blocks now out of their window (they stay cached
    until evicted); elsewhere nothing changes."""
    request = Computed(request_id=request_id, num_computed_tokens=num_computed_tokens)
    return Call(request, ComputedReply)


def reset(
    rank: int | None = None, *, force: bool = False, tier: ResetTier = "all"
) -> Call[ResetReply]:
    """Clear one rank's cache (default: all) and publish AllBlocksCleared at once; ``force``
    drops requests that still pin blocks (otherwise the daemon answers ``busy``); ``tier``
    "gpu" clears the pool alone and keeps the host tier's blocks."""
    return Call(Reset(rank=rank, force=force, tier=tier), ResetReply)


def pause() -> Call[PauseReply]:
    """Stop the periodic drain (resets and snapshots still publish)."""
    return Call(Pause(), PauseReply)


def resume() -> Call[PauseReply]:
    """Restart the periodic drain."""
    return Call(Resume(), PauseReply)


def snapshot(rank: int | None = None) -> Call[SnapshotReply]:
    """The rank's published cache (default: the daemon's first rank), exactly as of its last
    batch (pending events go out first)."""
    return Call(Snapshot(rank=rank), SnapshotReply)


def pool_info(rank: int | None = None) -> Call[PoolInfo]:
    """How to map the rank's block pool (``kvpubd.client.map_pool`` does it)."""
    return Call(PoolInfoRequest(rank=rank), PoolInfo)


def checksum(block_ids: Sequence[int], rank: int | None = None) -> Call[ChecksumReply]:
    """A 64-bit checksum of each block's bytes in the pool."""
    return Call(Checksum(rank=rank, block_ids=int_list(block_ids)), ChecksumReply)
