"""The control protocol's one declaration (``kvpubd.protocol.control``) holds on both sides:
every request type, as the client encodes it, is what the daemon decodes; every reply type, as
the daemon encodes it, is what the client decodes; and a real daemon answers each op. The ops
and replies are enumerated from the declaration, so a new one is covered without a new test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import pytest

from kvpubd.client import AsyncControlClient, ControlClient
from kvpubd.client.replies import Call
from kvpubd.protocol import control_frames
from kvpubd.protocol.control import (
    INT_LIST_FIELDS,
    REPLY_TYPES,
    REQUEST_TYPES,
    ChecksumReply,
    ControlReply,
    ControlRequest,
    Release,
    SnapshotReply,
    Store,
    int_list,
    ok_reply,
    ok_reply_head,
    packed_uint32,
)
from kvpubd.protocol.control_frames import parse_request
from tests.daemon import Daemon

BLOCK_SIZE = 16
# A value for every request field, by name: a new field needs one here (the tests say so).
REQUEST_FIELDS: dict[str, Any] = {
    "request_id": "req-1",
    "rank": 0,
    "lora_id": 3,
    "lora_name": "sql",
    "cache_salt": "tenant",
    "force": True,
    "tier": "gpu",
    "num_computed_tokens": 2 * BLOCK_SIZE + 3,
    "token_ids": int_list(range(2 * BLOCK_SIZE + 3)),
    "block_ids": int_list([0, 1, 2]),
    "requests": [
        Store(id=8, request_id="req-2", token_ids=int_list(range(BLOCK_SIZE + 1))),
        Release(id=9, request_id="req-2"),
    ],
}
# Long enough that the daemon takes it a slice at a time (not in one msgspec call).
LONG_TOKENS = int_list(range(20_000))
# Packed tokens in a frame too large for one msgspec call over all of it.
LONG_PACKED = packed_uint32(bytes(range(256)) * 64)


def example_request(cls: type[ControlRequest], **overrides: Any) -> ControlRequest:
    """``cls`` with every field set (none left at its default)."""
    names = [name for name in cls.__struct_fields__ if name != "id"]
    missing = [name for name in names if name not in REQUEST_FIELDS]
    assert not missing, f"add example values for {cls.__name__} fields {missing}"
    return cls(id=7, **{**{name: REQUEST_FIELDS[name] for name in names}, **overrides})


@pytest.fixture
def client() -> Iterator[ControlClient]:
    # Never connected: only its encoding is used.
    with ControlClient("tcp://127.0.0.1:9", timeout=0.1) as client:
        yield client


def client_frame(client: ControlClient, request: ControlRequest) -> tuple[int, bytes]:
    request_id, frames = client._frame(request)
    return request_id, frames[-1]


def parsed(frame: bytes) -> ControlRequest:
    return parse_request(frame, 16 << 20, 1 << 20)


@pytest.mark.parametrize("cls", REQUEST_TYPES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("walked", [False, True], ids=["one-call", "walked"])
def test_every_request_the_client_encodes_is_what_the_daemon_decodes(
    client: ControlClient, cls: type[ControlRequest], walked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both daemon decoders: msgspec in one call (small frames) and the field walk that
    locates long integer lists."""
    if walked:
        monkeypatch.setattr(control_frames, "ONE_CALL_BYTES", 0)
    request = example_request(cls)
    request_id, frame = client_frame(client, request)
    assert parsed(frame) == msgspec.structs.replace(request, id=request_id)


@pytest.mark.parametrize(
    "token_ids",
    [LONG_TOKENS, packed_uint32(bytes(range(64))), LONG_PACKED],
    ids=["long list", "packed", "long packed"],
)
def test_store_token_forms_round_trip(client: ControlClient, token_ids: msgspec.Raw) -> None:
    store = next(cls for cls in REQUEST_TYPES if "token_ids" in cls.__struct_fields__)
    request = example_request(store, token_ids=token_ids)
    request_id, frame = client_frame(client, request)
    assert parsed(frame) == msgspec.structs.replace(request, id=request_id)
    # The client puts the integer list last: the daemon never walks past it.
    assert frame.endswith(bytes(memoryview(token_ids)))


def read_by_the_walk(frame: bytes) -> ControlRequest | str:
    """The request the field walk reads from ``frame`` (or its refusal's code): what a large
    frame is, however the daemon comes to read it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(control_frames, "_store_of_packed_tokens", lambda frame: None)
        try:
            return parsed(frame)
        except control_frames.ProtocolError as exc:
            return exc.code


def read_as_sent(frame: bytes) -> ControlRequest | str:
    try:
        return parsed(frame)
    except control_frames.ProtocolError as exc:
        return exc.code


def test_a_large_store_reads_the_same_whichever_way_the_daemon_reads_it(
    client: ControlClient,
) -> None:
    """Packed tokens ending the frame are read without walking the fields: the same request,
    also where the bytes of a tokens key followed by a bin reaching the frame's end lie
    somewhere else than at the request's own ``token_ids``."""
    store = next(cls for cls in REQUEST_TYPES if "token_ids" in cls.__struct_fields__)
    _, sent = client_frame(client, example_request(store, token_ids=LONG_PACKED))
    tail = b"\x07" * 9000
    packer = msgpack.Packer(use_bin_type=True)
    head = packer.pack_map_header(4) + packer.pack("op") + packer.pack("store")
    head += packer.pack("id") + packer.pack(1)
    # token_ids under a str8 key is a bin holding a fixstr key and the header of a bin that
    # runs to the frame's end; after it, that bin's data: trailing bytes.
    fake = b"\xa9token_ids\xc6" + len(tail).to_bytes(4, "big")
    inside = (fake + tail)[:20]
    in_a_bin = head + packer.pack("request_id") + packer.pack("r") + b"\xd9\x09token_ids"
    in_a_bin += b"\xc4" + bytes([len(inside)]) + (fake + tail)
    # The request's token_ids (under a str8 key) come earlier: empty, or the very bytes of the
    # stand-in the daemon decodes in their place; its id is a map whose key ends in the
    # tokens key.
    earlier = [b"", control_frames._MARK]
    in_the_id = [
        packer.pack_map_header(4)
        + packer.pack("op")
        + packer.pack("store")
        + packer.pack("request_id")
        + packer.pack("r")
        + b"\xd9\x09token_ids"
        + packer.pack(tokens)
        + packer.pack("id")
        + packer.pack({"\u00a9token_ids": tail})
        for tokens in earlier
    ]
    for frame in (sent, in_a_bin, *in_the_id):
        assert len(frame) > control_frames.ONE_CALL_BYTES
        assert read_as_sent(frame) == read_by_the_walk(frame)
    assert read_as_sent(in_a_bin) == "bad_request"
    for frame, tokens in zip(in_the_id, earlier, strict=True):
        request = read_as_sent(frame)
        assert isinstance(request, Store)
        assert bytes(memoryview(request.token_ids)) == packer.pack(tokens)


def test_integer_lists_are_each_requests_last_field() -> None:
    for cls in REQUEST_TYPES:
        fields = cls.__struct_fields__
        lists = [name for name in fields if name in INT_LIST_FIELDS]
        assert lists in ([], [fields[-1]]), cls


def test_every_request_type_has_a_reply_type_and_client_methods() -> None:
    assert set(REPLY_TYPES) == set(REQUEST_TYPES)
    for cls in REQUEST_TYPES:
        assert callable(getattr(ControlClient, op_of_request(cls)))
        assert callable(getattr(AsyncControlClient, op_of_request(cls)))


def op_of_request(cls: type[ControlRequest]) -> str:
    return str(cls.__struct_config__.tag)


# -- replies --------------------------------------------------------------------------------


def sample(info: msgspec.inspect.Type) -> Any:
    """A value of the type ``info`` (a union's first member other than None)."""
    match info:
        case msgspec.inspect.IntType():
            return 5
        case msgspec.inspect.StrType():
            return "text"
        case msgspec.inspect.BoolType():
            return True
        case msgspec.inspect.BytesType():
            return b"\x00\xff"
        case msgspec.inspect.AnyType():
            return "any"
        case msgspec.inspect.NoneType():
            return None
        case msgspec.inspect.ListType():
            return [sample(info.item_type), sample(info.item_type)]
        case msgspec.inspect.DictType():
            return {sample(info.key_type): sample(info.value_type)}
        case msgspec.inspect.VarTupleType():
            return (sample(info.item_type),)
        case msgspec.inspect.TupleType():
            return tuple(sample(item) for item in info.item_types)
        case msgspec.inspect.UnionType():
            kinds = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
            return sample(kinds[0])
        case msgspec.inspect.StructType():
            return info.cls(**{f.name: sample(f.type) for f in info.fields})
    raise AssertionError(f"no sample for {info}")


REPLIES = sorted(set(REPLY_TYPES.values()), key=lambda cls: cls.__name__)


def example_reply(cls: type[ControlReply]) -> ControlReply:
    reply = sample(msgspec.inspect.type_info(cls))
    assert isinstance(reply, cls)
    return reply


def client_reads(client: ControlClient, encoded: bytes, cls: type[ControlReply]) -> ControlReply:
    reply_map = client._answer([b"", encoded], 7)
    assert reply_map is not None
    return client._typed(Call(_request_for(cls), cls), reply_map)


def _request_for(cls: type[ControlReply]) -> ControlRequest:
    request_type = next(r for r, t in REPLY_TYPES.items() if t is cls)
    return example_request(request_type)


@pytest.mark.parametrize("cls", REPLIES, ids=lambda c: c.__name__)
def test_every_reply_the_daemon_encodes_is_what_the_client_decodes(
    client: ControlClient, cls: type[ControlReply]
) -> None:
    reply = example_reply(cls)
    assert client_reads(client, ok_reply(7, reply), cls) == reply


@pytest.mark.parametrize("cls", [SnapshotReply, ChecksumReply], ids=lambda c: c.__name__)
def test_streamed_replies_decode_as_their_struct(
    client: ControlClient, cls: type[ControlReply]
) -> None:
    """A snapshot's events and a checksum's sums are appended to the encoded head a slice at a
    time by the daemon: the whole is still the reply struct."""
    reply = example_reply(cls)
    last = cls.__struct_fields__[-1]
    items = getattr(reply, last)
    head = ok_reply_head(7, msgspec.structs.replace(reply, **{last: []}))
    encoded = head + msgspec.msgpack.encode(items)
    assert client_reads(client, encoded, cls) == reply


def test_a_malformed_reply_is_bad_reply_naming_the_field(client: ControlClient) -> None:
    from kvpubd.client import ControlError, StatsReply

    reply_map = client._answer([b"", msgspec.msgpack.encode({"ok": True, "id": 7})], 7)
    assert reply_map is not None
    with pytest.raises(ControlError) as refused:
        client._typed(Call(_request_for(StatsReply), StatsReply), {**reply_map, "epoch": "x"})
    assert refused.value.code == "bad_reply" and "epoch" in refused.value.message


# -- a real daemon ------------------------------------------------------------------------


def test_a_daemon_answers_every_op(daemon: Daemon) -> None:
    """One call per op, in declaration order (a store comes before its release), each
    answered with its declared reply type."""
    with daemon.client() as client:
        for cls in REQUEST_TYPES:
            reply_type = REPLY_TYPES[cls]
            reply = client._run(Call(example_request(cls), reply_type))
            assert isinstance(reply, reply_type), (cls, reply)
