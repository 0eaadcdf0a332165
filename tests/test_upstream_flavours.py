"""FlavourDecoder: each engine's payloads into kvpubd's canonical events. Payloads come from the
engines' own event types where their files are here (vLLM's and SGLang's kv_events.py), and
otherwise are written out as the engines' sources declare them (older SGLang releases'
arrays, TensorRT-LLM's streaming publisher)."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import msgspec
import pytest

from kvpubd.protocol import wire
from kvpubd.upstream.flavours import FlavourDecoder, UpstreamPayloadError
from tests.upstream_engines import engine_module

STORED_MAP = {
    "type": "BlockStored",
    "block_hashes": [1],
    "parent_block_hash": None,
    "token_ids": [1],
    "block_size": 1,
}


def stored(**fields: Any) -> wire.BlockStored:
    base: dict[str, Any] = {
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [5, 6],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return wire.BlockStored(**{**base, **fields})


def test_vllm_own_map_form_keeps_groups_and_drops_what_kvpubd_does_not_carry() -> None:
    kv = engine_module("vllm")
    event = kv.BlockStored(
        block_hashes=[b"\x01" * 32, 2],
        parent_block_hash=b"\x00" * 32,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("adapter", ("mm", 0)), None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="LOCAL",
        session_id="s",
        lookahead_token_ids=[[9], [9]],
    )
    batch = kv.KVEventBatch(
        ts=1.5, events=[event, kv.BlockRemoved(block_hashes=[2], medium="CPU", group_idx=1)]
    )
    batch.data_parallel_rank = 3
    decoded = FlavourDecoder("vllm").decode(msgspec.msgpack.encode(batch))
    assert (decoded.ts, decoded.rank) == (1.5, 3)
    assert decoded.events == [
        stored(
            block_hashes=[b"\x01" * 32, 2],
            parent_block_hash=b"\x00" * 32,
            token_ids=[1, 2, 3, 4],
            medium="CPU",
            lora_name="adapter",
            extra_keys=[("adapter", ["mm", 0]), None],
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
        wire.BlockRemoved([2], "CPU", 1),
    ]


def test_vllm_array_forms_old_and_new() -> None:
    """<= 0.23 sends tagged arrays; releases before ``medium``/``lora_name`` shorter ones; a
    4th batch element (the snapshot protocol's publisher id) is ignored."""
    old = ["BlockStored", [7], None, [5, 6], 2, None]
    new = ["BlockStored", [7], 6, [5, 6], 2, 4, "CPU", "a", None, 2, "full", None]
    payload = msgpack.packb(
        [2.0, [old, new, ["BlockRemoved", [7], "CPU", 2], ["AllBlocksCleared"]], 1, b"i" * 16]
    )
    decoded = FlavourDecoder("vllm").decode(payload)
    assert decoded.rank == 1
    assert decoded.events == [
        stored(block_hashes=[7]),
        stored(
            block_hashes=[7],
            parent_block_hash=6,
            lora_id=4,
            medium="CPU",
            lora_name="a",
            group_idx=2,
            kv_cache_spec_kind="full",
        ),
        wire.BlockRemoved([7], "CPU", 2),
        wire.AllBlocksCleared(),
    ]


def test_sglang_own_events_fill_medium_and_keep_signed_hashes() -> None:
    kv = engine_module("sglang")
    events = [
        kv.BlockStored(
            block_hashes=[-(2**63), 2**63 - 1],
            parent_block_hash=-5,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            cache_salt="salt",
            session_id="s",
        ),
        kv.BlockStored(
            block_hashes=[-1],
            parent_block_hash=None,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
            medium=kv.StorageMedium.CPU,
            lora_name="adapter",
        ),
        kv.BlockRemoved(block_hashes=[-1]),
        kv.AllBlocksCleared(),
    ]
    payload = msgspec.msgpack.encode(kv.KVEventBatch(ts=time.time(), events=events, attn_dp_rank=2))
    decoded = FlavourDecoder("sglang", medium_aliases={"CPU_PINNED": "CPU"}).decode(payload)
    assert decoded.rank == 2
    assert decoded.events == [
        stored(
            block_hashes=[-(2**63), 2**63 - 1],
            parent_block_hash=-5,
            token_ids=[1, 2, 3, 4],
            cache_salt="salt",
        ),
        stored(block_hashes=[-1], token_ids=[1, 2], medium="CPU", lora_name="adapter"),
        wire.BlockRemoved([-1], "GPU"),
        wire.AllBlocksCleared(),
    ]


def test_sglang_bigram_pages_stand_for_their_first_tokens() -> None:
    """A bigram (EAGLE) page sends (t[i], t[i+1]) per position."""
    kv = engine_module("sglang")
    event = kv.BlockStored(
        block_hashes=[3],
        parent_block_hash=None,
        token_ids=[(5, 6), (6, 9)],
        block_size=2,
        lora_id=None,
    )
    payload = msgspec.msgpack.encode(kv.KVEventBatch(ts=1.0, events=[event]))
    assert FlavourDecoder("sglang").decode(payload).events == [
        stored(block_hashes=[3], token_ids=[5, 6])
    ]


def test_sglang_older_array_forms() -> None:
    """The first releases: [ts, events], no medium; later ones: medium, the rank, and
    BlockStoredWithMetadata's trailing {"cache_salt": ...}."""
    first = msgpack.packb(
        [1.0, [["BlockStored", [-3], None, [5, 6], 2, None], ["BlockRemoved", [-3]]]]
    )
    decoded = FlavourDecoder("sglang", default_medium="HBM").decode(first)
    assert decoded.rank is None
    assert decoded.events == [
        stored(block_hashes=[-3], medium="HBM"),
        wire.BlockRemoved([-3], "HBM"),
    ]
    later = msgpack.packb(
        [1.0, [["BlockStored", [-3], 8, [5, 6], 2, None, "DISK", {"cache_salt": "t"}]], 1]
    )
    assert FlavourDecoder("sglang").decode(later).events == [
        stored(block_hashes=[-3], parent_block_hash=8, medium="DISK", cache_salt="t")
    ]


def trtllm_stored(**fields: Any) -> dict[str, Any]:
    """A BlockStored as TensorRT-LLM's streaming publisher sends it (a tagged map)."""
    return {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, 5],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "mm_keys": [[{"type": "mm_key", "hash": "ab", "start_offset": 0}], []],
        **fields,
    }


def test_trtllm_streaming_maps() -> None:
    payload = msgpack.packb(
        [1.0, [trtllm_stored(), {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}], 0]
    )
    decoded = FlavourDecoder("trtllm").decode(payload)
    assert decoded.rank == 0
    assert decoded.events == [
        stored(block_hashes=[2**64 - 1, 5], token_ids=[1, 2, 3, 4]),
        wire.BlockRemoved([5], "GPU"),
    ]


@pytest.mark.parametrize(
    ("flavour", "payload"),
    [
        ("vllm", b"\xc1"),  # never-used msgpack byte
        ("vllm", msgpack.packb([1.0, [{"type": "BlockStored"}], 0])),  # fields missing
        ("vllm", msgpack.packb([1.0, [["Unknown", 1]], 0])),
        ("vllm", msgpack.packb([1.0, [{**STORED_MAP, "token_ids": [-1]}], 0])),
        ("vllm", msgpack.packb([1.0, [{**STORED_MAP, "token_ids": [2**32]}], 0])),
        ("vllm", msgpack.packb([1.0, [{**STORED_MAP, "block_size": 0}], 0])),
        ("vllm", msgpack.packb({"ts": 1.0})),
        ("vllm", msgpack.packb(["soon", [], 0])),  # a ts that is no number
        ("vllm", msgpack.packb([1.0, [], "rank 0"])),
        ("vllm", msgpack.packb([1.0, [], 0]) + b"\x00"),  # trailing bytes
        ("vllm", msgpack.packb([1.0, [STORED_MAP]])[:-3]),  # cut short
        ("vllm", b"\x91" * 100_000 + b"\x01"),  # nested past the decoder's limit
        ("sglang", msgpack.packb([1.0, [{**STORED_MAP, "block_hashes": [b"x"]}]])),
        ("sglang", msgpack.packb([1.0, [["BlockStored", [1], None, [[1, -2]], 1, None]]])),
        ("trtllm", msgpack.packb([1.0, [trtllm_stored(token_ids=["<image>", 1])], 0])),
        ("trtllm", msgpack.packb([1.0, [["BlockRemoved", [5], "GPU"]], 0])),  # no array form
    ],
)
def test_what_is_no_batch_raises_the_one_error(flavour: str, payload: bytes) -> None:
    decoder = FlavourDecoder(flavour)  # type: ignore[arg-type]
    with pytest.raises(UpstreamPayloadError):
        decoder.decode(payload)
    with pytest.raises(UpstreamPayloadError):  # a slice of each event: refused the same
        list(decoder.decode_stepwise(payload, slice_bytes=1))


def test_a_payload_over_the_limit_is_refused_before_decoding() -> None:
    payload = msgpack.packb([1.0, [], 0])
    with pytest.raises(UpstreamPayloadError, match="over the"):
        FlavourDecoder("vllm", max_payload_bytes=len(payload) - 1).decode(payload)
    assert FlavourDecoder("vllm", max_payload_bytes=len(payload)).decode(payload).events == []


def test_an_unknown_flavour_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown engine flavour"):
        FlavourDecoder("llamacpp")  # type: ignore[arg-type]


def stepwise_payloads() -> list[tuple[str, bytes]]:
    """(flavour, payload) of each event form a flavour sends, many events a batch: vLLM's and
    SGLang's own types (where their files are here) and the array and map forms above."""
    old_vllm = ["BlockStored", [7], None, [5, 6], 2, None]
    sglang_array = ["BlockStored", [1], None, [[1, 2], [3, 4]], 2, None]
    forms: list[tuple[str, list[Any]]] = [
        ("vllm", [STORED_MAP, {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}]),
        ("vllm", [old_vllm, ["AllBlocksCleared"]]),
        ("sglang", [sglang_array, STORED_MAP]),
        ("trtllm", [trtllm_stored(), {"type": "BlockRemoved", "block_hashes": [5]}]),
    ]
    return [(f, msgpack.packb([1.0, events * 2_000, 3])) for f, events in forms]


@pytest.mark.parametrize(("flavour", "payload"), stepwise_payloads())
@pytest.mark.parametrize("tokens_encoded", [False, True])
def test_a_batch_decoded_stepwise_is_the_batch_decoded_whole(
    flavour: str, payload: bytes, tokens_encoded: bool
) -> None:
    """A slice of events at a time, each at most the bytes asked (an event larger than that
    alone), and the same batch in the end."""
    decoder = FlavourDecoder(flavour, tokens_encoded=tokens_encoded)  # type: ignore[arg-type]
    steps = list(decoder.decode_stepwise(payload, slice_bytes=1_000))
    *sizes, batch = steps
    assert batch == decoder.decode(payload)
    assert len(sizes) > 1 and all(isinstance(size, int) and size <= 1_000 for size in sizes)
    # Every event's bytes in one slice or another: all of the payload but its envelope.
    assert len(payload) - 20 < sum(sizes) < len(payload)  # type: ignore[arg-type]


def test_a_large_event_is_a_slice_of_its_own_and_a_bad_one_refuses_the_batch() -> None:
    big = {**STORED_MAP, "block_hashes": list(range(500)), "token_ids": [1] * 500}
    payload = msgpack.packb([1.0, [STORED_MAP, big, STORED_MAP], 0])
    sizes = list(FlavourDecoder("vllm").decode_stepwise(payload, slice_bytes=100))[:-1]
    assert sizes == [len(msgpack.packb(e)) for e in (STORED_MAP, big, STORED_MAP)]
    bad = msgpack.packb([1.0, [STORED_MAP] * 100 + [{**STORED_MAP, "token_ids": [-1]}], 0])
    with pytest.raises(UpstreamPayloadError):
        list(FlavourDecoder("vllm").decode_stepwise(bad, slice_bytes=100))
    with pytest.raises(UpstreamPayloadError, match="over the"):
        list(FlavourDecoder("vllm", max_payload_bytes=10).decode_stepwise(bad))
