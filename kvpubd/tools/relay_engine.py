"""The engine of ``kvpubd bench relay``: vLLM's own ``ZmqEventPublisher`` (its kv_events.py,
unmodified) in a process of its own, publishing the batches vLLM's block pool would.

Each batch stores ``stores`` runs of ``blocks`` new blocks of ``block_size`` tokens (a
BlockStored each). The engine's pool holds ``pool_blocks``: once full, a batch first evicts as
many of the oldest blocks as it stores, each in a BlockRemoved of its own, as vLLM's block pool
reports evictions. Every block hash is new (a bijection of the block's global index below
``WARM_HASHES``), so kvpubd's relay republishes every event as it came; warm-up batches store
one block each at ``WARM_HASHES + k``, which the subscribers leave out.

It also serves vLLM's ``POST /reset_prefix_cache`` on ``reset_port``, as vLLM does: the engine's
``AllBlocksCleared`` goes out with its next batch (never while it is idle).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

# Hashes at or above this are the warm-up's; the measured ones lie below.
WARM_HASHES = 1 << 62
# An odd multiplier: n -> n * MULTIPLIER mod 2**62 is a bijection, so no hash repeats.
MULTIPLIER = 0x9E3779B97F4A7C15
# Distinct token lists the events share (tokens do not matter to the relay; hashes do).
TOKEN_LISTS = 64
GROUP = 0  # vLLM names the KV cache group of every store and removal
CLOCK = time.CLOCK_MONOTONIC  # system-wide: every process of the bench reads one clock


def now_ns() -> int:
    return time.clock_gettime_ns(CLOCK)


@dataclass(frozen=True)
class Shape:
    """What every measured batch holds."""

    stores: int  # BlockStored events per batch
    blocks: int  # blocks per BlockStored
    block_size: int  # tokens per block
    pool_blocks: int  # the engine's pool: beyond it, each new block evicts the oldest

    @property
    def per_batch(self) -> int:
        return self.stores * self.blocks

    @staticmethod
    def block_hash(index: int) -> int:
        """The hash of the engine's ``index``-th block stored (from 0)."""
        return ((index + 1) * MULTIPLIER) % WARM_HASHES

    def key(self, batch: int) -> int:
        """What identifies batch ``batch`` on both streams: its first stored block's hash."""
        return self.block_hash(batch * self.per_batch)

    def evicted_before(self, batch: int) -> int:
        """Blocks evicted by the batches before ``batch`` (the oldest first)."""
        return max(0, batch * self.per_batch - self.pool_blocks)

    def evictions(self, batch: int) -> range:
        """The indices of the blocks ``batch`` evicts."""
        return range(self.evicted_before(batch), self.evicted_before(batch + 1))

    def events(self, batches: range) -> int:
        return sum(self.stores + len(self.evictions(i)) for i in batches)

    def stored_blocks(self, batches: range) -> int:
        return len(batches) * self.per_batch

    def removed_blocks(self, batches: range) -> int:
        return self.evicted_before(batches.stop) - self.evicted_before(batches.start)


def build_batches(kv: Any, shape: Shape, batches: range, seed: int = 0) -> list[Any]:
    """vLLM's ``KVEventBatch`` for each of ``batches`` (their ``ts`` set when published)."""
    rng = np.random.default_rng(seed)
    tokens = [
        rng.integers(0, 150_000, size=shape.blocks * shape.block_size).tolist()
        for _ in range(TOKEN_LISTS)
    ]
    out = []
    for i in batches:
        events: list[Any] = [
            kv.BlockRemoved(block_hashes=[shape.block_hash(old)], medium="GPU", group_idx=GROUP)
            for old in shape.evictions(i)
        ]
        parent = None
        for s in range(shape.stores):
            first = i * shape.per_batch + s * shape.blocks
            hashes = [shape.block_hash(first + b) for b in range(shape.blocks)]
            events.append(
                kv.BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens[(i * shape.stores + s) % TOKEN_LISTS],
                    block_size=shape.block_size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=GROUP,
                )
            )
            parent = hashes[-1]
        out.append(kv.KVEventBatch(ts=0.0, events=events))
    return out


def _serve_resets(port: int) -> threading.Event:
    """vLLM's reset endpoint in a thread; the event is set by each reset until the next batch
    takes it."""
    asked = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            asked.set()
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="engine resets", daemon=True).start()
    return asked


def run_engine(
    kv_path: str, endpoint: str, replay_endpoint: str, reset_port: int, shape: Shape, pipe: Any
) -> None:
    """The engine process. Commands on ``pipe``: ``("warm",)`` publishes one warm-up batch;
    ``("build", first, count)`` builds batches ``first .. first + count - 1`` (seconds for
    tens of thousands: before anyone waits for them); ``("run", interval_s)`` publishes them
    (``interval_s`` apart, 0: as fast as it can) and answers the clock's reading just before
    the first; ``None`` shuts the publisher down."""
    from kvpubd.tools.vllm_source import load_kv_events

    kv = load_kv_events(Path(kv_path))
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay_endpoint
    )
    reset_asked = _serve_resets(reset_port)
    warm = 0
    batches: list[Any] = []
    pipe.send("ready")
    while (command := pipe.recv()) is not None:
        if command[0] == "warm":
            block = kv.BlockStored(
                block_hashes=[WARM_HASHES + warm],
                parent_block_hash=None,
                token_ids=list(range(shape.block_size)),
                block_size=shape.block_size,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=GROUP,  # as every measured store: one lane, as vLLM's
            )
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=[block]))
            warm += 1
            pipe.send("ok")
            continue
        if command[0] == "build":
            _, first, count = command
            batches = build_batches(kv, shape, range(first, first + count))
            pipe.send("built")
            continue
        _, interval_s = command
        started = now_ns()
        due = time.monotonic()
        for batch in batches:
            batch.ts = time.time()
            if reset_asked.is_set():  # the step after a reset starts with its clear
                reset_asked.clear()
                batch.events.insert(0, kv.AllBlocksCleared())
            publisher.publish(batch)
            if interval_s:
                # The pace of an engine that is not saturated: to a deadline per batch, so a
                # sleep that overran (the OS wakes late below ~0.1 ms) is made up.
                due += interval_s
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        pipe.send(started)
    publisher.shutdown()
