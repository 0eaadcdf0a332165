"""``kvpubd bench blockpool``: the CPU each newly stored block costs in vLLM's own KV cache block
pool (its unmodified ``BlockPool``, loaded by vllm_blockpool) doing what its scheduler does for
new requests with prefix caching and KV events on, beside kvpubd's rank pipeline (cache, sink,
encoder) doing the same store and release in this process, without sockets. Both get
``bench throughput``'s prompts."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from itertools import islice
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import typer
import zmq
from rich.console import Console
from rich.table import Table

from kvpubd.exits import check_positive
from kvpubd.protocol.hashing import HashAlgorithm
from kvpubd.tools.bench_prompts import make_prompts
from kvpubd.tools.bench_report import err

BLOCK_SIZE = 16
NUM_BLOCKS = 400_000
# vLLM's KV cache manager for one full-attention group (a plain decoder model): group 0, and
# the metadata it stamps on each BlockStored it takes from the pool.
GROUP_ID = 0
SPEC_KIND = "full_attention"

AlgorithmChoice = Literal["sha256", "xxhash", "both"]


def _us_per_block(cpu_s: float, blocks: int) -> float | None:
    return round(cpu_s / blocks * 1e6, 3) if blocks else None


def measure_vllm(
    prompts: list[bytes],
    hash_algorithm: HashAlgorithm,
    num_blocks: int = NUM_BLOCKS,
    block_size: int = BLOCK_SIZE,
) -> dict[str, Any]:
    """vLLM's BlockPool through its scheduler's path for each prompt as a new request: the
    request built with vLLM's block hasher (its hashes computed then), the longest cached prefix
    looked up, those blocks touched, new blocks allocated (evicting: BlockRemoved), the full
    blocks cached (BlockStored), the step's events taken and encoded as one ``KVEventBatch``
    by msgspec's msgpack encoder (what ZmqEventPublisher sends), then the request freed (its
    blocks in reverse, as the manager frees them). The whole prompt is one step."""
    from kvpubd.tools import vllm_blockpool

    vllm = vllm_blockpool.load()
    pool_module, utils = vllm.block_pool, vllm.kv_cache_utils
    kv_events = vllm.kv_events
    hash_fn = vllm.hashing.get_hash_fn_by_name(hash_algorithm)
    utils.init_none_hash(hash_fn)
    hasher = utils.get_request_block_hasher(block_size, hash_fn)
    request_type = vllm.request.Request
    block_stored, batch_type = kv_events.BlockStored, kv_events.KVEventBatch
    encoder = kv_events.msgspec.msgpack.Encoder()
    params = vllm.sampling_params(max_tokens=1)
    # What the frontend hands the engine: an int32 array per prompt.
    token_arrays = [np.frombuffer(prompt, dtype="<i4") for prompt in prompts]
    group_ids = [GROUP_ID]

    pool = pool_module.BlockPool(
        num_blocks, enable_caching=True, hash_block_size=block_size, enable_kv_cache_events=True
    )
    # The engine freezes its startup heap (the pool's blocks among it) out of the collector's
    # reach, as the daemon does.
    vllm.gc_utils.freeze_gc_heap()
    stored = removed = batches = payload_bytes = 0
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    try:
        for number, tokens in enumerate(token_arrays):
            request = request_type(
                request_id=str(number),
                prompt_token_ids=tokens,
                sampling_params=params,
                pooling_params=None,
                block_hasher=hasher,
            )
            # get_computed_blocks: the longest run of cached blocks, leaving the last token
            # to compute.
            hit_blocks = request.get_max_cache_hit_length() // block_size
            computed = []
            for block_hash in islice(request.block_hashes, hit_blocks):
                cached = pool.get_cached_block(block_hash, group_ids)
                if not cached:
                    break
                computed.append(cached[0])
            # allocate_slots: touch the hits, allocate the rest, cache the full blocks.
            pool.touch(computed)
            num_tokens = request.num_tokens
            needed = -(-num_tokens // block_size) - len(computed)
            blocks = computed + pool.get_new_blocks(needed)
            full_blocks = min(num_tokens, len(request.block_hashes) * block_size) // block_size
            pool.cache_full_blocks(
                request, blocks, len(computed), full_blocks, block_size, GROUP_ID
            )
            # The step's end: the manager's take_events, then one batch to the publisher.
            events = pool.take_events()
            for event in events:
                if type(event) is block_stored:
                    event.kv_cache_spec_kind = SPEC_KIND
                    event.kv_cache_spec_sliding_window = None
                    stored += len(event.block_hashes)
                else:
                    removed += len(getattr(event, "block_hashes", ()))
            if events:
                batch = batch_type(ts=time.time(), events=events, data_parallel_rank=0)
                payload_bytes += len(encoder.encode(batch))
                batches += 1
            # The request finishes: its blocks freed, tail first.
            pool.free_blocks(reversed(blocks))
        cpu = time.process_time() - cpu_start
        wall = time.perf_counter() - wall_start
    finally:
        gc.unfreeze()
    return {
        "hash_algorithm": hash_algorithm,
        "vllm_version": vllm.version,
        "requests": len(prompts),
        "stored_blocks": stored,
        "removed_blocks": removed,
        "batches": batches,
        "payload_bytes": payload_bytes,
        "cpu_s": round(cpu, 3),
        "us_per_block": _us_per_block(cpu, stored),
        "blocks_per_s": round(stored / wall) if wall else None,
    }


def measure_kvpubd(
    prompts: list[bytes],
    hash_algorithm: HashAlgorithm,
    num_blocks: int = NUM_BLOCKS,
    block_size: int = BLOCK_SIZE,
) -> dict[str, Any]:
    """kvpubd's rank pipeline (the daemon's cache, sink and batch encoder, with the null
        transport: no sockets) storing and releasing each prompt as the control ops ``store`` and
        ``release`` do, the packed tokens decoded as the daemon decodes them. Batches go out as
        the daemon's do: at each tick of the drain (every ``events.tick_interval_ms``, between
    requests) and whenever 1 024 blocks are captured."""
    from kvpubd.daemon.drain import Drain
    from kvpubd.daemon.hooks import NullMetrics
    from kvpubd.daemon.pipeline import RankPipeline
    from kvpubd.daemon.reaper import Reaper
    from kvpubd.daemon.settings import Settings
    from kvpubd.protocol.control import Store
    from kvpubd.protocol.hashing import tokens_array
    from kvpubd.protocol.wire import BlockRemoved, BlockStored
    from kvpubd.tools.bench_probe import TINY_BLOCKS

    stored = removed = 0

    class Counting(NullMetrics):
        def published(self, rank: int, events: Any) -> None:
            nonlocal stored, removed
            for event in events:
                if type(event) is BlockStored:
                    stored += len(event.block_hashes)
                elif type(event) is BlockRemoved:
                    removed += len(event.block_hashes)

    with tempfile.TemporaryDirectory(prefix="kvpbp") as tmp:
        settings = Settings(
            cache={
                **TINY_BLOCKS,
                "num_blocks": num_blocks,
                "block_size": block_size,
                "hash_algorithm": hash_algorithm,
            },
            events={
                "publisher": "null",
                "seq_origin": "zero",
                "heartbeat_ms": 0,
                "buffer_steps": 1000,
            },
            control={"endpoint": f"ipc://{tmp}/control"},
        )
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()  # the null transport's: unused
        pipelines: list[RankPipeline] = []
        drain = Drain(pipelines, settings.events.tick_interval_ms / 1000)
        pipeline = RankPipeline(0, settings, context, Counting(), Reaper(), drain)
        pipelines.append(pipeline)
        try:
            pipeline.start()
            gc.freeze()  # as the daemon does once started
            tick_s = drain.interval_s
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            next_tick = wall_start + tick_s
            for number, prompt in enumerate(prompts):
                # The tokens go beside the request, decoded (the pipeline reads its id and keys).
                request = Store(request_id=number, token_ids=msgspec.Raw(b""))
                reply = pipeline.store(request, tokens_array(prompt))
                assert not hasattr(reply, "then"), "a store the daemon would run in slices"
                pipeline.release(number)
                # The drain's tick, between requests as the event loop would run it.
                now = time.perf_counter()
                if now >= next_tick:
                    pipeline.flush(new_tick=True)
                    pipeline.compact()
                    next_tick = now + tick_s
            pipeline.flush()
            cpu = time.process_time() - cpu_start
            wall = time.perf_counter() - wall_start
            batches = pipeline.publisher.history.batches - 1  # not the startup marker's
            dropped = pipeline.sink.dropped_stored_blocks
        finally:
            gc.unfreeze()
            pipeline.close()
            context.term()
    return {
        "hash_algorithm": hash_algorithm,
        "requests": len(prompts),
        "stored_blocks": stored,
        "removed_blocks": removed,
        "batches": batches,
        "dropped_stored_blocks": dropped,
        "cpu_s": round(cpu, 3),
        "us_per_block": _us_per_block(cpu, stored),
        "blocks_per_s": round(stored / wall) if wall else None,
    }


def measure_blockpool(
    requests: int, algorithms: list[HashAlgorithm], num_blocks: int = NUM_BLOCKS
) -> dict[str, Any]:
    prompts = make_prompts(requests)
    rows: list[dict[str, Any]] = []
    for algorithm in algorithms:
        vllm = measure_vllm(prompts, algorithm, num_blocks)
        ours = measure_kvpubd(prompts, algorithm, num_blocks)
        ratio = (
            round(vllm["us_per_block"] / ours["us_per_block"], 3)
            if vllm["us_per_block"] and ours["us_per_block"]
            else None
        )
        rows.append({"hash_algorithm": algorithm, "vllm": vllm, "kvpubd": ours, "ratio": ratio})
    return {
        "requests": requests,
        "num_blocks": num_blocks,
        "block_size": BLOCK_SIZE,
        "vllm_version": rows[0]["vllm"]["vllm_version"] if rows else None,
        "results": rows,
    }


def skip_reason() -> str | None:
    """Why vLLM's block pool cannot be loaded here (its files absent), or None."""
    from kvpubd.tools import vllm_blockpool, vllm_source

    missing = vllm_blockpool.missing_files()
    if not missing:
        return None
    return (
        f"vLLM's files not found ({', '.join(map(str, missing))}): set "
        f"{vllm_source.DIR_ENV_VAR} or run `kvpubd bench vllm-extract WHEEL`; comparison skipped"
    )


def bench_blockpool(
    requests: Annotated[int, typer.Option(help="Prompts, each stored then released.")] = 2000,
    hash_algorithm: Annotated[
        AlgorithmChoice,
        typer.Option(
            help="The prefix-caching hash: vLLM's hash function and kvpubd's "
            "cache.hash_algorithm (both: one after the other)."
        ),
    ] = "both",
    num_blocks: Annotated[int, typer.Option(help="Pool blocks (evictions when full).")] = (
        NUM_BLOCKS
    ),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """CPU us per newly stored block in vLLM's own BlockPool (its unmodified files, driven as
    its scheduler drives them, events encoded as its publisher does) beside kvpubd's rank
    pipeline in this process, on bench throughput's prompts; and their ratio."""
    check_positive("--requests", requests, integer=True)
    check_positive("--num-blocks", num_blocks, integer=True)
    reason = skip_reason()
    if reason is not None:
        err.print(f"kvpubd: {reason}")
        if as_json:
            typer.echo(json.dumps({"skipped": reason}))
        return
    algorithms: list[HashAlgorithm] = (
        ["sha256", "xxhash"] if hash_algorithm == "both" else [hash_algorithm]
    )
    with err.status(f"{requests} requests through vLLM's BlockPool and kvpubd's pipeline"):
        result = measure_blockpool(requests, algorithms, num_blocks)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(
        title=f"vLLM {result['vllm_version'] or '(version unknown)'} BlockPool vs kvpubd's "
        f"pipeline, in process: {requests} requests, {num_blocks:,} blocks of {BLOCK_SIZE}",
        caption="CPU us per newly stored block (blocks in BlockStored events); ratio: vLLM / "
        "kvpubd",
    )
    for column in (
        "hash",
        "vLLM us/block",
        "kvpubd us/block",
        "ratio",
        "vLLM blocks/s",
        "kvpubd blocks/s",
        "stored vLLM / kvpubd",
    ):
        table.add_column(column, justify="right")
    for row in result["results"]:
        vllm, ours = row["vllm"], row["kvpubd"]
        table.add_row(
            row["hash_algorithm"],
            f"{vllm['us_per_block']}",
            f"{ours['us_per_block']}",
            f"{row['ratio']}x",
            f"{vllm['blocks_per_s']:,}",
            f"{ours['blocks_per_s']:,}",
            f"{vllm['stored_blocks']:,} / {ours['stored_blocks']:,}",
        )
    Console().print(table)


def beside_vllm(
    requests: int, hash_algorithm: HashAlgorithm, num_blocks: int, daemon_us_per_block: float | None
) -> dict[str, Any]:
    """For ``bench throughput --against-vllm``: vLLM's BlockPool on the same prompts and hash,
    in the bench's process, and ``vllm_us_per_block / daemon_cpu_us_per_block``; or
    ``{"skipped": why}`` without vLLM's files (a note on stderr)."""
    reason = skip_reason()
    if reason is not None:
        err.print(f"kvpubd: {reason}")
        return {"skipped": reason}
    with err.status(f"{requests} requests through vLLM's BlockPool"):
        vllm = measure_vllm(make_prompts(requests), hash_algorithm, num_blocks)
    us = vllm["us_per_block"]
    return {
        "vllm_version": vllm["vllm_version"],
        "vllm_us_per_block": us,
        "vllm_blocks_per_s": vllm["blocks_per_s"],
        "vllm_stored_blocks": vllm["stored_blocks"],
        "ratio": round(us / daemon_us_per_block, 3) if us and daemon_us_per_block else None,
    }


def print_beside_vllm(row: dict[str, Any]) -> None:
    if "skipped" in row:
        return
    table = Table(
        title=f"beside vLLM {row['vllm_version'] or ''} BlockPool (same prompts and hash, "
        "in the bench's process)",
        caption="ratio: vLLM CPU us per stored block / the daemon's",
    )
    for column in ("vLLM us/block", "vLLM blocks/s", "vLLM stored blocks", "vLLM / daemon"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{row['vllm_us_per_block']}",
        f"{row['vllm_blocks_per_s']:,}",
        f"{row['vllm_stored_blocks']:,}",
        f"{row['ratio']}x",
    )
    Console().print(table)
