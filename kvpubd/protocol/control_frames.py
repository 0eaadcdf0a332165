"""Request frames into the request structs of ``control``, or a ``ProtocolError`` that names
the field. Transport-free.

A small frame (no array in it can be longer than one decode slice) is decoded by msgspec in
one call. A larger one is walked field by field: an integer array (``IntList``) is located,
not decoded, so a list of a million tokens is refused from its header alone when over the
limit, and is never walked past when it is the request's last field; the other fields are
then validated against the same structs.
"""

from __future__ import annotations

import io
from typing import Any, cast

import msgpack
import msgspec

from kvpubd.protocol.control import (
    INT_LIST_FIELDS,
    OPS,
    REQUEST_TYPES,
    Batch,
    Checksum,
    Request,
    Store,
    describe,
)
from kvpubd.protocol.int_arrays import DECODE_SLICE, array_header, bin_span


class ProtocolError(Exception):
    """A request refused before it reached the cache; carries the id when one was readable."""

    def __init__(self, code: str, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# Frames decoded in one msgspec call: fewer bytes than a slice has items, so no array in one
# is longer than a slice (nor worth locating).
ONE_CALL_BYTES = DECODE_SLICE
# Items of any other array or map in a request: nothing honest comes near it, and decoding
# one is then never long.
MAX_OTHER_ITEMS = 4096
# Frames in which an id behind a refused array is still looked for.
PEEK_BEHIND_BYTES = 256 << 10
# Bytes an unpacker reads from the frame at a time.
_READ_BYTES = 64 << 10
# Frames that are not a map are decoded for the error message only when this small.
_DECODE_FOR_MESSAGE_BYTES = 64 << 10
# The key of packed tokens as the client library writes it (a fixstr), and the bin that stands
# in for them while the rest of the request is decoded: 8 bytes that no request needs to hold.
_TOKENS_KEY = b"\xa9token_ids"
_MARK = b"\x00kvpubd\xff"
_STAND_IN = b"\xc4\x08" + _MARK

_decoder = msgspec.msgpack.Decoder(Request)
REQUEST_TYPE_OF: dict[str, Any] = dict(zip(OPS, REQUEST_TYPES, strict=True))
_EXPECTED = {
    "token_ids": "a list of integers or packed uint32 bytes",
    "block_ids": "a list of integers",
}


def parse_request(frame: bytes, max_bytes: int, max_tokens: int) -> Request:
    """Validate one request frame, or raise ProtocolError. Its arrays of integers are kept as
    their msgpack bytes (``IntList``), not decoded; a ``token_ids`` array of more than
    ``max_tokens`` items is refused from its header alone."""
    try:
        return _parse(frame, max_bytes, max_tokens)
    except ProtocolError:
        raise
    except RecursionError:
        # Nested deeper than msgspec goes (it raises this, not a DecodeError); the id is not
        # echoed: it may be what is nested, and would not encode either.
        raise ProtocolError("bad_request", "request is nested too deep") from None


def _parse(frame: bytes, max_bytes: int, max_tokens: int) -> Request:
    if len(frame) > max_bytes:
        raise ProtocolError(
            "too_large", f"request is {len(frame)} bytes; the limit is {max_bytes}", peek_id(frame)
        )
    if len(frame) <= ONE_CALL_BYTES:
        try:
            request = _decoder.decode(frame)
        except msgspec.DecodeError:
            pass  # the walk below says what is wrong, as for a large frame
        else:
            _check_int_lists(request, max_tokens)
            return request
    elif _leading_op(frame) == "batch":
        return _batch(frame, max_tokens)  # one call, refused or not: not decoded, then walked
    else:
        packed = _store_of_packed_tokens(frame)
        if packed is not None:  # a bin: no count to check against max_tokens
            return packed
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
    if op == "batch":
        return _batch(frame, max_tokens, request_id)
    for field in INT_LIST_FIELDS:
        if field in obj and not isinstance(obj[field], msgspec.Raw):
            raise ProtocolError("bad_request", f"{field}: expected {_EXPECTED[field]}", request_id)
    try:
        # To the op's own type: converting to the union costs ~30 us a call.
        converted = cast(Request, msgspec.convert(obj, REQUEST_TYPE_OF[op]))
    except msgspec.ValidationError as exc:
        raise ProtocolError("bad_request", describe(exc), request_id) from None
    _check_int_lists(converted, max_tokens)
    return converted


def _batch(frame: bytes, max_tokens: int, request_id: Any = None) -> Request:
    """A batch, decoded in one call (its token lists lie inside its requests, where the walk
    does not go; the frame's size bounds the call) whatever the order of its keys, or
    ProtocolError naming the field and the batch's id (``request_id``, or looked for). A
    batch larger than ONE_CALL_BYTES that did not lead with its op was walked as any other
    request, its token lists taken for lists of anything: refused, every one."""
    try:
        request = _decoder.decode(frame)
    except msgspec.ValidationError as exc:
        request_id = peek_id(frame) if request_id is None else request_id
        raise ProtocolError("bad_request", describe(exc), request_id) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            "bad_request", f"request is not one msgpack object: {_why(exc)}"
        ) from None
    _check_int_lists(request, max_tokens)
    return request


def _store_of_packed_tokens(frame: bytes) -> Store | None:
    """A store whose packed tokens end the frame, as the client library sends one, decoded in
    one msgspec call (walking the fields cost about 180k instructions a request, 0.7k a
    stored block); None for any other frame, which the walk then reads.

    What comes before the tokens is decoded with a stand-in bin in their place, so the call
    reads at most ``ONE_CALL_BYTES``. It stands for the frame only where the decoder took
    that bin itself as ``token_ids`` (its mark appears nowhere else): everything before it
    was read from the same bytes, and a bin ends where its header says, so the frame is the
    same map with the real bin there."""
    key = frame.find(_TOKENS_KEY, 0, ONE_CALL_BYTES)
    if key < 0:
        return None
    start = key + len(_TOKENS_KEY)
    span = bin_span(frame, start) if start < len(frame) else None
    if span is None or span[1] != len(frame) or frame.find(_MARK, 0, start) >= 0:
        return None
    try:
        request = _decoder.decode(frame[:start] + _STAND_IN)
    except msgspec.DecodeError:
        return None
    if not isinstance(request, Store) or bytes(memoryview(request.token_ids)) != _STAND_IN:
        return None  # that was not the request's token_ids: the walk finds out what is
    return msgspec.structs.replace(request, token_ids=msgspec.Raw(memoryview(frame)[start:]))


def _check_int_lists(request: Request, max_tokens: int) -> None:
    """An ``IntList`` field is an array (``token_ids``: or a bin); ``token_ids`` has at most
    ``max_tokens`` items (in each store of a batch too)."""
    if isinstance(request, Batch):
        for entry in request.requests:
            if isinstance(entry, Store):
                _check_int_lists(entry, max_tokens)
        return
    if isinstance(request, Store):
        field, raw = "token_ids", request.token_ids
    elif isinstance(request, Checksum):
        field, raw = "block_ids", request.block_ids
    else:
        return
    view = memoryview(raw)
    header = array_header(view, 0) if view else None
    if header is None and not (field == "token_ids" and view and bin_span(view, 0)):
        raise ProtocolError("bad_request", f"{field}: expected {_EXPECTED[field]}", request.id)
    if field == "token_ids" and header is not None and header[0] > max_tokens:
        raise ProtocolError(
            "too_large", f"token_ids: {header[0]} tokens; the limit is {max_tokens}", request.id
        )


def _decode_map(frame: bytes, max_tokens: int) -> dict[Any, Any]:
    """The request map, its integer arrays as ``msgspec.Raw`` (their msgpack bytes);
    ProtocolError if it is not one msgpack map."""
    if not frame or not (0x80 <= frame[0] <= 0x8F or frame[0] in (0xDE, 0xDF)):
        raise ProtocolError("bad_request", _not_a_map(frame))
    obj: dict[Any, Any] = {}
    view = memoryview(frame)
    try:
        base = 0  # where the walker started in the frame
        walker = _unpacker(frame, base, MAX_OTHER_ITEMS)
        entries = walker.read_map_header()
        for entry in range(entries):
            key = walker.unpack()
            pos = base + walker.tell()
            if key == "requests":
                # A batch's, with token lists inside: skipped in C here, decoded in one call
                # once the op is known (see _batch), as a batch that leads with its op is.
                base = _end_of_value(frame, pos)
                obj[key] = msgspec.Raw(view[pos:base])
                walker = _unpacker(frame, base, MAX_OTHER_ITEMS)
                continue
            located = array_header(frame, pos) if key in INT_LIST_FIELDS else None
            span = bin_span(frame, pos) if key in INT_LIST_FIELDS else None
            if span is not None:
                # Packed tokens: taken whole (read through the unpacker, a few MB would be
                # copied piecemeal as its buffer grows).
                obj[key] = msgspec.Raw(view[pos : span[1]])
                base = span[1]
                walker = _unpacker(frame, base, MAX_OTHER_ITEMS)
                continue
            if located is None:
                obj[key] = walker.unpack()
                continue
            count, _ = located
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
                obj[key] = msgspec.Raw(view[pos:])
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
            base = _end_of_value(frame, pos)
            obj[key] = msgspec.Raw(view[pos:base])
            walker = _unpacker(frame, base, MAX_OTHER_ITEMS)
        trailing = base + walker.tell() < len(frame)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(
            "bad_request", f"request is not one msgpack object: {_why(exc)}"
        ) from None
    if trailing:
        raise ProtocolError("bad_request", "request is not one msgpack object: extra data")
    return obj


def _end_of_value(frame: bytes, start: int) -> int:
    """Where the msgpack value at ``start`` ends: skipped in C, nothing decoded."""
    skipper = _unpacker(frame, start, None)
    skipper.skip()
    return start + int(skipper.tell())


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


def _not_a_map(frame: bytes) -> str:
    if len(frame) <= _DECODE_FOR_MESSAGE_BYTES:
        try:
            obj = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except Exception as exc:
            return f"request is not one msgpack object: {_why(exc)}"
        return f"request must be a msgpack map, got {type(obj).__name__}"
    return "request must be a msgpack map"


def _leading_op(frame: bytes) -> Any:
    """The op of a request map whose first key is "op" (as clients encode it); None else."""
    if not frame or not 0x80 <= frame[0] <= 0x8F:
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=64, max_str_len=32)
    unpacker.feed(frame[: min(len(frame), 48)])
    try:
        unpacker.read_map_header()
        return unpacker.unpack() == "op" and unpacker.unpack()
    except Exception:
        return None


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


def _why(exc: Exception) -> str:
    """What a decoder said, or its kind where it said nothing (msgpack's for a 0xc1 byte)."""
    return str(exc) or type(exc).__name__
