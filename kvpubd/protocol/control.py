"""The control protocol, declared once: every request and every reply is a ``msgspec.Struct``
here, and the daemon and the client library both encode and decode exactly these.

A request is one msgpack map ``{"op": ..., "id": any?, ...}`` (the request types form a union
tagged on ``op``); the reply is one msgpack map ``{"ok": true, "id": ..., ...}`` (the reply
struct's fields) or ``{"ok": false, "id": ..., "error": {"code", "message"}}``.

Adding an op: its request struct (and, if new, its reply struct) below, its name in
``Request``; then a handler in ``daemon/operations.py`` and the client's call in
``client/replies.py`` (with a method line in each client class). Adding a stats counter: a
field of ``RankStats``, filled in by ``RankPipeline.stats``.

Parsing request frames (locating long integer arrays without decoding them) is
``control_frames.py``'s job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar, get_args

import msgpack
import msgspec

from kvpubd.protocol.wire import Event, event_from_wire

# Limits on what one request may carry: far above any honest client, low enough that no field
# can make a request (or the per-block data it leaves behind) expensive.
MAX_REQUEST_ID_CHARS = 256
MAX_LORA_NAME_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS)] | I64
Rank = Annotated[int, msgspec.Meta(ge=0)]
# A field that is an array of integers, possibly millions long: kept as its msgpack bytes, so
# the daemon can refuse it from its header and decode it a slice per loop turn later (see
# ``int_arrays.located``). ``token_ids`` may also be a bin of packed little-endian uint32.
IntList = msgspec.Raw

# -- requests -------------------------------------------------------------------------------


class ControlRequest(
    msgspec.Struct,
    tag_field="op",
    forbid_unknown_fields=True,
    omit_defaults=True,
    frozen=True,
    kw_only=True,
):
    """Base of the requests: ``op`` is the tag; ``id`` is echoed in the reply."""

    id: Any = None


class Ping(ControlRequest, tag="ping", frozen=True, kw_only=True):
    pass


class Stats(ControlRequest, tag="stats", frozen=True, kw_only=True):
    pass


class Store(ControlRequest, tag="store", frozen=True, kw_only=True):
    request_id: RequestId
    rank: Rank | None = None  # None: the first rank served
    lora_id: I64 | None = None
    lora_name: Annotated[str, msgspec.Meta(max_length=MAX_LORA_NAME_CHARS)] | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # Last: a list longer than one decode slice must be the request's last field (the daemon
    # does not walk past it).
    token_ids: IntList


class Release(ControlRequest, tag="release", frozen=True, kw_only=True):
    request_id: RequestId


class Computed(ControlRequest, tag="computed", frozen=True, kw_only=True):
    """The engine has computed this many tokens of an open request: a hybrid cache's
    sliding-window groups let go of the blocks that fell out of the window (vLLM's
    ``remove_skipped_blocks``); they stay cached until evicted."""

    request_id: RequestId
    num_computed_tokens: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


# What a reset clears: "all" (the pool and the host tier) or "gpu" (the pool alone; the host
# tier keeps its blocks and announces them again after the marker).
ResetTier = Literal["all", "gpu"]


class Reset(ControlRequest, tag="reset", frozen=True, kw_only=True):
    rank: Rank | None = None  # None: every rank
    force: bool = False
    tier: ResetTier = "all"


class Pause(ControlRequest, tag="pause", frozen=True, kw_only=True):
    pass


class Resume(ControlRequest, tag="resume", frozen=True, kw_only=True):
    pass


class Snapshot(ControlRequest, tag="snapshot", frozen=True, kw_only=True):
    rank: Rank | None = None  # None: the first rank served


class PoolInfoRequest(ControlRequest, tag="pool_info", frozen=True, kw_only=True):
    rank: Rank | None = None  # None: the first rank served


class Checksum(ControlRequest, tag="checksum", frozen=True, kw_only=True):
    rank: Rank | None = None  # None: the first rank served
    block_ids: IntList  # last, as token_ids


# Requests one ``batch`` carries at most.
MAX_BATCH_REQUESTS = 256


class Batch(ControlRequest, tag="batch", frozen=True, kw_only=True):
    """Several stores and releases in one message, as an engine has them at a scheduler step:
    each is handled as if sent alone, in order (its own checks, limits and reply), and the
    reply holds their replies in the same order. ``rank``: the rank of every store that names
    none (one naming another rank is refused on its own)."""

    rank: Rank | None = None
    requests: Annotated[list[Store | Release], msgspec.Meta(max_length=MAX_BATCH_REQUESTS)]


Request = (
    Ping
    | Stats
    | Store
    | Computed
    | Release
    | Reset
    | Pause
    | Resume
    | Snapshot
    | PoolInfoRequest
    | Checksum
    | Batch
)
REQUEST_TYPES: tuple[type[ControlRequest], ...] = get_args(Request)
# The op names, in declaration order (for the unknown_op message).
OPS: tuple[str, ...] = tuple(str(cls.__struct_config__.tag) for cls in REQUEST_TYPES)
# Fields that are arrays of integers (``IntList``), by request type.
INT_LIST_FIELDS = ("token_ids", "block_ids")


def op_of(request: ControlRequest) -> str:
    return str(request.__struct_config__.tag)


# -- replies --------------------------------------------------------------------------------

R = TypeVar("R", bound="ControlReply")


class ControlReply(msgspec.Struct, frozen=True):
    """Base of the replies: the fields beside ``ok`` and ``id``. Decoding ignores fields it
    does not know, so a newer daemon that adds some still answers an older client."""

    @classmethod
    def parse(cls: type[R], reply: Mapping[str, Any]) -> R:
        """This reply from a decoded reply map; ControlError ``bad_reply`` if it is not one."""
        return reply_fields(reply, cls, cls.__name__)


class RankEndpoints(msgspec.Struct, frozen=True):
    """Where one rank publishes: its events (PUB), replay and snapshot endpoints as bound
    ("" for none), and the publisher id its batches carry (b"" while snapshots are off)."""

    rank: int
    events: str
    replay: str
    snapshot: str = ""
    publisher_id: bytes = b""


class PingReply(ControlReply, frozen=True):
    version: str
    epoch: int  # changes at every daemon start
    ranks: int  # data-parallel ranks served
    endpoints: list[RankEndpoints]


class GroupStats(msgspec.Struct, frozen=True):
    """One KV cache group's pool and index (the tail blocks of open requests count as
    pinned)."""

    group_idx: int
    kv_cache_spec_kind: str
    blocks_capacity: int
    blocks_free: int
    blocks_cached: int
    blocks_pinned: int
    blocks_published: int


class RankStats(msgspec.Struct, frozen=True):
    """One rank's counters, as ``kvpubd stats`` prints them (in this order)."""

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
    # The run's first seq (events.seq_origin: by default the last run's last seq + 1); 0 from
    # a daemon that does not report it.
    first_seq: int = 0
    # The snapshot protocol (events.snapshot_endpoint): this run's publisher id (b"" while
    # off), the endpoint as bound, requests answered and those answered "unavailable" (-2).
    publisher_id: bytes = b""
    snapshot_endpoint: str = ""
    snapshot_requests: int = 0
    snapshots_unavailable: int = 0
    # Events published by type (BlockStored, BlockRemoved, AllBlocksCleared); only counted
    # where the daemon serves metrics, empty otherwise.
    events_by_type: dict[str, int] = msgspec.field(default_factory=dict)
    # The host tier (cache.host_blocks): its slots, the blocks it holds, and those of them a
    # store under way holds for promotion. All 0 while it is off.
    host_blocks_capacity: int = 0
    host_blocks_cached: int = 0
    host_blocks_held: int = 0
    # Upstream mode (upstream.flavour): what the engine's stream brought, all 0 while off.
    upstream_batches: int = 0
    upstream_replayed: int = 0
    upstream_lost: int = 0
    upstream_restarts: int = 0
    upstream_malformed: int = 0
    upstream_dropped_by_reset: int = 0
    upstream_fences_timed_out: int = 0
    upstream_duplicate_blocks: int = 0
    upstream_unknown_removals: int = 0
    upstream_skipped_blocks: int = 0
    # A hybrid cache's groups (cache.groups), in group order; the blocks_* above are the
    # first full-attention group's. Empty for a cache of one group.
    groups: list[GroupStats] = msgspec.field(default_factory=list)


class StatsReply(ControlReply, frozen=True):
    epoch: int
    paused: bool
    ranks: list[RankStats]


class GroupBlocks(msgspec.Struct, frozen=True):
    """A store's blocks in one KV cache group of a hybrid cache: those of the prompt's blocks
    ``start``.. (the partial tail included). A sliding-window group skips the blocks before
    the window of the cached prefix's end (vLLM's null blocks); the others start at 0."""

    group_idx: int
    start: int
    block_ids: list[int]


class StoreReply(ControlReply, frozen=True, omit_defaults=True):
    rank: int
    block_ids: list[int]  # one per block of the prompt, the partial tail included
    # Prompt tokens the cache already held: on a hybrid cache, the prefix every group holds.
    num_cached_tokens: int
    # A hybrid cache's (cache.groups): every group's blocks, in group order. ``block_ids``
    # are those of the first full-attention group.
    groups: list[GroupBlocks] | None = None


class ReleaseReply(ControlReply, frozen=True):
    rank: int
    released: int  # blocks unpinned


class ComputedReply(ControlReply, frozen=True):
    rank: int
    released: int  # blocks unpinned (those of sliding-window groups past their window)


class Marker(msgspec.Struct, frozen=True):
    """Where a rank's reset marker (``AllBlocksCleared``) went out: the batch ``seq`` (None
    when the daemon holds markers back, ``events.flush_on_reset = false``)."""

    rank: int
    seq: int | None


class ResetReply(ControlReply, frozen=True):
    markers: list[Marker]  # one per rank reset


class BatchReply(ControlReply, frozen=True):
    """Each request's reply map, in the batch's order: ``{"ok": true, "id": ..., ...}`` with
    its op's reply fields, or ``{"ok": false, "id": ..., "error": ...}``."""

    replies: list[dict[str, Any]]


class PauseReply(ControlReply, frozen=True):
    paused: bool  # whether the periodic drain is stopped now


class SnapshotReply(ControlReply, frozen=True):
    """A rank's published cache as one-block ``BlockStored`` events (parents first), exactly
    the state after batch ``seq`` of daemon run ``epoch``. The events travel in the daemon's
    wire format (map or array form); ``decode_reply`` reads either."""

    rank: int
    seq: int
    epoch: int
    events: list[Event]  # last: the daemon streams it


class HostTierInfo(msgspec.Struct, frozen=True):
    """How another process maps a rank's host tier: POSIX shared memory ``name`` holding
    ``shape`` = (host_blocks, block_bytes) bytes, whose blocks' events name ``medium``."""

    name: str
    shape: tuple[int, int]
    dtype: str
    medium: str


class GroupPoolInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """One KV cache group's pool, mapped as ``PoolInfo`` says (same fields)."""

    group_idx: int
    kv_cache_spec_kind: str
    kind: str
    shape: tuple[int, int]
    dtype: str
    block_bytes: int
    sliding_window: int | None = None
    name: str | None = None
    handle: bytes | None = None
    device: int | None = None
    offset: int = 0


class PoolInfo(ControlReply, frozen=True, omit_defaults=True):
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
    # The host tier (cache.host_blocks), where it is on.
    host: HostTierInfo | None = None
    # A hybrid cache's groups (cache.groups), in group order: each group's pool, one of them
    # the one above (the first full-attention group's).
    groups: list[GroupPoolInfo] | None = None


class ChecksumReply(ControlReply, frozen=True):
    rank: int
    checksums: list[int]  # last: the daemon streams it; one 64-bit checksum per block id


# The reply to each request type.
REPLY_TYPES: dict[type[ControlRequest], type[ControlReply]] = {
    Ping: PingReply,
    Stats: StatsReply,
    Store: StoreReply,
    Release: ReleaseReply,
    Computed: ComputedReply,
    Reset: ResetReply,
    Pause: PauseReply,
    Resume: PauseReply,
    Snapshot: SnapshotReply,
    PoolInfoRequest: PoolInfo,
    Checksum: ChecksumReply,
    Batch: BatchReply,
}


class ErrorDetail(msgspec.Struct, frozen=True):
    code: str
    message: str


# -- encoding -------------------------------------------------------------------------------


def _foreign(value: Any) -> Any:
    """Values msgpack-python decoded (an echoed id) that msgspec does not know."""
    if isinstance(value, msgpack.Timestamp):
        return msgspec.msgpack.Ext(-1, value.to_bytes())
    if isinstance(value, msgpack.ExtType):
        return msgspec.msgpack.Ext(value.code, value.data)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_foreign)
_OK_ID = _encoder.encode("ok") + _encoder.encode(True) + _encoder.encode("id")


def int_list(values: Sequence[int]) -> IntList:
    """An ``IntList`` field holding ``values`` as a msgpack array."""
    return msgspec.Raw(_encoder.encode(list(values)))


def packed_uint32(data: bytes) -> IntList:
    """A ``token_ids`` field holding packed little-endian uint32 (the fast form)."""
    return msgspec.Raw(_encoder.encode(data))


def encode_request(request: ControlRequest) -> bytes:
    return _encoder.encode(request)


def _map_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x80 | count,))
    return b"\xde" + count.to_bytes(2, "big")


def ok_reply(request_id: Any, reply: ControlReply) -> bytes:
    """``{"ok": true, "id": request_id, **reply's fields}``."""
    body = _encoder.encode(reply)
    first = body[0]
    # A reply struct has fewer than 16 fields: a fixmap.
    assert 0x80 <= first <= 0x8F, type(reply)
    return b"".join(
        (_map_header((first & 0x0F) + 2), _OK_ID, _encoder.encode(request_id), body[1:])
    )


def ok_reply_head(request_id: Any, reply: ControlReply) -> bytes:
    """The ok reply up to its last field's array items: ``reply``'s last field is an empty
    list, and the caller appends the array header and items it streams."""
    last = reply.__struct_fields__[-1]
    assert getattr(reply, last) == [], (type(reply), last)
    encoded = ok_reply(request_id, reply)
    assert encoded[-1] == 0x90
    return encoded[:-1]


def error_reply(request_id: Any, code: str, message: str) -> bytes:
    """The error reply, echoing ``request_id`` where it encodes (an id of a refused request
    may be nested deeper than msgspec goes: then the reply has none)."""
    try:
        return _encoder.encode({"ok": False, "id": request_id, "error": ErrorDetail(code, message)})
    except (RecursionError, msgspec.EncodeError):
        return _encoder.encode({"ok": False, "id": None, "error": ErrorDetail(code, message)})


# -- decoding replies -----------------------------------------------------------------------


class ControlError(Exception):
    """The daemon refused a request (``code`` is its error code), or answered something this
    side cannot read (code ``bad_reply``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def reply_fields(reply: Mapping[str, Any], reply_type: type[R], op: str) -> R:
    """The typed reply from a decoded ok reply map (extra keys ignored); ControlError
    ``bad_reply`` names what is wrong."""
    convert = _CONVERTERS.get(reply_type, msgspec.convert)
    try:
        return convert(reply, reply_type)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        problem = describe(exc)
    except ValueError as exc:  # an event of a snapshot
        problem = str(exc)
    raise ControlError("bad_reply", f"{op} reply: {problem}")


def _snapshot_reply(reply: Mapping[str, Any], _: object) -> SnapshotReply:
    # The events come in either wire form: each one decoded as a stream subscriber would.
    events = reply.get("events")
    if not isinstance(events, list):
        raise ValueError("events: not a list")
    return msgspec.convert({**reply, "events": list(map(event_from_wire, events))}, SnapshotReply)


_CONVERTERS: dict[type[ControlReply], Callable[[Mapping[str, Any], Any], Any]] = {
    SnapshotReply: _snapshot_reply,
}


def describe(exc: msgspec.ValidationError) -> str:
    """A msgspec validation error as one line that starts with the field: ``rank: ...``."""
    text = str(exc)
    where = ""
    if " - at `$" in text:
        text, _, path = text.rpartition(" - at `$")
        where = path.rstrip("`").lstrip(".").replace("[", ".").replace("]", "")
    for prefix, what in (
        ("Object missing required field `", "field required"),
        ("Object contains unknown field `", "unknown field"),
    ):
        if text.startswith(prefix):
            field = text[len(prefix) :].rstrip("`")
            where, text = ".".join(filter(None, (where, field))), what
    return f"{where or 'request'}: {text}"
