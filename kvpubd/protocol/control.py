"""The control protocol: request models, parsing and replies. Transport-free.

A request is one msgpack map ``{"op": ..., "id": any?, ...}``; the reply is one msgpack map
``{"ok": true, "id": ..., ...}`` or ``{"ok": false, "id": ..., "error": {"code", "message"}}``.
"""

from __future__ import annotations

import io
from typing import Annotated, Any, Literal, cast

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kvpubd.protocol.int_arrays import DECODE_SLICE, IntArray, array_header

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
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, arbitrary_types_allowed=True
    )
    id: Any = None


class Ping(_Request):
    op: Literal["ping"]


class Stats(_Request):
    op: Literal["stats"]


class Store(_Request):
    op: Literal["store"]
    request_id: RequestId
    # A list of ints (located by parse_request, decoded later a slice at a time), or bytes of
    # packed little-endian uint32 (no per-token decoding).
    token_ids: bytes | IntArray
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
    block_ids: IntArray  # decoded a slice at a time


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


def parse_request(frame: bytes, max_bytes: int, max_tokens: int) -> Request:
    """Validate one request frame, or raise ProtocolError. Its arrays of integers are located,
    not decoded (``IntArray``); a ``token_ids`` array of more than ``max_tokens`` items is
    refused from its header alone."""
    if len(frame) > max_bytes:
        raise ProtocolError(
            "too_large", f"request is {len(frame)} bytes; the limit is {max_bytes}", peek_id(frame)
        )
    obj = _decode_map(frame, max_tokens)
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
    for field, packed in (("token_ids", " or packed uint32 bytes"), ("block_ids", "")):
        value = obj.get(field)
        if field in obj and not isinstance(value, IntArray | (bytes if packed else IntArray)):
            raise ProtocolError(
                "bad_request", f"{field}: expected a list of integers{packed}", request_id
            )
    try:
        return _request_adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError("bad_request", describe(exc), request_id) from None


# Fields that are arrays of integers, possibly millions long: located, decoded later.
INT_ARRAY_FIELDS = ("token_ids", "block_ids")
# Items of any other array or map in a request: nothing honest comes near it, and decoding
# one is then never long.
MAX_OTHER_ITEMS = 4096
# Frames in which an id behind a refused array is still looked for.
PEEK_BEHIND_BYTES = 256 << 10
# Bytes an unpacker reads from the frame at a time.
_READ_BYTES = 64 << 10
# Frames that are not a map are decoded for the error message only when this small.
_DECODE_FOR_MESSAGE_BYTES = 64 << 10


def _decode_map(frame: bytes, max_tokens: int) -> dict[Any, Any]:
    """The request map, its integer arrays as ``IntArray``; ProtocolError if it is not one
    msgpack map."""
    if not frame or not (0x80 <= frame[0] <= 0x8F or frame[0] in (0xDE, 0xDF)):
        raise ProtocolError("bad_request", _not_a_map(frame))
    obj: dict[Any, Any] = {}
    try:
        base = 0  # where the walker started in the frame
        walker = _unpacker(frame, base, MAX_OTHER_ITEMS)
        entries = walker.read_map_header()
        for entry in range(entries):
            key = walker.unpack()
            pos = base + walker.tell()
            located = array_header(frame, pos) if key in INT_ARRAY_FIELDS else None
            span = _bin_span(frame, pos) if key in INT_ARRAY_FIELDS else None
            if span is not None:
                # Packed tokens: sliced out of the frame in one copy (read through the
                # unpacker, a few MB would be copied piecemeal as its buffer grows).
                obj[key] = frame[span[0] : span[1]]
                base = span[1]
                walker = _unpacker(frame, base, MAX_OTHER_ITEMS)
                continue
            if located is None:
                obj[key] = walker.unpack()
                continue
            count, header = located
            if key == "token_ids" and count > max_tokens:
                # From the header alone. An id behind the array is looked for only in a
                # small frame: walking past a long array costs a few ns a byte.
                request_id = obj.get("id")
                if "id" not in obj and len(frame) <= PEEK_BEHIND_BYTES:
                    request_id = peek_id(frame)
                raise ProtocolError(
                    "too_large", f"token_ids: {count} tokens; the limit is {max_tokens}", request_id
                )
            if entry == entries - 1:
                # The last entry (where the client library puts it): the array must end the
                # frame, which its decoder checks; nothing to walk past.
                obj[key] = IntArray(frame, pos + header, len(frame), count)
                return obj
            if count > DECODE_SLICE:
                # Walking past it would cost as much as decoding it (a few ns a byte, in
                # one step): a long list goes last, where nothing follows it.
                raise ProtocolError(
                    "bad_request",
                    f"{key}: a list of more than {DECODE_SLICE} items must be the request's "
                    "last field",
                    obj.get("id"),
                )
            # Skipped in C (a short array), then the walk goes on behind it.
            skipper = _unpacker(frame, pos, None)
            skipper.skip()
            end = pos + skipper.tell()
            obj[key] = IntArray(frame, pos + header, end, count)
            base = end
            walker = _unpacker(frame, base, MAX_OTHER_ITEMS)
        trailing = base + walker.tell() < len(frame)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError("bad_request", f"request is not one msgpack object: {exc}") from None
    if trailing:
        raise ProtocolError("bad_request", "request is not one msgpack object: extra data")
    return obj


def _unpacker(frame: bytes, start: int, max_items: int | None) -> msgpack.Unpacker:
    """An unpacker over ``frame`` from byte ``start`` on (its ``tell()`` counts from there).
    It reads the frame as it goes, without copying it whole first: the fields before a long
    array cost what they are, not what the frame is. ``max_items`` bounds every array and map
    it decodes (None: unbounded, for skipping)."""
    stream = io.BytesIO(frame)  # shares the bytes, no copy
    stream.seek(start)
    limits = {} if max_items is None else {"max_array_len": max_items, "max_map_len": max_items}
    return msgpack.Unpacker(
        stream,
        read_size=_READ_BYTES,
        raw=False,
        strict_map_key=False,
        max_buffer_size=len(frame) + _READ_BYTES,
        **limits,
    )


def _bin_span(frame: bytes, pos: int) -> tuple[int, int] | None:
    """Where the data of the msgpack bin at ``frame[pos]`` lies; None if there is none."""
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(frame[pos])
    if width is None:
        return None
    start = pos + 1 + width
    end = start + int.from_bytes(frame[pos + 1 : start], "big")
    return (start, end) if start <= end <= len(frame) else None


def _not_a_map(frame: bytes) -> str:
    if len(frame) <= _DECODE_FOR_MESSAGE_BYTES:
        try:
            obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception as exc:
            return f"request is not one msgpack object: {exc}"
        return f"request must be a msgpack map, got {type(obj).__name__}"
    return "request must be a msgpack map"


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
    return cast(bytes, msgpack.packb({"ok": True, "id": request_id, **fields}, use_bin_type=True))


def error_reply(request_id: Any, code: str, message: str) -> bytes:
    reply: bytes = msgpack.packb(
        {"ok": False, "id": request_id, "error": {"code": code, "message": message}},
        use_bin_type=True,
    )
    return reply
