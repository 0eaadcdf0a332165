"""Tables with an entry per block: each behaves as the dict or OrderedDict it replaces, and no
hash table a rank keeps grows with its blocks (CPython rebuilds a dict's whole table in one
call when it fills, deletions filling it too: at a million entries that held the loop for
50-330 ms, a reset waiting behind a store)."""

from __future__ import annotations

import gc
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpubd.daemon.block_tables import DigestDict, LruQueue, ShardedDict
from kvpubd.daemon.published import ValuedRecord
from kvpubd.daemon.radix import ROOT, RadixIndex
from kvpubd.daemon.reaper import CHUNK, _free_some
from tests.inprocess import in_process

# A rank this size with one plain dict of its blocks would hold one of BLOCKS entries.
BLOCKS = 4096
LIMIT = 512


def large_hash_tables(root: object, limit: int) -> list[str]:
    """The dicts and sets reachable from ``root`` through kvpubd's objects and plain
    containers (not modules, classes nor functions) holding more than ``limit`` entries."""
    found, seen = [], {id(root)}
    queue: deque[tuple[object, str]] = deque([(root, type(root).__name__)])
    while queue:
        obj, path = queue.popleft()
        if isinstance(obj, dict | set | frozenset) and len(obj) > limit:
            found.append(f"{path}: {type(obj).__name__} of {len(obj)}")
        if isinstance(obj, list | tuple | deque) and len(obj) > limit:
            continue  # per-block lists of ints and bytes: nothing below them
        for child in gc.get_referents(obj):
            if id(child) in seen:
                continue
            seen.add(id(child))
            module = getattr(type(child), "__module__", "")
            if isinstance(child, dict | set | frozenset | list | tuple | deque) or (
                module.startswith("kvpubd.") and not isinstance(child, type)
            ):
                queue.append((child, f"{path} > {type(child).__name__}"))
    return found


async def test_no_hash_table_of_a_full_rank_grows_with_its_blocks(tmp_path: Path) -> None:
    # One-block prompts: every cached block is an evictable leaf, the worst case for the
    # eviction queue. Past twice the pool's blocks, the pool and the host tier are full and churn.
    async with in_process(tmp_path, BLOCKS, host_blocks=BLOCKS) as daemon:
        for number in range(2 * BLOCKS + 100):
            tokens = (np.arange(16, dtype=np.int64) + 16 * number).tolist()
            assert (await daemon.call("store", request_id=f"r{number}", token_ids=tokens))["ok"]
            assert (await daemon.call("release", request_id=f"r{number}"))["ok"]
        host = daemon.cache.host
        assert host is not None
        assert len(daemon.cache.index) == BLOCKS and len(host.slot_of) == BLOCKS
        assert len(daemon.pipeline.sink.published) == BLOCKS
        assert large_hash_tables(daemon.pipeline, LIMIT) == []


def test_no_hash_table_of_the_relays_record_grows_with_its_blocks() -> None:
    record: ValuedRecord[Any, str] = ValuedRecord()
    for block in range(BLOCKS):
        assert record.add_valued([block, (1, block)], "store")
    assert len(record) == 2 * BLOCKS
    assert large_hash_tables(record, LIMIT) == []


def test_the_walk_finds_a_plain_dict_of_the_blocks() -> None:
    """The check above can fail: the same walk finds the tables these replaced."""

    class Holder:
        pass

    holder = Holder()
    holder.__dict__["table"] = {block: block for block in range(BLOCKS)}
    holder.__dict__["queue"] = OrderedDict.fromkeys(range(BLOCKS))
    assert len(large_hash_tables(holder, LIMIT)) == 2


def test_the_reaper_frees_a_retired_table_a_chunk_per_turn() -> None:
    """Retired per-block tables are freed CHUNK entries a loop turn, whatever their parts
    hold (a part at a time freed half a million entries in one turn: 30 ms)."""
    index = RadixIndex(64 * CHUNK)
    digests = [number.to_bytes(32, "big") for number in range(1, 64 * CHUNK + 1)]
    index.insert_run(digests, list(range(64 * CHUNK)), ROOT, None)
    record: ValuedRecord[Any, str] = ValuedRecord()
    assert record.add_valued(list(range(64 * CHUNK)), "store")
    for retired in (*index.clear(), record):
        turns = 1
        while not _free_some(retired):
            turns += 1
        assert turns >= 64  # 64 chunks' worth, not one turn


ints = st.integers(-(1 << 64), 1 << 64)
digests = st.binary(min_size=1, max_size=8)
# Each table with the keys its part rule takes: any hashable, digests.
tables = st.sampled_from(
    [
        (ShardedDict, st.one_of(ints, digests, st.tuples(ints, ints))),
        (DigestDict, digests),
    ]
)
OPS = ["assign", "pop_many", "del", "set", "pop_some"]


@settings(max_examples=300, deadline=None)
@given(
    tables.flatmap(
        lambda table: st.tuples(
            st.just(table[0]),
            st.lists(st.tuples(st.sampled_from(OPS), st.lists(table[1])), max_size=60),
        )
    )
)
def test_a_sharded_dict_behaves_as_a_dict(
    case: tuple[type[ShardedDict[Any, int]], list[Any]],
) -> None:
    table, ops = case
    sharded = table()
    model: dict[Any, int] = {}
    for number, (op, batch) in enumerate(ops):
        values = range(number * 100, number * 100 + len(batch))
        if op == "assign":
            sharded.assign(batch, values)
            model.update(zip(batch, values, strict=True))
        elif op == "pop_many":
            assert sharded.pop_many(batch) == [model.pop(key, None) for key in batch]
        elif op == "del" and batch and batch[0] in model:
            del sharded[batch[0]]
            del model[batch[0]]
        elif op == "set" and batch:
            sharded.assign(batch[:1], [number])
            model[batch[0]] = number
            assert sharded[batch[0]] == number and sharded.get(batch[0]) == number
        elif op == "pop_some":
            taken = sharded.pop_some(len(batch))
            assert len(taken) == min(len(batch), len(model)) == len(set(taken))
            for key in taken:
                del model[key]
        assert len(sharded) == len(model) and bool(sharded) == bool(model)
        assert sharded.get_many(batch) == [model.get(key) for key in batch]
        assert sorted(repr((key, sharded[key])) for key in sharded) == sorted(
            map(repr, model.items())
        )
        assert sorted(map(repr, sharded)) == sorted(map(repr, model))
        assert all((key in sharded) == (key in model) for key in batch)
        prefix = []
        for key in batch:
            if key not in model:
                break
            prefix.append(model[key])
        assert sharded.found_prefix(batch) == prefix


lru_ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "push_oldest", "discard", "touch", "pop", "clear"]),
        st.integers(0, 15),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(lru_ops)
def test_an_lru_queue_behaves_as_an_ordered_dict(ops: list[tuple[str, int]]) -> None:
    queue = LruQueue(16)
    model: OrderedDict[int, None] = OrderedDict()
    for op, item in ops:
        if op == "push" and item not in model:
            queue.push(item)
            model[item] = None
        elif op == "push_oldest" and item not in model:
            queue.push_oldest(item)
            model[item] = None
            model.move_to_end(item, last=False)
        elif op == "discard":
            assert queue.discard(item) == (model.pop(item, 0) is None)
        elif op == "touch":
            queue.touch(item)
            if item in model:
                model.move_to_end(item)
        elif op == "pop" and model:
            assert queue.pop_oldest() == model.popitem(last=False)[0]
        elif op == "clear":
            queue.clear()
            model.clear()
        assert list(queue) == list(model) and len(queue) == len(model)
        assert all((item in queue) == (item in model) for item in range(16))
