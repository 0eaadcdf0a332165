"""The control protocol: request models, parsing and replies. Transport-free.

A request is one msgpack map ``{"op": ..., "id": any?, ...}``; the reply is one msgpack map
``{"ok": true, "id": ..., ...}`` or ``{"ok": false, "id": ..., "error": {"code", "message"}}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

# Limits on what one request may carry: far above any honest client, low enough that no field
# can make a request (or the per-block data it leaves behind) expensive.
MAX_REQUEST_ID_CHARS = 256
MAX_LORA_NAME_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
I64 = Annotated[int, Field(ge=-(1 << 63), lt=1 << 63)]

RequestId = Annotated[
    Annotated[str, Field(max_length=MAX_REQUEST_ID_CHARS)] | I64,
    Field(union_mode="left_to_right"),
]
Rank = Annotated[int, Field(ge=0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    id: Any = None


class Ping(_Request):
    op: Literal["ping"]


class Stats(_Request):
    op: Literal["stats"]


class Store(_Request):
    op: Literal["store"]
    request_id: RequestId
    # A list of ints, or bytes of packed little-endian uint32 (no per-token decoding).
    token_ids: list[int] | bytes
    rank: Rank | None = None  # the first rank served
    lora_id: I64 | None = None
    lora_name: Annotated[str, Field(max_length=MAX_LORA_NAME_CHARS)] | None = None
    cache_salt: Annotated[str, Field(max_length=MAX_CACHE_SALT_CHARS)] | None = None


class Release(_Request):
    op: Literal["release"]
    request_id: RequestId


class Reset(_Request):
    op: Literal["reset"]
    rank: Rank | None = None
    force: bool = False


class Pause(_Request):
    op: Literal["pause"]


class Resume(_Request):
    op: Literal["resume"]


class Snapshot(_Request):
    op: Literal["snapshot"]
    rank: Rank | None = None  # the first rank served


class PoolInfo(_Request):
    op: Literal["pool_info"]
    rank: Rank | None = None  # the first rank served


class Checksum(_Request):
    op: Literal["checksum"]
    rank: Rank | None = None  # the first rank served
    block_ids: list[Annotated[int, Field(ge=0)]]


Request = Annotated[
    Ping | Stats | Store | Release | Reset | Pause | Resume | Snapshot | PoolInfo | Checksum,
    Field(discriminator="op"),
]
OPS = (
    "ping",
    "stats",
    "store",
    "release",
    "reset",
    "pause",
    "resume",
    "snapshot",
    "pool_info",
    "checksum",
)
_request_adapter: TypeAdapter[Request] = TypeAdapter(Request)


class ProtocolError(Exception):
    """A request refused before it reached the cache; carries the id when one was readable."""

    def __init__(self, code: str, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


def parse_request(frame: bytes, max_bytes: int) -> Request:
    """Decode and validate one request frame, or raise ProtocolError."""
    if len(frame) > max_bytes:
        raise ProtocolError(
            "too_large", f"request is {len(frame)} bytes; the limit is {max_bytes}", peek_id(frame)
        )
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError("bad_request", f"request is not one msgpack object: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(
            "bad_request", f"request must be a msgpack map, got {type(obj).__name__}"
        )
    request_id = obj.get("id")
    if not all(isinstance(key, str) for key in obj):
        raise ProtocolError("bad_request", "request keys must be strings", request_id)
    op = obj.get("op")
    if op is None:
        raise ProtocolError("bad_request", "request has no 'op'", request_id)
    if op not in OPS:
        raise ProtocolError(
            "unknown_op", f"unknown op {op!r:.64}; known: {', '.join(OPS)}", request_id
        )
    try:
        return _request_adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError("bad_request", describe(exc), request_id) from None


def peek_id(frame: bytes) -> Any:
    """The "id" of a request map without decoding the rest (for refusing oversized ones)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(frame) + 1)
    unpacker.feed(frame)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "id":
                return unpacker.unpack()
            unpacker.skip()
    except Exception:
        pass
    return None


def describe(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    loc = [str(part) for part in first["loc"][1:]]  # drop the union tag
    where = ".".join(loc) or "request"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
    return f"{where}: {message}{more}"


def ok_reply(request_id: Any, **fields: Any) -> bytes:
    return msgpack.packb({"ok": True, "id": request_id, **fields}, use_bin_type=True)


def error_reply(request_id: Any, code: str, message: str) -> bytes:
    return msgpack.packb(
        {"ok": False, "id": request_id, "error": {"code": code, "message": message}},
        use_bin_type=True,
    )
