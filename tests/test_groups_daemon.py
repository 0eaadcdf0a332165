"""A hybrid model's KV cache groups (``cache.groups``: full attention, then a sliding window of
64 tokens over a small pool of its own) through the daemon's real sockets, followed by the
consumers a hybrid stream has: kvpubd's own subscriber, vLLM 0.34's decoders, a consumer written
from vLLM's documentation of the group fields, and one that follows llm-d's group rules.

Every group shares one chain of hashes (the same hash is live in several groups, told apart
by ``group_idx`` alone), a window group lets go of blocks the full group keeps, and
``AllBlocksCleared`` clears every group: each consumer must end with the daemon's snapshot,
group by group (or, for llm-d, its full-attention group)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import msgspec
import pytest

from kvpubd.client import ControlClient, Subscriber, replay
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockStored
from kvpubd.tools.vllm_source import kv_events_path, load_kv_events
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.hybrid import (
    FULL,
    KINDS,
    WINDOW,
    Coverage,
    as_map,
    group_hashes,
    hybrid_cache,
    random_workload,
    window_orphans,
)
from tests.llmd import LlmdIndex, LlmdSubscriber, Timings, _hash
from tests.mirrors import (
    AsyncDriven,
    Record,
    assert_mirror_is_snapshot,
    snapshot_mirror,
    store_released,
    subscriber,
    unique_prompt,
)
from tests.streams import BLOCK_SIZE, chain_hashes

TIMEOUT = 10.0
STEPS = 150
RING = 64  # events.buffer_steps of a daemon joined late


def published(daemon: Daemon) -> list[bytes]:
    """Every batch of the run so far, replayed from its first (the history holds them all)."""
    with daemon.client() as client:
        last = client.snapshot().seq
        first = client.stats().ranks[0].first_seq
    payloads = replay(rank_endpoint(daemon.replay_endpoint, 0), first, timeout=TIMEOUT)
    assert payloads[0][0] == first and payloads[-1][0] >= last, "the history lost batches"
    return [payload for _, payload in payloads]


def snapshot_groups(client: ControlClient, rank: int = 0) -> dict[int, set[BlockHash]]:
    return group_hashes(snapshot_mirror(client.snapshot(rank)))


# -- kvpubd's subscriber --------------------------------------------------------------------


def follow(join: str, daemon: Daemon, record: Record) -> Subscriber | AsyncDriven:
    if join == "snapshot-endpoint":
        return Subscriber(
            daemon.events_endpoint,
            snapshot_endpoint=daemon.snapshot_endpoint,
            snapshot_timeout=5.0,
            **record.callbacks(),
        )
    return subscriber("sync" if join == "start" else "async", daemon, record)


@pytest.mark.parametrize("join", ["start", "late", "snapshot-endpoint"])
def test_a_subscribers_mirror_is_the_snapshot_group_by_group(
    start_daemon: DaemonFactory, join: str
) -> None:
    """Random stores, releases, evictions (in both groups) and resets: the subscriber's mirror
    ends exactly the daemon's snapshot, group by group, and it never found the stream broken
    (a violation would have been repaired from a snapshot unseen). Joined at the start (sync
    form), late after the history left the ring (async form: the daemon answers its replay
    with a snapshot batch), or through the snapshot protocol (``events.snapshot_endpoint``)."""
    settings: dict[str, dict[str, Any]] = {
        "start": {},
        "late": {"buffer_steps": RING},
        "snapshot-endpoint": {"snapshot_endpoint": True},
    }
    events = settings[join]
    daemon = start_daemon(cache=hybrid_cache(), events=events)
    record = Record()
    with daemon.client() as client:
        if join != "start":
            random_workload(client, seed=11, steps=STEPS // 2)
            for _ in range(RING):  # a batch each: the run's first batches leave the ring
                store_released(client, unique_prompt(1))
                client.snapshot()
        sub = follow(join, daemon, record)
        try:
            sub.catch_up()
            if join == "late":  # the replay was answered with the daemon's snapshot batch
                first = record.batches[0][0].batch.events
                assert isinstance(first[0], AllBlocksCleared)
                assert {
                    e.group_idx for e in first[1:] if isinstance(e, BlockStored)
                } == KINDS.keys()
            # Received live (gaps replayed) as the stream goes: it is what the mirror follows.
            random_workload(client, seed=12, steps=STEPS, each_step=lambda: sub.receive(0))
            assert_mirror_is_snapshot(sub, client, [0])
            mirror = sub.mirror(0)
            assert mirror is not None and window_orphans(mirror) > 0
            assert {g: (k.kind, k.sliding_window) for g, k in mirror.group_kinds.items()} == KINDS
            counters = sub.counters
            assert (counters.violations, counters.lost, counters.malformed) == (0, 0, 0)
        finally:
            sub.close()
    if join == "start":
        coverage = Coverage()
        for batch in record.batches[0]:
            coverage.see([as_map(event) for event in batch.batch.events])
        coverage.assert_complete()


# -- vLLM 0.34's decoders -------------------------------------------------------------------


def vllm_decoder(wire_format: str) -> Callable[[bytes], Any]:
    """vLLM 0.34's own ``KVEventBatch`` (its kv_events.py, loaded on its own) for maps; for
    the array form (vLLM <= 0.23's), its own event declarations read as arrays, field by
    field in their order (the fields after the array's end keep their defaults)."""
    module = load_kv_events()
    if wire_format == "map":
        return msgspec.msgpack.Decoder(module.KVEventBatch).decode
    twins = []
    for cls in (module.BlockStored, module.BlockRemoved, module.AllBlocksCleared):
        spec = [
            (f.name, f.type) if f.required else (f.name, f.type, f.default)
            for f in msgspec.structs.fields(cls)
        ]
        tag = cls.__struct_config__.tag
        twins.append(msgspec.defstruct(cls.__name__, spec, array_like=True, tag=tag))
    events: Any = twins[0] | twins[1] | twins[2]
    batch = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[events]), ("data_parallel_rank", int | None, None)],
        array_like=True,
    )
    return msgspec.msgpack.Decoder(batch).decode


class DocumentedReader:
    """A consumer written from vLLM's documentation of the group fields: "store events carry
    cache-spec metadata so consumers can classify and filter groups as they are learned;
    remove events only need group_idx + hash". It reads events in map form (vLLM's field
    names), keeps a set of hashes per group and the (kind, window) each group's stores gave;
    ``AllBlocksCleared`` empties every group."""

    def __init__(self) -> None:
        self.kinds: dict[int | None, tuple[str | None, int | None]] = {}
        self.held: dict[int | None, set[BlockHash]] = {}

    def apply(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            group = event.get("group_idx")
            if event["type"] == "AllBlocksCleared":
                self.held.clear()
            elif event["type"] == "BlockStored":
                window = event.get("kv_cache_spec_sliding_window")
                self.kinds[group] = (event.get("kv_cache_spec_kind"), window)
                self.held.setdefault(group, set()).update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                self.held.get(group, set()).difference_update(event["block_hashes"])

    def groups(self) -> dict[int | None, set[BlockHash]]:
        return {group: hashes for group, hashes in self.held.items() if hashes}


@pytest.mark.skipif(
    not kv_events_path().is_file(),
    reason="vLLM's kv_events.py not extracted (kvpubd bench vllm-extract WHEEL)",
)
@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_vllm_decodes_every_batch_of_a_hybrid_stream(
    start_daemon: DaemonFactory, wire_format: str
) -> None:
    """A prompt, then it extended (the window group holds only the window before the cached
    prefix's end, and stores under the full group's chain), a prompt that makes the window
    group evict the first one's leading blocks, one that evicts from both groups, a reset and
    the first prompt again. Every batch decodes with vLLM's types; the stores carry each
    group's kind and window and exactly the tokens of their blocks, every removal its group;
    the stream, read per group, is the snapshot."""
    decode = vllm_decoder(wire_format)
    daemon = start_daemon(
        cache=hybrid_cache(num_blocks=16, window_blocks=12), events={"wire_format": wire_format}
    )
    first, other, last = unique_prompt(8), unique_prompt(6), unique_prompt(2)
    extended = first + unique_prompt(2) + [5] * (BLOCK_SIZE // 2)
    a = chain_hashes(extended)
    with daemon.client() as client:
        for tokens in (first, extended, other, last):
            store_released(client, tokens)
        client.reset()
        store_released(client, first)
        expected = snapshot_groups(client)
    batches = [decode(payload) for payload in published(daemon)]
    events = [event for batch in batches for event in batch.events]
    stores = [
        (e.group_idx, e.block_hashes, e.parent_block_hash)
        for e in events
        if type(e).__name__ == "BlockStored"
    ]
    o, z = chain_hashes(other), chain_hashes(last)
    assert stores == [
        *[(group, a[:8], None) for group in (FULL, WINDOW)],
        *[(group, a[8:], a[7]) for group in (FULL, WINDOW)],
        *[(group, o, None) for group in (FULL, WINDOW)],
        *[(group, z, None) for group in (FULL, WINDOW)],
        *[(group, a[:8], None) for group in (FULL, WINDOW)],
    ]
    prompts = [(a, extended), (o, other), (z, last)]  # (chain, tokens)
    for event in events:
        if type(event).__name__ == "BlockStored":
            kind = (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
            assert kind == KINDS[event.group_idx] and event.block_size == BLOCK_SIZE
            chain, tokens = next(p for p in prompts if event.block_hashes[0] in p[0])
            start = chain.index(event.block_hashes[0]) * BLOCK_SIZE
            assert event.token_ids == tokens[start : start + len(event.token_ids)]
            assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
    removals = [
        (e.group_idx, set(e.block_hashes)) for e in events if type(e).__name__ == "BlockRemoved"
    ]
    # The window group (12 blocks) let the first prompt's leading 4 go for the other one's 6;
    # the last prompt's 2 blocks took the extension's 2 from both groups.
    assert removals == [(WINDOW, set(a[:4])), (FULL, set(a[8:])), (WINDOW, set(a[8:]))]
    reader = DocumentedReader()
    for batch in batches:
        reader.apply([as_map(event) for event in batch.events])
    assert reader.groups() == expected
    assert expected == {FULL: set(a[:8]), WINDOW: set(a[:8])}


def test_a_consumer_of_vllms_documented_fields_holds_each_group(
    start_daemon: DaemonFactory,
) -> None:
    """The documented consumer, reading the map form with any msgpack decoder, after random
    stores, releases, evictions and resets: its hashes per group are the snapshot's, and it
    learned each group's kind and window."""
    daemon = start_daemon(cache=hybrid_cache())
    with daemon.client() as client:
        random_workload(client, seed=21, steps=STEPS)
        expected = snapshot_groups(client)
    reader, coverage = DocumentedReader(), Coverage()
    for payload in published(daemon):
        events = msgpack.unpackb(payload)[1]
        reader.apply(events)
        coverage.see(events)
    assert reader.groups() == expected
    assert reader.kinds == KINDS
    coverage.assert_complete()


# -- llm-d ----------------------------------------------------------------------------------


def test_llmd_indexes_the_full_attention_group(start_daemon: DaemonFactory) -> None:
    """A consumer that follows llm-d's rules (tests/llmd.py, its group rule included) over
    random stores, releases, evictions and resets: it holds exactly the snapshot's
    full-attention group (the window group's stores and removals left out)."""
    topic = "kv@pod-0@m"
    daemon = start_daemon(cache=hybrid_cache(), events={"topic": topic, "heartbeat_ms": 200})
    llmd = LlmdSubscriber(
        LlmdIndex(),
        rank_endpoint(daemon.events_endpoint, 0),
        rank_endpoint(daemon.replay_endpoint, 0),
        topic,
        Timings(retry_interval=0.2, replay_idle_timeout=1.0),
    )
    llmd.start()
    try:
        with daemon.client() as client:
            random_workload(client, seed=31, steps=STEPS)
            wanted = {_hash(h) for h in snapshot_groups(client).get(FULL, set())}

        def holds() -> bool:
            return llmd.index.blocks("pod-0") == wanted

        wait_for(holds, what=f"llm-d to hold the full-attention group; its log: {llmd.log}")
        assert wanted and "replay incomplete" not in " ".join(llmd.log)
        assert llmd.index.groups["pod-0"] == {FULL: True, WINDOW: False}
    finally:
        llmd.close()


def test_llmd_skips_a_store_that_is_not_dense() -> None:
    """llm-d hashes a store's tokens a block at a time: a store whose token ids are not
    ``block_size`` per hash is not indexed (nor is a window group's), a dense one is."""
    index = LlmdIndex()

    def store(tokens: int, **group: Any) -> dict[str, Any]:
        fields = {"block_hashes": [1, 2], "token_ids": [0] * tokens, "block_size": 4}
        return {"type": "BlockStored", "parent_block_hash": None, **fields, **group}

    window = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
    full = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    for event, held in ((store(7, **full), set()), (store(8, **window), set()), (store(8), {1, 2})):
        index.apply("kv@p@m", msgpack.packb([0.0, [event], 0]))
        assert index.blocks("p") == held
