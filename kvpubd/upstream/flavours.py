"""One engine's KV-event payload, decoded into kvpubd's canonical events (``kvpubd.protocol.wire``).

Every flavour publishes the batch ``[ts, events, rank]`` (``[ts, events]`` from the first SGLang
releases; a 4th element, vLLM's publisher id, is ignored). The events differ:

- ``vllm``: tagged maps (>= 0.24) or tagged arrays in declaration order (<= 0.23; releases
  before ``medium`` and ``lora_name`` existed send shorter arrays). Fields kvpubd does not carry
  (``locality``, ``session_id``, ...) are dropped; ``group_idx`` and the cache-spec fields kept.
- ``sglang``: tagged maps (0.5.23) or, from older releases, tagged arrays
  ``[tag, hashes, parent, tokens, block_size, lora_id, medium?, metadata?]``. ``medium`` and
  ``lora_name`` are omitted while unset; hashes are signed 64-bit. A bigram (EAGLE) page sends
  its tokens as pairs ``(t[i], t[i+1])``: each pair stands for its first token.
- ``trtllm``: TensorRT-LLM's streaming publisher, tagged maps only; hashes are ints; it never
  sends ``AllBlocksCleared``. A token id that is a string is refused (the canonical form has
  integer token ids only).

An unset ``medium`` becomes ``default_medium``; ``medium_aliases`` renames media (SGLang's
host tier is ``"CPU_PINNED"`` where vLLM's is ``"CPU"``). Anything else raises
``UpstreamPayloadError``: the caller counts the payload and skips it. The work is bounded by the
payload's size (``max_payload_bytes``) and msgspec's nesting limit; ``decode_stepwise`` cuts
it into slices of a millisecond or two each (one event is never cut).
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

import msgpack
import msgspec

from kvpubd.protocol import wire

Flavour = Literal["vllm", "sglang", "trtllm"]
FLAVOURS: tuple[Flavour, ...] = ("vllm", "sglang", "trtllm")
# An engine's batch is one step's events (about 100 bytes a block: a few hundred KB at most);
# larger ones are lost (a batch is held decoded whole, several times its size, before it is
# relayed).
DEFAULT_MAX_PAYLOAD_BYTES = 8 << 20
# Decoded in one loop step at most (larger batches go a slice at a time): 0.5 ms of vLLM's
# events (token ids kept encoded), 1.7 ms where token ids are decoded (about 2 and 6.5 ms a MB
# on the dev VM). Smaller slices cost more: the slicing itself is about 1.8 ms a MB.
DECODE_SLICE_BYTES = 256 << 10

MAX_TOKEN_ID = (1 << 32) - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
# SGLang's bigram pages: (token, next token) per position. Plain ints: msgspec 0.23 misreads a
# constrained int in a union with a tuple (and can crash), so their range is checked here.
TokenOrPair = int | tuple[int, int]
BlockSize = Annotated[int, msgspec.Meta(ge=1)]


class UpstreamPayloadError(ValueError):
    """A payload that is not a batch of the flavour's events (the caller counts and skips it)."""


@dataclass(frozen=True)
class UpstreamBatch:
    ts: float
    events: list[wire.Event]
    rank: int | None


def _event_types(hashes: Any, token: Any) -> Any:
    """The union of the three event types as a flavour sends them: every field kvpubd keeps,
    by name, all but the essential ones optional (engines omit unset fields)."""
    optional = [
        ("lora_id", int | None, None),
        ("medium", str | None, None),
        ("lora_name", str | None, None),
        ("extra_keys", list[tuple[Any, ...] | None] | None, None),
        ("group_idx", int | None, None),
        ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None),
        ("cache_salt", str | None, None),
    ]
    stored = msgspec.defstruct(
        "BlockStored",
        [
            ("block_hashes", list[hashes]),
            ("parent_block_hash", hashes | None),
            ("token_ids", list[token]),
            ("block_size", BlockSize),
            *optional,
        ],
        kw_only=True,
        tag="BlockStored",
        gc=False,
    )
    removed = msgspec.defstruct(
        "BlockRemoved",
        [
            ("block_hashes", list[hashes]),
            ("medium", str | None, None),
            ("group_idx", int | None, None),
        ],
        kw_only=True,
        tag="BlockRemoved",
        gc=False,
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], tag="AllBlocksCleared", gc=False)
    return stored | removed | cleared


# Field order of the array forms, after the tag (the fields each flavour declared, in order).
_VLLM_ARRAYS = {
    "BlockStored": [f.name for f in msgspec.structs.fields(wire.BlockStored)][
        : len(wire.BlockStored.__struct_fields__) - len(wire.BlockStored.MAP_ONLY)
    ],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}
_SGLANG_ARRAYS = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "metadata",
    ],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


@dataclass(frozen=True)
class _Spec:
    strict: Any  # the event union of the common case (integer tokens): the fast path
    lenient: Any  # what the flavour may also send (SGLang's token pairs)
    arrays: Mapping[str, list[str]] | None  # None: no array form
    # The wire types themselves, token ids kept encoded (None: the flavour's events need
    # converting): nothing is made per event or per token beyond what msgspec decodes.
    direct: Any = None


_INT = _event_types(int, TokenId)
_SPECS: dict[Flavour, _Spec] = {
    # vLLM's own maps carry every field the wire types require: they decode straight into
    # them. Its token ids (ints from its tokenizer, encoded by msgspec from list[int]) are
    # relayed as they came; that they form an array is checked, their values are not.
    "vllm": _Spec(
        _event_types(int | bytes, TokenId),
        None,
        _VLLM_ARRAYS,
        direct=wire.RelayedStored | wire.BlockRemoved | wire.AllBlocksCleared,
    ),
    "sglang": _Spec(_INT, _event_types(int, TokenOrPair), _SGLANG_ARRAYS),
    "trtllm": _Spec(_INT, None, None),
}


def _envelope(events: Any) -> type[msgspec.Struct]:
    return msgspec.defstruct(
        "Envelope",
        [("ts", float), ("events", events), ("rank", int | None, None)],
        array_like=True,
        gc=False,
    )


class _Decoders:
    """One flavour's decoders of a list of events: straight into the wire types (``direct``:
    None where the flavour's events need converting), its common case, and any objects."""

    def __init__(self, direct: Any, strict: Any, wrap: Any) -> None:
        self.direct = None if direct is None else msgspec.msgpack.Decoder(wrap(list[direct]))
        self.fast = msgspec.msgpack.Decoder(wrap(list[strict]))
        self.raw = msgspec.msgpack.Decoder(wrap(list[Any]))


class FlavourDecoder:
    """Decodes one flavour's payloads into ``UpstreamBatch`` es of canonical events."""

    def __init__(
        self,
        flavour: Flavour,
        *,
        default_medium: str | None = "GPU",
        medium_aliases: Mapping[str, str] | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        tokens_encoded: bool = False,
    ) -> None:
        """``tokens_encoded``: where the flavour allows (vLLM's own maps), decode straight
        into the wire types with each store's token ids kept as the engine encoded them
        (``wire.RelayedStored``), for a relay that writes them back unchanged."""
        if flavour not in _SPECS:
            raise ValueError(f"unknown engine flavour {flavour!r} (one of {', '.join(FLAVOURS)})")
        self.flavour = flavour
        self.default_medium = default_medium
        self.medium_aliases = dict(medium_aliases or {})
        self.max_payload_bytes = max_payload_bytes
        self._spec = _SPECS[flavour]
        direct: Any = self._spec.direct if tokens_encoded else None
        self._whole = _Decoders(direct, self._spec.strict, _envelope)
        self._listed = _Decoders(direct, self._spec.strict, lambda events: events)

    def decode(self, payload: bytes) -> UpstreamBatch:
        """The whole batch in one step (2 to 7 ms a MB on the dev VM; see ``decode_stepwise``)."""
        self._check_size(payload)
        try:
            batch, events = self._decoded(self._whole, payload)
        except (msgspec.DecodeError, RecursionError, ValueError) as exc:
            raise self._refused(exc) from None
        return UpstreamBatch(batch.ts, events, batch.rank)

    def decode_stepwise(
        self, payload: bytes, slice_bytes: int = DECODE_SLICE_BYTES
    ) -> Iterator[int | UpstreamBatch]:
        """The batch decoded ``slice_bytes`` of its events at a time (one event larger than
        that alone): yields the bytes of each slice once it is decoded, then the batch, so
        that the caller can let the loop turn in between. Each step walks only its own slice
        (msgpack's unpacker skips event by event in C: splitting the whole array up front
        cost about 2 ms a MB in one step). Refused as a whole as ``decode`` refuses it
        (UpstreamPayloadError)."""
        self._check_size(payload)
        try:
            # Read from the payload a slice's worth at a time (fed whole, its copy into the
            # unpacker was a step of milliseconds of its own).
            reader = msgpack.Unpacker(
                io.BytesIO(payload), read_size=slice_bytes, max_buffer_size=max(1, len(payload))
            )
            fields = reader.read_array_header()  # [ts, events, rank?, anything after]
            ts = reader.unpack() if fields >= 2 else None
            if type(ts) not in (float, int):
                raise ValueError(f"ts: expected a number, got {type(ts).__name__}")
            events: list[wire.Event] = []
            total = reader.read_array_header()
            start = end = reader.tell()  # the slice: [start, end), ``count`` events
            count = 0
            for _ in range(total):
                reader.skip()
                after = reader.tell()
                if count and after - start > slice_bytes:  # this event starts the next slice
                    events += self._slice(payload, start, end, count)
                    yield end - start
                    start, count = end, 0
                end, count = after, count + 1
            if count:
                events += self._slice(payload, start, end, count)
                yield end - start
            rank = reader.unpack() if fields >= 3 else None
            if rank is not None and type(rank) is not int:
                raise ValueError(f"rank: expected an int or nil, got {type(rank).__name__}")
            for _ in range(fields - 3):
                reader.skip()
            if reader.tell() != len(payload):
                raise ValueError("trailing bytes after the batch")
        except (msgspec.DecodeError, RecursionError, ValueError, msgpack.UnpackException) as exc:
            raise self._refused(exc) from None
        yield UpstreamBatch(float(cast(float, ts)), events, rank)

    def _slice(self, payload: bytes, start: int, end: int, count: int) -> list[wire.Event]:
        """The ``count`` events encoded in ``payload[start:end]``, decoded."""
        array = b"\xdd" + count.to_bytes(4, "big") + payload[start:end]
        return self._decoded(self._listed, array)[1]

    def _check_size(self, payload: bytes) -> None:
        if len(payload) > self.max_payload_bytes:
            raise UpstreamPayloadError(
                f"payload of {len(payload)} bytes is over the {self.max_payload_bytes} allowed"
            )

    def _refused(self, exc: Exception) -> UpstreamPayloadError:
        # (ValidationError is a DecodeError; ValueError: token ids that are no array)
        return UpstreamPayloadError(f"not a {self.flavour} KV-event batch: {exc}")

    def _decoded(self, decoders: _Decoders, payload: bytes) -> tuple[Any, list[wire.Event]]:
        """``payload`` decoded by ``decoders``, and its events in canonical form: straight
        into the wire types where they fit, else converted."""
        whole = decoders is self._whole  # an envelope, else a list of events
        if decoders.direct is not None:
            try:
                got: Any = decoders.direct.decode(payload)
                return got, self._settled(got.events if whole else got)
            except msgspec.ValidationError:
                pass  # an older release's form: converted below
        try:
            got = decoders.fast.decode(payload)
            found = got.events if whole else got
        except msgspec.ValidationError:
            got = decoders.raw.decode(payload)
            found = [self._event(obj) for obj in (got.events if whole else got)]
        return got, [self._canonical(e) for e in found]

    def _settled(self, events: list[wire.Event]) -> list[wire.Event]:
        """Events decoded straight into the wire types, with their medium filled (and
        renamed); ValueError when a store's token ids are not an array."""
        aliases = self.medium_aliases
        for event in events:
            kind = type(event)
            if kind is wire.AllBlocksCleared:
                continue
            medium = event.medium  # type: ignore[union-attr]
            if medium is None or aliases:
                event.medium = self._medium(medium)  # type: ignore[union-attr]
            if kind is wire.RelayedStored:
                wire.token_count(event.token_ids)  # type: ignore[union-attr]
                # Its own bytes: a view into the payload would keep the whole batch alive
                # as long as one of its blocks is.
                event.token_ids = event.token_ids.copy()  # type: ignore[union-attr]
        return events

    def _event(self, obj: Any) -> Any:
        """One event the fast path refused: an array form, or the flavour's lenient types."""
        if isinstance(obj, list) and obj and isinstance(obj[0], str):
            arrays = self._spec.arrays
            if arrays is None or obj[0] not in arrays:
                raise msgspec.ValidationError(f"{self.flavour} sends no array event {obj[0]!r}")
            names = arrays[obj[0]]
            fields = dict(zip(names, obj[1:], strict=False))  # newer trailing ones ignored
            metadata = fields.pop("metadata", None)  # SGLang's BlockStoredWithMetadata
            if isinstance(metadata, dict) and "cache_salt" in metadata:
                fields["cache_salt"] = metadata["cache_salt"]
            fields["type"] = obj[0]
            obj = fields
        event = msgspec.convert(obj, self._spec.lenient or self._spec.strict)
        tokens = getattr(event, "token_ids", None)
        if tokens and self._spec.lenient is not None:
            # SGLang's bigram pages: each position's pair starts with that position's token.
            every = [i for t in tokens for i in (t if type(t) is tuple else (t,))]
            if not 0 <= min(every) <= max(every) <= MAX_TOKEN_ID:
                raise msgspec.ValidationError(f"token ids must lie in 0..{MAX_TOKEN_ID}")
            event.token_ids = [t[0] if type(t) is tuple else t for t in tokens]
        return event

    def _medium(self, medium: str | None) -> str | None:
        medium = self.default_medium if medium is None else medium
        return self.medium_aliases.get(medium, medium) if medium is not None else None

    def _canonical(self, event: Any) -> wire.Event:
        name = type(event).__name__
        if name == "AllBlocksCleared":
            return wire.AllBlocksCleared()
        medium = self._medium(event.medium)
        if name == "BlockRemoved":
            return wire.BlockRemoved(event.block_hashes, medium, event.group_idx)
        return wire.BlockStored(
            block_hashes=cast(list[wire.BlockHash], event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            cache_salt=event.cache_salt,
        )
