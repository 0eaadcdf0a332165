"""KV-cache event types and their wire encoding (vLLM's format), declared once.

Live message: 3 frames ``[topic, seq, payload]``; ``seq`` is 8-byte big-endian and the
payload is the msgpack array ``[ts, events, data_parallel_rank]``, or, from a publisher that
serves snapshots (vLLM's snapshot protocol), ``[ts, events, data_parallel_rank, publisher_id]``
with the 16-byte id of the publisher's lifetime (``PUBLISHER_ID_BYTES``).

Each event type is a tagged ``msgspec.Struct``, as in vLLM's ``kv_events.py``: the struct is
its own codec. The map form (vLLM >= 0.24) is the struct itself: ``type`` plus the fields,
the required ones always present (nil where empty), the optional ones omitted while unset.
The array form (vLLM <= 0.23) is the tag followed by every field in declaration order, nils
included, up to the last field both forms share; fields declared after it (``MAP_ONLY``)
travel only in maps. The array decoders are twins generated from the same declarations.
Adding a field is one line in one class.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections import deque
from typing import Annotated, Any, ClassVar, Literal, cast

import msgspec
import numpy as np

BlockHash = int | bytes
WireFormat = Literal["map", "array"]
# One block's extra hash keys, untagged as vLLM 0.33 publishes them: the LoRA name, then
# multimodal (identifier, offset) pairs, then the cache salt (first block of a prompt only).
BlockExtraKeys = tuple[Any, ...]

END_SEQ = b"\xff" * 8  # reserved: the replay end marker, never a live seq
MAX_SEQ = (1 << 64) - 2
# The snapshot protocol's reply numbers seqs as signed 64-bit: a run serving it stays below.
MAX_SIGNED_SEQ = (1 << 63) - 1
PUBLISHER_ID_BYTES = 16
# The KV cache spec kinds (``kv_cache_spec_kind``) of a group that keeps every block of a
# prompt, each store's chain parent included: the groups routers index (Dynamo, llm-d).
FULL_ATTENTION_KINDS = ("full_attention", "mla_attention", "sink_full_attention")


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the event types; the tag (``type`` in maps) is the class name."""

    # Trailing fields that only the map form carries (the array form has no slot for them).
    MAP_ONLY: ClassVar[tuple[str, ...]] = ()


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    # Decoded as a list; to encode, the daemon hands over the cache's own uint32 array (see
    # ``_encode_array``), so no Python int is made per token.
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block (None for a block without extra keys); None when no block has any.
    extra_keys: list[BlockExtraKeys | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # Map form only: the store's cache salt, on every store of a salted prompt (NVIDIA
    # Dynamo's indexer reads it; vLLM's decoders ignore unknown keys).
    cache_salt: str | None = None

    MAP_ONLY: ClassVar[tuple[str, ...]] = ("cache_salt",)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: tuple[type[KVCacheEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)


class RelayedStored(BlockStored, tag="BlockStored"):
    """A store as an engine encoded it (upstream mode): its token ids stay the engine's
    msgpack array, written back as they came, with no Python int made per token. Encodes
    exactly as a ``BlockStored`` holding those ids."""

    token_ids: msgspec.Raw  # type: ignore[assignment]
    # Checked as it is decoded: an engine's store of blocks of no tokens is refused.
    block_size: Annotated[int, msgspec.Meta(ge=1)]


def token_count(tokens: list[int] | msgspec.Raw) -> int:
    """How many token ids a store carries (a msgpack array's count, read from its header);
    ValueError when an encoded one is not an array."""
    if type(tokens) is not msgspec.Raw:
        return len(tokens)
    size = len(tokens)
    if size >= 3:  # struct reads the buffer in place: no memoryview per store
        first, count = _ARRAY16_HEAD.unpack_from(tokens)
        if first == 0xDC:
            return int(count)
        if first == 0xDD and size >= 5:
            return int(_ARRAY32_HEAD.unpack_from(tokens)[1])
    elif size:
        first = memoryview(tokens)[0]
    else:
        first = 0xC1  # nothing: not an array
    if 0x90 <= first <= 0x9F:
        return int(first) & 0x0F
    raise ValueError("token_ids is not an array")


_ARRAY16_HEAD = struct.Struct(">BH")
_ARRAY32_HEAD = struct.Struct(">BI")
# Whatever the array holds: a relay passes an engine's token ids on unchecked, cut into runs
# or blocks as they are, and must not fail on them.
_TOKEN_LIST = msgspec.msgpack.Decoder(list[Any])


def token_list(tokens: list[int] | msgspec.Raw) -> list[Any]:
    """A store's token ids as a list (decoding an engine's encoded array, items unchecked;
    items no decoder can read, which a relay passed on as they came, as None)."""
    if type(tokens) is not msgspec.Raw:
        return tokens
    try:
        return _TOKEN_LIST.decode(tokens)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return [None] * token_count(tokens)


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# -- the array form, derived from the declarations above ------------------------------------


def _array_length(cls: type[KVCacheEvent]) -> int:
    return len(cls.__struct_fields__) - len(cls.MAP_ONLY)


def _array_twin(cls: type[KVCacheEvent]) -> type[msgspec.Struct]:
    """The decoder of ``cls``'s array form: the same fields in order, minus the map-only tail."""
    fields = msgspec.structs.fields(cls)
    assert tuple(f.name for f in fields[_array_length(cls) :]) == cls.MAP_ONLY, cls
    spec = [
        (f.name, f.type) if f.required else (f.name, f.type, f.default)
        for f in fields[: _array_length(cls)]
    ]
    tag = cls.__struct_config__.tag
    return msgspec.defstruct(cls.__name__, spec, array_like=True, tag=tag, gc=False)


# event type -> (tag, number of fields the array form carries after the tag)
_ARRAY_LAYOUT: dict[type, tuple[str, int]] = {
    cls: (str(cls.__struct_config__.tag), _array_length(cls)) for cls in EVENT_TYPES
}
_ARRAY_LAYOUT[RelayedStored] = _ARRAY_LAYOUT[BlockStored]
_ARRAY_TWINS = {cls: _array_twin(cls) for cls in EVENT_TYPES}
_FROM_TWIN = {twin: cls for cls, twin in _ARRAY_TWINS.items()}
_ArrayEvent = functools.reduce(operator.or_, _ARRAY_TWINS.values())


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]  # type: ignore[valid-type]
    data_parallel_rank: int | None = None


def _from_twin(twin: msgspec.Struct) -> Event:
    return cast(Event, _FROM_TWIN[type(twin)](*msgspec.structs.astuple(twin)))


def to_array(event: Event) -> tuple[Any, ...]:
    """The array form of one event: its tag, then every shared field in order."""
    tag, length = _ARRAY_LAYOUT[type(event)]
    return (tag, *msgspec.structs.astuple(event)[:length])


# -- encoding and decoding ------------------------------------------------------------------

_U16_ITEM = np.dtype([("marker", "u1"), ("value", ">u2")])
_U32_ITEM = np.dtype([("marker", "u1"), ("value", ">u4")])


@functools.lru_cache(maxsize=1024)
def array_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


class _TokenArrays:
    """Writes a batch's NumPy token arrays as msgpack arrays in one NumPy pass over the whole
    batch: unsigned ints all of one width (uint16 when every id in the batch fits, else
    uint32). Any msgpack decoder reads them as the same lists of ints; ids under 128 take 3
    bytes instead of 1, which real vocabularies (mostly ids >= 128) hardly notice. The item
    buffers keep their marker bytes between batches: only the values are written."""

    def __init__(self) -> None:
        self._items = {_U16_ITEM: np.empty(0, _U16_ITEM), _U32_ITEM: np.empty(0, _U32_ITEM)}

    def _buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        items = self._items[dtype]
        if len(items) < count:
            items = np.empty(max(count, 2 * len(items)), dtype)
            items["marker"] = 0xCD if dtype is _U16_ITEM else 0xCE
            self._items[dtype] = items
        return items[:count]

    def raws(self, arrays: list[Any]) -> list[msgspec.Raw] | None:
        """Each array's msgpack form, in order; None unless all are unsigned ints of up to 32
        bits (NumPy's common type of them all)."""
        try:
            flat = np.concatenate(arrays) if len(arrays) > 1 else np.asarray(arrays[0])
        except (TypeError, ValueError):  # not arrays of numbers
            return None
        if flat.dtype.kind != "u" or flat.itemsize > 4 or flat.ndim != 1:
            return None
        # argmax: the array's own loop, without the ufunc machinery of max (a third of the cost)
        narrow = len(flat) == 0 or int(flat[flat.argmax()]) < 1 << 16
        items = self._buffer(_U16_ITEM if narrow else _U32_ITEM, len(flat))
        items["value"] = flat
        # Read in place: each array's bytes are copied once, behind their header.
        data = items.data.cast("B")
        width = items.itemsize
        raws = []
        start = 0
        for array in arrays:
            count = len(array)
            end = start + count * width
            raws.append(msgspec.Raw(array_header(count) + data[start:end]))
            start = end
        return raws


def _encodable(tokens: object) -> bool:
    """Token ids ``_TokenArrays`` writes: a NumPy array of unsigned ints of up to 32 bits."""
    return type(tokens) is np.ndarray and tokens.dtype.kind == "u" and tokens.itemsize <= 4


_ARRAYS = {np.ndarray}


class _OutOfStep(Exception):
    """The encoder met the token arrays other than one each, in order (see BatchEncoder)."""


def pack_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def unpack_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def split_live(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of a live message ``[topic, seq, payload]``; ValueError when it is
    not one (other frames, a seq not 8 bytes, the replay end marker)."""
    if len(frames) != 3 or len(frames[1]) != 8 or frames[1] == END_SEQ:
        raise ValueError(f"a live message is [topic, seq, payload], not {len(frames)} frames")
    return unpack_seq(frames[1]), frames[2]


def event_to_wire(event: Event, wire_format: WireFormat) -> Any:
    """The plain (msgpack-ready) form of one event, e.g. for the control protocol's snapshot."""
    if wire_format == "map":
        return msgspec.to_builtins(event, builtin_types=(bytes,), enc_hook=_to_list)
    return msgspec.to_builtins(to_array(event), builtin_types=(bytes,), enc_hook=_to_list)


def _to_list(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot convert {type(obj).__name__}")


def event_from_wire(obj: Any) -> Event:
    """Decode one plain event in either wire form; raises ValueError on anything else."""
    try:
        if isinstance(obj, dict):
            return cast(Event, msgspec.convert(obj, Event))
        if isinstance(obj, (list, tuple)):
            return _from_twin(msgspec.convert(obj, _ArrayEvent))
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a KV-cache event ({exc}): {obj!r:.80}") from None
    raise ValueError(f"not a KV-cache event: {obj!r:.80}")


_KEPT_BUFFER_BYTES = 4 << 20
_encode_plain = msgspec.msgpack.Encoder().encode


def batch_envelope(
    ts: float, count: int, rank: int, publisher_id: bytes | None = None
) -> tuple[bytes, bytes]:
    """The bytes before and after ``count`` encoded events that make them the batch
    ``[ts, events, rank]`` (``[ts, events, rank, publisher_id]`` with an id), exactly as
    ``BatchEncoder.encode`` writes it."""
    head = array_header(3 if publisher_id is None else 4) + _encode_plain(ts) + array_header(count)
    tail = _encode_plain(rank)
    if publisher_id is not None:
        tail += _encode_plain(publisher_id)
    return head, tail


class BatchEncoder:
    """Encodes event batches for one rank; one msgspec encoder reused for every batch.

    Token ids may be given as the cache's NumPy uint32 arrays instead of lists: the batch's
    arrays are encoded together by NumPy (no Python int per token) and handed to msgspec as
    pre-encoded parts."""

    def __init__(
        self, wire_format: WireFormat, rank: int, publisher_id: bytes | None = None
    ) -> None:
        self.wire_format = wire_format
        self.rank = rank
        # Appended to every batch as its 4th element (the snapshot protocol) when set.
        self.publisher_id = publisher_id
        self._tokens = _TokenArrays()
        # The msgpack forms of the batch's token arrays, in the order the encoder meets the
        # arrays (events in order, token_ids once per BlockStored). The hook takes the next,
        # all in C: next(iter(popleft, None), obj), a Python call a third the cost.
        self._raws: deque[msgspec.Raw] = deque()
        take_next = functools.partial(next, iter(self._raws.popleft, None))
        self._encode_into = msgspec.msgpack.Encoder(enc_hook=take_next).encode_into
        # Any mix of token ids (lists, other dtypes): each array looked up by id.
        self._by_id: dict[int, msgspec.Raw] = {}
        self._encode_mixed_into = msgspec.msgpack.Encoder(enc_hook=self._raw_by_id).encode_into
        # Every batch is written into this one buffer, then copied out at its exact size: a
        # fresh bytes per batch grows by repeated reallocation, in cold memory while the
        # replay ring holds thousands of earlier payloads (about a tenth of the encoding
        # time on the H200 host).
        self._out = bytearray(1 << 16)
        self._array = wire_format == "array"

    def _raw_by_id(self, obj: Any) -> Any:
        raw = self._by_id.get(id(obj))
        if raw is not None:
            return raw
        return _to_list(obj)

    def encode_events(self, events: list[Event]) -> memoryview:
        """``events`` as ``encode`` writes them inside a batch, without the batch around them
        (the items of its events array: snapshots join them into chunks of their own)."""
        batch = self.encode(0.0, events)
        head, tail = batch_envelope(0.0, len(events), self.rank, self.publisher_id)
        return memoryview(batch)[len(head) : len(batch) - len(tail)]

    def encode(self, ts: float, events: list[Event]) -> bytes:
        body: list[Any] = [to_array(e) for e in events] if self._array else events
        identity = self.publisher_id
        batch = (ts, body, self.rank) if identity is None else (ts, body, self.rank, identity)
        out = self._out
        # The daemon's token ids are the cache's uint32 arrays: a batch's are encoded together
        # and handed to the encoder in the order it meets them, with no lookup per array.
        # Each NumPy array costs the encoder one call of the hook, anything else it cannot
        # write one more: so the hook's queue is empty at the end, and was never found empty,
        # exactly when each call took its own array's form.
        arrays = [e.token_ids for e in events if type(e) is BlockStored]
        raws = self._raws
        try:
            if arrays:
                tokens = self._tokens.raws(arrays) if set(map(type, arrays)) == _ARRAYS else None
                if tokens is None:
                    raise _OutOfStep
                raws.extend(tokens)
            self._encode_into(batch, out)
            if raws:
                raise _OutOfStep
        except (_OutOfStep, IndexError):  # not all such arrays (lists, other dtypes)
            raws.clear()
            self._encode_mixed(events, batch, out)
        payload = bytes(out)
        if len(payload) > _KEPT_BUFFER_BYTES:  # a rare huge batch: do not keep its memory
            self._out = bytearray(1 << 16)
        return payload

    def _encode_mixed(self, events: list[Event], batch: tuple[Any, ...], out: bytearray) -> None:
        """Token ids of any kind: the arrays ``_TokenArrays`` writes are found by id, anything
        else is converted to a list."""
        arrays = [
            tokens for e in events if type(e) is BlockStored and _encodable(tokens := e.token_ids)
        ]
        raws = (self._tokens.raws(arrays) if arrays else None) or []
        self._by_id = dict(zip(map(id, arrays), raws, strict=True))
        try:
            self._encode_mixed_into(batch, out)
        finally:
            self._by_id = {}


_MAP_DECODER = msgspec.msgpack.Decoder(EventBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(_ArrayBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a payload frame in either wire form; raises ValueError when it is not a batch."""
    # RecursionError: nested deeper than msgspec goes (a field typed Any lets it through).
    try:
        return _MAP_DECODER.decode(payload)
    except (msgspec.DecodeError, RecursionError) as map_error:
        try:
            batch = _ARRAY_DECODER.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            raise ValueError(f"payload is not a [ts, events, rank] batch: {map_error}") from None
    return EventBatch(batch.ts, [_from_twin(e) for e in batch.events], batch.data_parallel_rank)
