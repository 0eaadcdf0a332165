"""The wire format against a real daemon, checked by decoders that do not share its code.

The decoders below are msgspec structs written from vLLM's own field lists: vLLM 0.33's tagged
maps (``wire_format = "map"``) and vLLM 0.23's tagged arrays (``wire_format = "array"``). They
are strict: a missing required field, an unknown key or a wrong type fails the decode. The one
key beyond vLLM's list is the map form's ``cache_salt``, which NVIDIA Dynamo's decoder reads
(vLLM's own decoders ignore unknown keys).
kvpubd.protocol.wire is deliberately not used for decoding anywhere in this file.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvpubd.client import replay
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.hashing import HashAlgorithm, chain_digests
from kvpubd.protocol.wire import (
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    Event,
    RelayedStored,
    decode_batch,
    token_count,
    token_list,
)
from kvpubd.tools.vllm_source import kv_events_path, load_kv_events
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.streams import independent_digest, independent_root_key

END_SEQ = b"\xff" * 8
TIMEOUT = 10.0

Hash = int | bytes


# -- vLLM 0.33: tagged maps (omit_defaults; the first seven fields are required) -------------


class MapEvent(
    msgspec.Struct, tag_field="type", tag=True, omit_defaults=True, forbid_unknown_fields=True
):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    cache_salt: str | None = None  # Dynamo 1.6.1's zmq_wire/deserialize.rs reads it


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]
    data_parallel_rank: int | None


# -- vLLM 0.23: tagged arrays (tag first, then the fields in order) --------------------------


class ArrayEvent(
    msgspec.Struct, array_like=True, tag=True, omit_defaults=True, forbid_unknown_fields=True
):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None


DECODERS: dict[str, msgspec.msgpack.Decoder[MapBatch | ArrayBatch]] = {
    "map": msgspec.msgpack.Decoder(MapBatch),
    "array": msgspec.msgpack.Decoder(ArrayBatch),
}
STORED = (MapBlockStored, ArrayBlockStored)
REMOVED = (MapBlockRemoved, ArrayBlockRemoved)
CLEARED = (MapAllBlocksCleared, ArrayAllBlocksCleared)

MAP_STORED_KEYS = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
}
ARRAY_LENGTHS = {"BlockStored": 12, "BlockRemoved": 4, "AllBlocksCleared": 1}


# -- helpers ---------------------------------------------------------------------------------


def decode(wire_format: str, payload: bytes) -> MapBatch | ArrayBatch:
    return DECODERS[wire_format].decode(payload)


def replay_raw(endpoint: str, start: int) -> list[list[bytes]]:
    """Every replayed message from ``start`` as ``[topic, seq, payload]``, end marker excluded."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        while True:
            assert sock.poll(int(TIMEOUT * 1000)), "replay did not end with its marker"
            frames = sock.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4, frames
            if frames[2] == END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                return out
            out.append(frames[1:])
    finally:
        sock.close()


def published(daemon: Daemon) -> list[bytes]:
    """Publish everything captured (snapshot flushes first), then replay every payload from 0
    (everything retained: the run's first seq is its origin, not 0)."""
    with daemon.client() as client:
        last = client.snapshot().seq
    messages = replay_raw(f"{daemon.replay_endpoint}_dp0", 0)
    seqs = [int.from_bytes(m[1], "big") for m in messages]
    assert seqs == list(range(daemon.first_seq(), last + 1))
    return [m[2] for m in messages]


def stored_events(wire_format: str, payloads: list[bytes]) -> list[Any]:
    return [
        event
        for payload in payloads
        for event in decode(wire_format, payload).events
        if isinstance(event, STORED)
    ]


def expected_digests(
    tokens: list[int],
    block_size: int,
    lora_id: int | None = None,
    cache_salt: str | None = None,
    algorithm: str = "sha256",
) -> list[bytes]:
    """The documented chain, computed here: H(prev or root || block tokens as LE uint32), H
    sha256 or xxh3_128, the root H(msgpack(["kvpubd-root-v1", lora_id, cache_salt]))."""
    prev = independent_root_key(lora_id, cache_salt, algorithm)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        prev = independent_digest(prev + struct.pack(f"<{block_size}I", *block), algorithm)
        out.append(prev)
    return out


@pytest.mark.parametrize("algorithm", ["sha256", "xxhash"])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_the_chain_hashes_every_byte_of_each_block(
    algorithm: HashAlgorithm, block_size: int
) -> None:
    """Blocks whose last bytes are zeros (token id 0, small ids' high bytes) keep them, a
    strided view hashes its values, and a partial tail is left out."""
    tokens = [7, 0, 0, 256, 0, 0, 1 << 24, 0, 0, 0, 5] * 5
    root = independent_root_key(None, None, algorithm)
    expected = expected_digests(tokens, block_size, algorithm=algorithm)
    packed = np.array(tokens, dtype="<u4")
    assert chain_digests(packed, block_size, root, algorithm) == expected
    strided = np.repeat(packed, 2)[::2]
    assert chain_digests(strided, block_size, root, algorithm) == expected
    assert chain_digests(packed[: block_size - 1], block_size, root, algorithm) == []


def to_wire(digest: bytes, hash_format: str) -> Hash:
    if hash_format == "u64":
        return int.from_bytes(digest[-8:], "big")
    if hash_format == "i64":
        return int.from_bytes(digest[:8], "big", signed=True)
    return digest


# -- one workload, captured live and through replay ----------------------------------------


@dataclass
class Capture:
    wire_format: str
    topic: str
    block_size: int
    live: list[list[bytes]]  # every live message from the first one seen, raw frames
    replayed: list[list[bytes]]  # replay from 0: [topic, seq, payload]
    first_seq: int
    last_seq: int
    salts: dict[str | None, str]  # the workload's salt by LoRA name


def run_workload(daemon: Daemon, wire_format: str, topic: str) -> Capture:
    """Stores (with and without LoRA), evictions from an 8-block pool and resets, captured on a
    raw SUB socket (all topics) and by a replay from 0 afterwards."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"{daemon.events_endpoint}_dp0")
    live: list[list[bytes]] = []
    try:
        with daemon.client() as client:
            # Until the subscription is in place nothing is delivered: publish markers until
            # one arrives. Everything published after it reaches this socket.
            deadline = time.monotonic() + TIMEOUT
            while not live:
                client.reset()
                if sub.poll(50):
                    live.append(sub.recv_multipart())
                assert time.monotonic() < deadline, "SUB never received a live message"

            prompt = list(range(1000, 1000 + 3 * 16 + 4))  # 3 full blocks + a partial tail
            client.store("r1", prompt)
            client.store("r2", prompt[:32] + list(range(5000, 5016)))  # shares 2 blocks
            client.store("r3", prompt[:32], lora_id=3, lora_name="adapter-a")
            for request in ("r1", "r2", "r3"):
                client.release(request)
            client.store("r4", list(range(9000, 9000 + 6 * 16)))  # evicts 4 of 6 cached
            client.release("r4")
            client.reset()
            client.store("r5", prompt[:16], lora_id=7, lora_name="adapter-b", cache_salt="s")
            client.reset(force=True)  # r5 still open
            client.store("r6", prompt[:40])
            last = client.snapshot().seq

        deadline = time.monotonic() + TIMEOUT
        while int.from_bytes(live[-1][1], "big") < last:
            if sub.poll(50):
                live.append(sub.recv_multipart())
            assert time.monotonic() < deadline, f"live stream stopped before seq {last}"
    finally:
        sub.close()
    replayed = replay_raw(f"{daemon.replay_endpoint}_dp0", 0)
    return Capture(
        wire_format, topic, 16, live, replayed, daemon.first_seq(), last, {"adapter-b": "s"}
    )


@pytest.fixture(
    scope="module",
    params=[("map", ""), ("array", "kv@pod@model")],
    ids=["map-no-topic", "array-llmd-topic"],
)
def capture(request: pytest.FixtureRequest) -> Iterator[Capture]:
    wire_format, topic = request.param
    daemon = Daemon(
        {
            "events": {"wire_format": wire_format, "topic": topic},
            "cache": {"num_blocks": 8},
        }
    )
    try:
        daemon.start()
        yield run_workload(daemon, wire_format, topic)
    finally:
        daemon.cleanup()


def all_payloads(capture: Capture) -> list[bytes]:
    return [m[2] for m in capture.replayed]


# -- the decoders themselves ---------------------------------------------------------------


def test_decoders_are_strict() -> None:
    """Guards this file's decoders: they reject a missing required key, an unknown key, the other
    wire format and a short array, so a pass below means the daemon's bytes really fit."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    good = msgpack.packb([1.0, [stored], 0])
    assert isinstance(decode("map", good).events[0], MapBlockStored)
    for bad_event in (
        {k: v for k, v in stored.items() if k != "lora_name"},
        {**stored, "surprise": 1},
        {**stored, "block_size": "2"},
        ["BlockStored", [1], None, [1, 2], 2, None, "CPU", None],
    ):
        with pytest.raises(msgspec.ValidationError):
            decode("map", msgpack.packb([1.0, [bad_event], 0]))
    with pytest.raises(msgspec.ValidationError):
        decode("array", good)
    with pytest.raises(msgspec.ValidationError):
        decode("array", msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 2, None]], 0]))


# -- tests on the captured workload --------------------------------------------------------


def test_live_messages_have_three_frames_topic_and_gap_free_seq(capture: Capture) -> None:
    """Every live message is [topic, seq, payload]: the configured topic, an 8-byte big-endian
    seq that runs from the run's first seq without gaps (replay from 0, then live) and is never
    ff*8."""
    topic = capture.topic.encode()
    for frames in capture.live:
        assert len(frames) == 3, f"live message has {len(frames)} frames"
        assert frames[0] == topic
        assert len(frames[1]) == 8 and frames[1] != END_SEQ
    live_seqs = [int.from_bytes(f[1], "big") for f in capture.live]
    assert live_seqs == list(range(live_seqs[0], capture.last_seq + 1))

    replay_seqs = [int.from_bytes(m[1], "big") for m in capture.replayed]
    assert replay_seqs == list(range(capture.first_seq, capture.last_seq + 1))
    for message in capture.replayed:
        assert message[0] == topic and message[1] != END_SEQ
    by_seq = {int.from_bytes(m[1], "big"): m[2] for m in capture.replayed}
    for frames in capture.live:
        assert frames[2] == by_seq[int.from_bytes(frames[1], "big")], "replay != live payload"


def test_strict_vllm_decoders_accept_everything(capture: Capture) -> None:
    """Every payload the daemon sent decodes with vLLM's strict structs for its wire format, and
    the workload really exercised stores (with LoRA), removals and resets."""
    kinds: dict[type, int] = {}
    lora_stores = []
    for payload in all_payloads(capture):
        batch = decode(capture.wire_format, payload)
        assert batch.data_parallel_rank == 0
        assert isinstance(msgpack.unpackb(payload)[0], float)
        for event in batch.events:
            kinds[type(event)] = kinds.get(type(event), 0) + 1
            if isinstance(event, STORED) and event.lora_id is not None:
                lora_stores.append((event.lora_id, event.lora_name))
    names = {cls.__name__.removeprefix("Map").removeprefix("Array") for cls in kinds}
    assert names == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert (3, "adapter-a") in lora_stores and (7, "adapter-b") in lora_stores


def test_raw_events_carry_exactly_the_documented_fields(capture: Capture) -> None:
    """Map mode: BlockStored has the 8 required keys (nil where empty), plus ``extra_keys``
    exactly when a block has extra keys (a LoRA name, or a salt on a prompt's first block) and
    ``cache_salt`` exactly when the store is salted; BlockRemoved type/block_hashes/medium,
    AllBlocksCleared only type. Array mode: 12/4/1 elements."""
    seen = set()
    for payload in all_payloads(capture):
        raw = msgpack.unpackb(payload, strict_map_key=False)
        assert isinstance(raw, list) and len(raw) == 3
        for event in raw[1]:
            if capture.wire_format == "map":
                assert isinstance(event, dict)
                kind = event["type"]
                expected = {
                    "BlockStored": MAP_STORED_KEYS,
                    "BlockRemoved": {"type", "block_hashes", "medium"},
                    "AllBlocksCleared": {"type"},
                }[kind]
                if kind == "BlockStored":
                    salt = capture.salts.get(event["lora_name"])
                    at_root = event["parent_block_hash"] is None
                    if event["lora_name"] is not None or (salt and at_root):
                        expected = expected | {"extra_keys"}
                    if salt:
                        expected = expected | {"cache_salt"}
                assert set(event) == expected, event
            else:
                assert isinstance(event, list)
                kind = event[0]
                assert len(event) == ARRAY_LENGTHS[kind], event
            seen.add(kind)
    assert seen == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_token_ids_are_whole_blocks(capture: Capture) -> None:
    """Every BlockStored carries exactly len(block_hashes) x block_size token ids."""
    stores = stored_events(capture.wire_format, all_payloads(capture))
    assert stores
    for event in stores:
        assert event.block_size == capture.block_size
        assert event.block_hashes
        assert len(event.token_ids) == len(event.block_hashes) * event.block_size


def test_medium_defaults_to_cpu(capture: Capture) -> None:
    """The NumPy pool reports medium "CPU" on stores and removals."""
    events = [e for p in all_payloads(capture) for e in decode(capture.wire_format, p).events]
    media = {e.medium for e in events if isinstance(e, STORED + REMOVED)}
    assert media == {"CPU"}


# -- hashes ------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["sha256", "xxhash"])
@pytest.mark.parametrize("hash_format", ["u64", "i64", "bytes"])
def test_block_hashes_follow_the_documented_chain(
    start_daemon: DaemonFactory, hash_format: str, algorithm: str
) -> None:
    """Published hashes equal H(prev or root(lora_id, cache_salt) || LE uint32 tokens) in the
    configured form, H the configured algorithm; a shared prefix's next store names the last
    matched block as parent; lora_id and cache_salt change every hash; u64 >= 2^63 is msgpack
    uint64 (0xcf), i64 below -2^31 is int64 (0xd3), bytes is bin 8 (0xc4, then the digest's
    length: 32 for sha256, 16 for xxh3_128)."""
    daemon = start_daemon(events={"hash_format": hash_format}, cache={"hash_algorithm": algorithm})
    bs = 16
    base = [(i * 2654435761) % (1 << 32) for i in range(4 * bs + 3)]  # large ids too
    cases: list[tuple[str, list[int], dict[str, Any], int]] = [
        # (request, tokens, store fields, blocks matched from an earlier case)
        ("plain", base, {}, 0),
        ("shared", base[: 2 * bs] + list(range(7, 7 + 2 * bs)), {}, 2),
        ("lora", base, {"lora_id": 5, "lora_name": "adapter"}, 0),
        ("salt", base, {"cache_salt": "tenant-1"}, 0),
        ("lora+salt", base, {"lora_id": 5, "lora_name": "adapter", "cache_salt": "tenant-1"}, 0),
    ]
    with daemon.client() as client:
        for request, tokens, fields, matched in cases:
            reply = client.store(request, tokens, **fields)
            assert reply.num_cached_tokens == matched * bs
    stores = stored_events("map", published(daemon))
    assert len(stores) == len(cases)

    all_hashes: list[Hash] = []
    for (request, tokens, fields, matched), event in zip(cases, stores, strict=True):
        digests = expected_digests(
            tokens, bs, fields.get("lora_id"), fields.get("cache_salt"), algorithm
        )
        wire = [to_wire(d, hash_format) for d in digests]
        assert event.block_hashes == wire[matched:], request
        assert event.parent_block_hash == (wire[matched - 1] if matched else None), request
        assert event.token_ids == tokens[matched * bs : len(digests) * bs], request
        assert event.lora_id == fields.get("lora_id")
        assert event.lora_name == fields.get("lora_name")
        all_hashes.extend(event.block_hashes)
    assert len(set(all_hashes)) == len(all_hashes), "lora_id / cache_salt must change hashes"

    raw = b"".join(published(daemon))
    if hash_format == "u64":
        big = [h for h in all_hashes if isinstance(h, int) and h >= 1 << 63]
        assert big, "the prompts should produce at least one hash >= 2^63"
        for h in big:
            assert b"\xcf" + h.to_bytes(8, "big") in raw
        assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in all_hashes)
    elif hash_format == "i64":
        low = [h for h in all_hashes if isinstance(h, int) and h < -(1 << 31)]
        assert low, "the prompts should produce at least one hash < -2^31"
        for h in low:
            assert b"\xd3" + h.to_bytes(8, "big", signed=True) in raw
        assert all(isinstance(h, int) and -(1 << 63) <= h < 1 << 63 for h in all_hashes)
    else:
        size = 32 if algorithm == "sha256" else 16
        for digest in all_hashes:
            assert isinstance(digest, bytes) and len(digest) == size
            assert b"\xc4" + bytes([size]) + digest in raw


def test_partial_tail_blocks_are_never_published(start_daemon: DaemonFactory) -> None:
    """Only full blocks are stored on the wire: a sub-block prompt publishes nothing, a prompt
    with a tail publishes its full blocks, and the tail appears once a later prompt fills it."""
    bs = 5
    daemon = start_daemon(cache={"block_size": bs})
    tokens = list(range(100, 100 + 3 * bs))
    with daemon.client() as client:
        client.store("tiny", tokens[:3])
        client.store("tail", tokens[: 2 * bs + 2])
        client.store("full", tokens)
    stores = stored_events("map", published(daemon))
    digests = expected_digests(tokens, bs)
    hashes = [to_wire(d, "u64") for d in digests]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stores] == [
        (hashes[:2], None, tokens[: 2 * bs]),
        (hashes[2:], hashes[1], tokens[2 * bs :]),
    ]
    for event in stores:
        assert event.block_size == bs
        assert len(event.token_ids) == len(event.block_hashes) * bs


def test_configured_medium_is_published(start_daemon: DaemonFactory) -> None:
    """events.medium replaces the pool's medium on stores and removals."""
    daemon = start_daemon(events={"medium": "cpu_tier"}, cache={"num_blocks": 2})
    with daemon.client() as client:
        client.store("a", list(range(32)))
        client.release("a")
        client.store("b", list(range(100, 132)))  # evicts both of a's blocks
    events = [e for p in published(daemon) for e in decode("map", p).events]
    stores = [e for e in events if isinstance(e, STORED)]
    removals = [e for e in events if isinstance(e, REMOVED)]
    assert len(stores) == 2 and len(removals) >= 1
    assert {e.medium for e in stores + removals} == {"cpu_tier"}


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_strict_vllm_decoders_accept_a_heartbeat(
    start_daemon: DaemonFactory, wire_format: str
) -> None:
    """An idle rank's heartbeat is ``[ts, [], rank]`` with the next seq: vLLM's strict
    decoders read it as a batch with no events, live and through replay alike."""
    daemon = start_daemon(events={"wire_format": wire_format, "heartbeat_ms": 100})
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"{daemon.events_endpoint}_dp0")
    try:
        assert sock.poll(10_000), "no heartbeat"
        _, seq_frame, payload = sock.recv_multipart()
    finally:
        sock.close()
    batch = decode(wire_format, payload)
    assert batch.events == [] and batch.data_parallel_rank == 0
    replayed = {m[1]: m[2] for m in replay_raw(f"{daemon.replay_endpoint}_dp0", 0)}
    assert replayed[seq_frame] == payload


def stores_of_arrays(arrays: list[np.ndarray]) -> list[Event]:
    """One BlockStored per array, the array itself as its token ids (as the sink hands them)."""
    return [
        BlockStored(
            block_hashes=[i],
            parent_block_hash=None,
            token_ids=a,  # type: ignore[arg-type]
            block_size=1,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        for i, a in enumerate(arrays)
    ]


@given(
    batches=st.lists(
        st.lists(
            st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40).map(
                lambda ids: np.asarray(ids, dtype=np.uint32)
            ),
            min_size=1,
            max_size=5,
        ),
        min_size=1,
        max_size=6,
    ),
    narrow=st.booleans(),
)
def test_one_encoder_writes_every_batch_of_token_arrays_exactly(
    batches: list[list[np.ndarray]], narrow: bool
) -> None:
    """One encoder, batch after batch (its buffers are reused: wider, narrower, larger,
    smaller): every decoder reads back exactly the token ids of each event."""
    encoder = BatchEncoder("map", 0)
    for arrays in batches:
        if narrow:
            arrays = [(a % 65536).astype(np.uint16) for a in arrays]
        payload = encoder.encode(1.0, stores_of_arrays(arrays))
        decoded = decode_batch(payload).events
        assert [e.token_ids for e in decoded] == [a.tolist() for a in arrays]  # type: ignore[union-attr]
        assert [e["token_ids"] for e in msgpack.unpackb(payload)[1]] == [a.tolist() for a in arrays]


def test_an_array_longer_than_a_16_bit_header_holds_is_written_whole() -> None:
    """Small ids (which fit 16-bit items) in an array of more than 65535 ids: the header must
    take the 32-bit form, and the shorter array beside it must still read back exactly."""
    long = (np.arange(70_000) % 1000).astype(np.uint32)
    short = np.arange(5, dtype=np.uint32)
    payload = BatchEncoder("map", 0).encode(1.0, stores_of_arrays([short, long, short]))
    decoded = msgpack.unpackb(payload)[1]
    assert [e["token_ids"] for e in decoded] == [short.tolist(), long.tolist(), short.tolist()]


def test_a_batch_larger_than_the_kept_buffer_and_one_after_it_read_back_whole() -> None:
    """A batch of several MB (the encoder does not keep a buffer that large), then a small
    one from the same encoder: each payload is exactly its own batch, nothing left over."""
    encoder = BatchEncoder("map", 0)
    huge = np.arange(1_500_000, dtype=np.uint32) + 70_000  # 5-byte items: 7.5 MB
    small = np.arange(3, dtype=np.uint32)
    for arrays in ([huge], [small]):
        decoded = msgpack.unpackb(encoder.encode(1.0, stores_of_arrays(arrays)))[1]
        assert [e["token_ids"] for e in decoded] == [a.tolist() for a in arrays]


def test_token_ids_of_every_kind_in_one_batch_read_back_exactly() -> None:
    """The cache's uint32 arrays beside token ids of other kinds (a list, signed and 64-bit
    arrays, one array in two events): each reads back as its own ids."""
    cache = [np.arange(i, i + 16, dtype=np.uint32) * 5000 for i in range(4)]
    kinds: list[Any] = [
        cache[0],
        [7, 8, 9],
        cache[1],
        np.arange(16, dtype=np.int64),
        cache[2],
        np.arange(16, dtype=np.uint64) + 2**40,
        cache[3],
        cache[3],
    ]
    encoder = BatchEncoder("map", 0)
    for _ in range(2):  # and the next batch from the same encoder
        decoded = msgpack.unpackb(encoder.encode(1.0, stores_of_arrays(kinds)))[1]
        assert [e["token_ids"] for e in decoded] == [np.asarray(k).tolist() for k in kinds]


def test_an_array_the_encoder_meets_among_the_token_arrays_is_not_taken_for_one() -> None:
    """Token ids the encoder writes as they are (a memoryview: bin), then block hashes given
    as an array, then a store of the cache's arrays: the encoder meets the hashes where it
    expects the next token array, and writes them as their own list."""
    tokens = np.arange(16, dtype=np.uint32) * 5000
    events: list[Any] = stores_of_arrays([memoryview(b"\x01\x02"), tokens])  # type: ignore[list-item]
    hashes = np.arange(3, dtype=np.uint64)
    events.insert(1, BlockRemoved(block_hashes=hashes, medium="GPU"))  # type: ignore[arg-type]
    decoded = msgpack.unpackb(BatchEncoder("map", 0).encode(1.0, events))[1]
    assert [decoded[0]["token_ids"], decoded[1]["block_hashes"], decoded[2]["token_ids"]] == [
        b"\x01\x02",
        [0, 1, 2],
        tokens.tolist(),
    ]


def test_block_hashes_given_as_an_array_between_stores_of_token_arrays_read_back_exactly() -> None:
    """An array the encoder meets among the token arrays (block hashes of a removal, given as
    an array): it is written as its own list, and each store keeps its own token ids."""
    tokens = [np.arange(i, i + 16, dtype=np.uint32) * 5000 for i in range(3)]
    events: list[Any] = stores_of_arrays(tokens)
    events.insert(1, BlockRemoved(block_hashes=np.arange(3, dtype=np.uint64), medium="GPU"))  # type: ignore[arg-type]
    decoded = msgpack.unpackb(BatchEncoder("map", 0).encode(1.0, events))[1]
    assert decoded[1]["block_hashes"] == [0, 1, 2]
    del decoded[1]
    assert [e["token_ids"] for e in decoded] == [t.tolist() for t in tokens]


@pytest.mark.skipif(
    not kv_events_path().is_file(),
    reason="vLLM's kv_events.py not extracted (kvpubd bench vllm-extract WHEEL)",
)
def test_vllm_decodes_every_batch_of_a_host_tier_stream(start_daemon: DaemonFactory) -> None:
    """A pool of 4 blocks over a host tier of 3 (cache.host_blocks): demotions, host-tier
    evictions, a promotion and resets of both scopes. Every batch decodes with vLLM's own
    ``KVEventBatch`` (its kv_events.py, loaded on its own) and with this file's strict
    structs, and the events name both media: the pool's "GPU", the host tier's "CPU"."""
    vllm_batch = msgspec.msgpack.Decoder(load_kv_events().KVEventBatch)
    daemon = start_daemon(cache={"num_blocks": 4, "host_blocks": 3})
    prompts = [[seed, *range(1, 2 * 16)] for seed in range(10_000, 10_005)]
    with daemon.client() as client:
        for n, tokens in enumerate([*prompts, prompts[2]]):  # the last one is promoted
            client.store(f"r{n}", tokens)
            client.release(f"r{n}")
        client.reset(tier="gpu")
        client.reset(tier="all")
        last = client.snapshot().seq
        first = client.stats().ranks[0].first_seq
    payloads = replay(rank_endpoint(daemon.replay_endpoint, 0), first, timeout=TIMEOUT)
    assert payloads[-1][0] >= last
    media: set[tuple[str, str | None]] = set()
    for _, payload in payloads:
        batch = vllm_batch.decode(payload)
        decode("map", payload)
        media.update((type(e).__name__, getattr(e, "medium", None)) for e in batch.events)
    assert {
        ("AllBlocksCleared", None),
        ("BlockStored", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),
        ("BlockRemoved", "CPU"),
    } <= media


# -- a relayed store's token ids, kept as the engine encoded them ----------------------------

_AS_RAW = msgspec.msgpack.Decoder(msgspec.Raw).decode


@pytest.mark.parametrize("count", [0, 1, 15, 16, 255, 65_535, 65_536])
def test_an_encoded_token_array_is_counted_from_its_header_and_decoded_whole(count: int) -> None:
    """Every msgpack array header (fixarray, array 16, array 32); a RelayedStored holding the
    encoded ids encodes byte for byte as the BlockStored holding the list."""
    tokens = list(range(count))
    encoded = _AS_RAW(msgspec.msgpack.encode(tokens))
    assert token_count(encoded) == count and token_list(encoded) == tokens
    size = max(count, 1)
    relayed = RelayedStored([1], None, encoded, size, None, "GPU", None)
    plain = BlockStored([1], None, tokens, size, None, "GPU", None)
    assert msgspec.msgpack.encode(relayed) == msgspec.msgpack.encode(plain)


@pytest.mark.parametrize("value", [None, "", "abc", "x" * 40, {"a": 1}, 5, b"xy", 1.5])
def test_encoded_token_ids_that_are_not_an_array_are_refused(value: object) -> None:
    with pytest.raises(ValueError, match="not an array"):
        token_count(_AS_RAW(msgspec.msgpack.encode(value)))
