"""The control replies as small typed objects, and the requests that produce them.

Each op of the control protocol is one ``Call``: the op name, its request fields and the
function that turns the reply map into a typed reply. ``ControlClient`` and
``AsyncControlClient`` run the same calls, so both return exactly these types."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Generic, TypeVar

import numpy as np

from kvpubd.protocol.wire import Event, event_from_wire

T = TypeVar("T")

RequestId = str | int
# A reply map as msgpack decodes it.
ReplyMap = Mapping[str, object]


class ControlError(Exception):
    """The daemon refused a request (``code`` is its error code), or answered something this
    client cannot read (code ``bad_reply``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _bad_reply(op: str, problem: object) -> ControlError:
    return ControlError("bad_reply", f"{op} reply: {problem}")


def _build(cls: Callable[..., T], data: object, op: str) -> T:
    """``cls`` (a dataclass) from the reply map's fields of the same names; extra keys are
    ignored, so a newer daemon that adds fields still answers an older client."""
    if not isinstance(data, Mapping):
        raise _bad_reply(op, f"expected a map, got {type(data).__name__}")
    known = fields(cls)  # type: ignore[arg-type]
    missing = [
        f.name
        for f in known
        if f.name not in data and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise _bad_reply(op, f"missing {', '.join(missing)}")
    return cls(**{f.name: data[f.name] for f in known if f.name in data})


def _build_with_list(
    cls: Callable[..., T], data: ReplyMap, key: str, item: Callable[..., object], op: str
) -> T:
    """``cls`` from the reply map, its ``key`` a list of ``item`` records."""
    items = [_build(item, entry, op) for entry in _items(data, key, op)]
    return _build(cls, {**data, key: items}, op)


def _items(data: ReplyMap, key: str, op: str) -> list[object]:
    value = data.get(key)
    if not isinstance(value, list):
        raise _bad_reply(op, f"{key} is not a list")
    return value


@dataclass(frozen=True, slots=True)
class RankEndpoints:
    """Where one rank publishes: its events (PUB) and replay endpoints as bound."""

    rank: int
    events: str
    replay: str


@dataclass(frozen=True, slots=True)
class PingReply:
    version: str
    epoch: int  # changes at every daemon start
    ranks: int  # data-parallel ranks served
    endpoints: list[RankEndpoints]

    @classmethod
    def parse(cls, data: ReplyMap) -> PingReply:
        return _build_with_list(cls, data, "endpoints", RankEndpoints, "ping")


@dataclass(frozen=True, slots=True)
class RankStats:
    """One rank's counters, as ``kvpubd stats`` prints them."""

    rank: int
    seq: int  # last seq published (first_seq - 1 before the first batch)
    batches_published: int
    events_published: int
    dropped_stored_blocks: int  # stored blocks not published (cap, or a dropped parent)
    resets: int
    replay_requests: int
    replays_refused: int
    blocks_capacity: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    blocks_pinned: int
    blocks_published: int
    requests_open: int
    events_pending: int
    endpoint: str
    replay_endpoint: str
    # The run's first seq (its origin: the clock in microseconds by default); 0 from a daemon
    # that does not report it.
    first_seq: int = 0


@dataclass(frozen=True, slots=True)
class StatsReply:
    epoch: int
    paused: bool
    ranks: list[RankStats]

    @classmethod
    def parse(cls, data: ReplyMap) -> StatsReply:
        return _build_with_list(cls, data, "ranks", RankStats, "stats")


@dataclass(frozen=True, slots=True)
class StoreReply:
    rank: int
    block_ids: list[int]  # one per block of the prompt, the partial tail included
    num_cached_tokens: int  # prompt tokens the cache already held

    @classmethod
    def parse(cls, data: ReplyMap) -> StoreReply:
        return _build(cls, data, "store")


@dataclass(frozen=True, slots=True)
class ReleaseReply:
    rank: int
    released: int  # blocks unpinned

    @classmethod
    def parse(cls, data: ReplyMap) -> ReleaseReply:
        return _build(cls, data, "release")


@dataclass(frozen=True, slots=True)
class Marker:
    """Where a rank's reset marker (``AllBlocksCleared``) went out: the batch ``seq`` (None
    when the daemon holds markers back, ``events.flush_on_reset = false``)."""

    rank: int
    seq: int | None


@dataclass(frozen=True, slots=True)
class ResetReply:
    markers: list[Marker]  # one per rank reset

    @classmethod
    def parse(cls, data: ReplyMap) -> ResetReply:
        return cls([_build(Marker, m, "reset") for m in _items(data, "markers", "reset")])


@dataclass(frozen=True, slots=True)
class PauseReply:
    paused: bool  # whether the periodic drain is stopped now

    @classmethod
    def parse(cls, data: ReplyMap) -> PauseReply:
        return _build(cls, data, "pause")


@dataclass(frozen=True, slots=True)
class SnapshotReply:
    """A rank's published cache as one-block ``BlockStored`` events (parents first), exactly
    the state after batch ``seq`` of daemon run ``epoch``."""

    rank: int
    seq: int
    epoch: int
    events: list[Event]

    @classmethod
    def parse(cls, data: ReplyMap) -> SnapshotReply:
        try:
            events = [event_from_wire(e) for e in _items(data, "events", "snapshot")]
        except (KeyError, TypeError, ValueError) as exc:
            raise _bad_reply("snapshot", exc) from None
        return _build(cls, {**data, "events": events}, "snapshot")


@dataclass(frozen=True, slots=True)
class PoolInfo:
    """How another process maps a rank's pool: ``kind`` ``"shm"`` (POSIX shared memory
    ``name``) or ``"cuda_ipc"`` (CUDA IPC ``handle`` on GPU ``device``, at ``offset``)."""

    rank: int
    kind: str
    shape: tuple[int, int]  # (num_blocks, block_bytes)
    dtype: str
    block_bytes: int
    name: str | None = None
    handle: bytes | None = None
    device: int | None = None
    offset: int = 0

    @classmethod
    def parse(cls, data: ReplyMap) -> PoolInfo:
        shape = data.get("shape")
        if not isinstance(shape, (list, tuple)) or len(shape) != 2:
            raise _bad_reply("pool_info", f"shape {shape!r} is not [blocks, bytes]")
        return _build(cls, {**data, "shape": tuple(shape)}, "pool_info")


@dataclass(frozen=True, slots=True)
class ChecksumReply:
    rank: int
    checksums: list[int]  # one 64-bit checksum per block id asked for

    @classmethod
    def parse(cls, data: ReplyMap) -> ChecksumReply:
        return _build(cls, data, "checksum")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One control request: what to send and how to read its reply."""

    op: str
    fields: dict[str, object]
    parse: Callable[[ReplyMap], T]


# The requests, one function per op (their parameters are the protocol's fields); the control
# clients make each one a method that sends it and returns its typed reply.


def ping() -> Call[PingReply]:
    """The daemon's version, epoch (changes at every start), ranks and endpoints."""
    return Call("ping", {}, PingReply.parse)


def stats() -> Call[StatsReply]:
    """The counters of every rank."""
    return Call("stats", {}, StatsReply.parse)


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
    tokens: list[int] | bytes
    if isinstance(token_ids, np.ndarray):
        tokens = token_ids.astype("<u4").tobytes()  # the fast form: no per-token decoding
    elif isinstance(token_ids, bytes):
        tokens = token_ids
    else:
        tokens = list(token_ids)
    fields: dict[str, object] = {"request_id": request_id}
    for key, value in (
        ("rank", rank),
        ("lora_id", lora_id),
        ("lora_name", lora_name),
        ("cache_salt", cache_salt),
    ):
        if value is not None:
            fields[key] = value
    # Last: a list longer than 8192 tokens must be the request's last field (the daemon
    # decodes it a slice at a time, and does not walk past it).
    fields["token_ids"] = tokens
    return Call("store", fields, StoreReply.parse)


def release(request_id: RequestId) -> Call[ReleaseReply]:
    """Unpin the blocks of a stored request (they stay cached until evicted)."""
    return Call("release", {"request_id": request_id}, ReleaseReply.parse)


def reset(rank: int | None = None, *, force: bool = False) -> Call[ResetReply]:
    """Clear one rank's cache (default: all) and publish AllBlocksCleared at once; ``force``
    drops requests that still pin blocks (otherwise the daemon answers ``busy``)."""
    fields: dict[str, object] = {"force": force}
    if rank is not None:
        fields["rank"] = rank
    return Call("reset", fields, ResetReply.parse)


def pause() -> Call[PauseReply]:
    """Stop the periodic drain (resets and snapshots still publish)."""
    return Call("pause", {}, PauseReply.parse)


def resume() -> Call[PauseReply]:
    """Restart the periodic drain."""
    return Call("resume", {}, PauseReply.parse)


def _on_rank(rank: int | None, **fields: object) -> dict[str, object]:
    """Request fields naming ``rank``; None leaves it out (the daemon's first rank)."""
    return fields if rank is None else {"rank": rank, **fields}


def snapshot(rank: int | None = None) -> Call[SnapshotReply]:
    """The rank's published cache (default: the daemon's first rank), exactly as of its last
    batch (pending events go out first)."""
    return Call("snapshot", _on_rank(rank), SnapshotReply.parse)


def pool_info(rank: int | None = None) -> Call[PoolInfo]:
    """How to map the rank's block pool (``kvpubd.client.map_pool`` does it)."""
    return Call("pool_info", _on_rank(rank), PoolInfo.parse)


def checksum(block_ids: Sequence[int], rank: int | None = None) -> Call[ChecksumReply]:
    """A 64-bit checksum of each block's bytes in the pool."""
    return Call("checksum", _on_rank(rank, block_ids=list(block_ids)), ChecksumReply.parse)
