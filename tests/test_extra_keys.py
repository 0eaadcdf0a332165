"""Salt and LoRA on the wire: ``extra_keys`` per block as vLLM 0.33 publishes them, the map
form's ``cache_salt`` (NVIDIA Dynamo reads it), and snapshots that repeat the stream exactly,
falsy LoRA values included. Decoded by this repository's strict vLLM-shaped decoders."""

from __future__ import annotations

from typing import Any

import pytest

from kvpubd.client import Mirror
from kvpubd.protocol.wire import decode_batch
from tests.conftest import DaemonFactory
from tests.streams import vllm_extra_keys
from tests.test_wire import STORED, MapBlockStored, decode, published

BS = 16


def prompt(seed: int, blocks: int) -> list[int]:
    return list(range(seed * 1000, seed * 1000 + blocks * BS))


# (request, tokens, store fields, blocks already cached, expected lora_name, salt)
SHARED = prompt(1, 3)
CASES: list[tuple[str, list[int], dict[str, Any], int, str | None, str | None]] = [
    ("plain", SHARED, {}, 0, None, None),
    ("salted", SHARED, {"cache_salt": "tenant-a"}, 0, None, "tenant-a"),
    # A longer prompt under the same salt: its new blocks are not the prompt's first, so no
    # block carries the salt in extra_keys (vLLM puts it on block 0 only), yet the map form
    # still names the salt.
    ("salted-more", [*SHARED, *prompt(2, 2)], {"cache_salt": "tenant-a"}, 3, None, "tenant-a"),
    ("lora", SHARED, {"lora_id": 4, "lora_name": "sql"}, 0, "sql", None),
    ("lora-salted", SHARED, {"lora_id": 4, "lora_name": "sql", "cache_salt": "t"}, 0, "sql", "t"),
    # lora_id without a name: a generated name, so name-keyed routers keep it apart too.
    ("lora-unnamed", SHARED, {"lora_id": 9}, 0, "lora-9", None),
    # Falsy values are values: published as given, never turned into nil.
    ("falsy", SHARED, {"lora_id": 0, "lora_name": "", "cache_salt": ""}, 0, "", ""),
]


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_extra_keys_and_cache_salt_follow_vllm(
    start_daemon: DaemonFactory, wire_format: str
) -> None:
    """Same tokens, plain vs salted vs LoRA: every store's extra_keys is what vLLM 0.33 would
    publish (LoRA name on every block, salt on the prompt's first block), lora_name names the
    adapter, and the map form carries cache_salt on every salted store."""
    daemon = start_daemon(events={"wire_format": wire_format})
    with daemon.client() as client:
        for request, tokens, fields, cached, _, _ in CASES:
            reply = client.store(request, tokens, **fields)
            assert reply.num_cached_tokens == cached * BS, request
    events = [e for payload in published(daemon) for e in decode(wire_format, payload).events]
    stores = [e for e in events if isinstance(e, STORED)]
    assert len(stores) == len(CASES)
    for (request, tokens, fields, cached, lora_name, salt), event in zip(
        CASES, stores, strict=True
    ):
        count = len(tokens) // BS - cached
        assert len(event.block_hashes) == count, request
        assert event.lora_id == fields.get("lora_id"), request
        assert event.lora_name == lora_name, request
        assert event.extra_keys == vllm_extra_keys(cached, count, lora_name, salt), request
        if wire_format == "map":
            assert isinstance(event, MapBlockStored)
            assert event.cache_salt == salt, request
    hashes = [h for e in stores[:2] + stores[3:] for h in e.block_hashes]
    assert len(set(hashes)) == len(hashes), "plain, salted and LoRA blocks must not collide"


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_mirror_from_the_stream_equals_the_snapshot(
    start_daemon: DaemonFactory, wire_format: str
) -> None:
    """A mirror rebuilt from every published batch equals the snapshot's, block for block,
    including lora_id, lora_name, extra_keys and cache_salt (falsy values too)."""
    daemon = start_daemon(events={"wire_format": wire_format}, cache={"num_blocks": 24})
    with daemon.client() as client:
        for request, tokens, fields, _, _, _ in CASES:
            client.store(request, tokens, **fields)
            client.release(request)
        client.store("evicts", prompt(7, 6))  # the pool is full: evictions
        client.release("evicts")
        snapshot = client.snapshot()
    stream = Mirror()
    for payload in published(daemon):
        stream.apply(decode_batch(payload).events)
    from_snapshot = Mirror()
    from_snapshot.apply(snapshot.events)
    assert stream.blocks == from_snapshot.blocks
    kept = list(stream.blocks.values())
    assert any(b.lora_name == "" and b.lora_id == 0 for b in kept), "falsy LoRA was evicted"
    assert any(b.extra_keys for b in kept)
    if wire_format == "map":
        assert any(b.cache_salt == "" for b in kept)
