"""``kvpubd bench host-tier``: a daemon whose host tier is full, measured from a client.

- **fill**: stores of new blocks into a full pool, each evicted block copied to the host
  tier (and, once it is full, the tier's oldest dropped), in blocks per second;
- **promote**: stores of prompts the host tier holds, copied back, against new prompts;
- **reset**: reset -> AllBlocksCleared received by a subscriber, ``tier="gpu"`` (the host
  tier stays full), each sent while a store that evicts (demotes) 512 blocks is under way.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from kvpubd.exits import check_positive
from kvpubd.tools.bench_probe import PROMPT_TOKENS, TINY_BLOCKS, ResetProbe
from kvpubd.tools.bench_report import summary
from kvpubd.tools.bench_reset import _check_device
from kvpubd.tools.launcher import DaemonProcess

PROMPT_BLOCKS = PROMPT_TOKENS // 16


# Prompts in flight at once: their replies (two each) stay well inside what ZeroMQ queues for
# one peer (1000 messages each way), which a router drops past.
WINDOW = 256


def _store_prompts(probe: ResetProbe, seeds: range, tag: str) -> tuple[float, int, int]:
    """Store and release one 8k-token prompt per seed, each release right behind its store,
    pipelined WINDOW prompts at a time; (seconds, blocks stored, tokens the daemon already
    held: the promoted ones)."""
    started = time.perf_counter()
    cached = 0
    for first in range(0, len(seeds), WINDOW):
        stores = []
        for seed in seeds[first : first + WINDOW]:
            rng = np.random.default_rng(seed)
            tokens = rng.integers(0, 1 << 31, PROMPT_TOKENS, dtype=np.uint32)
            packed = tokens.astype("<u4").tobytes()
            stores.append(probe.send("store", request_id=f"{tag}-{seed}", token_ids=packed))
            probe.send("release", request_id=f"{tag}-{seed}")
        for store_id in stores:
            cached += int(probe.recv_reply(store_id)["num_cached_tokens"])
        probe.recv_reply()  # the window's last release: every other one came before it
    return time.perf_counter() - started, len(seeds) * PROMPT_BLOCKS, cached


def _rate(seconds: float, blocks: int) -> float:
    return blocks / seconds if seconds > 0 else 0.0


def measure_baseline(pool_blocks: int, prompts: int, device: str) -> float:
    """Blocks per second of new prompts into a full pool that evicts without a host tier:
    the same stores as the host tier's ``fresh`` phase, to tell what demotions cost."""
    overrides: dict[str, dict[str, Any]] = {
        "cache": {**TINY_BLOCKS, "num_blocks": pool_blocks, "device": device},
        "service": {"log_level": "warning", "rank_processes": "off"},
    }
    with DaemonProcess(overrides, transport="tcp") as daemon:
        probe = ResetProbe(daemon)
        try:
            probe.wait_connected()
            _store_prompts(probe, range(-(-pool_blocks // PROMPT_BLOCKS)), "fill")
            seconds, blocks, _ = _store_prompts(probe, range(10**6, 10**6 + prompts), "fresh")
        finally:
            probe.close()
    return _rate(seconds, blocks)


def measure_host_tier(
    pool_blocks: int, host_blocks: int, resets: int, device: str, idle_ms: float
) -> dict[str, Any]:
    overrides: dict[str, dict[str, Any]] = {
        "cache": {
            **TINY_BLOCKS,
            "num_blocks": pool_blocks,
            "host_blocks": host_blocks,
            "device": device,
        },
        "events": {"buffer_steps": 1000},
        "service": {"log_level": "warning", "rank_processes": "off"},
    }
    out: dict[str, Any] = {"pool_blocks": pool_blocks, "host_blocks": host_blocks}
    with DaemonProcess(overrides, transport="tcp") as daemon:
        probe = ResetProbe(daemon)
        try:
            probe.wait_connected()
            # Fill the pool, then the host tier: prompts 0.. in order, the oldest on the host.
            fill_prompts = -(-(pool_blocks + host_blocks) // PROMPT_BLOCKS)
            seconds, blocks, _ = _store_prompts(probe, range(fill_prompts), "fill")
            out["fill_blocks_per_s"] = _rate(seconds, blocks)
            stats = probe.client.stats().ranks[0]
            out["host_blocks_cached"] = stats.host_blocks_cached
            # Prompts the host tier holds now, the most recently copied there first: each
            # promotion copies 512 blocks out of the pool in turn, which push the host tier's
            # oldest out, not the prompts still to promote.
            on_host = max(1, min(64, host_blocks // PROMPT_BLOCKS // 2))
            newest = fill_prompts - pool_blocks // PROMPT_BLOCKS - 2
            held = range(newest, newest - on_host, -1)
            seconds, blocks, cached = _store_prompts(probe, held, "promote")
            out["promote_blocks_per_s"] = _rate(seconds, blocks)
            out["promoted_fraction"] = cached / (blocks * 16)
            fresh = range(10**6, 10**6 + on_host)
            seconds, blocks, _ = _store_prompts(probe, fresh, "fresh")
            out["fresh_blocks_per_s"] = _rate(seconds, blocks)
            markers, replies = [], []
            rng = np.random.default_rng(1)
            refill = -(-pool_blocks // PROMPT_BLOCKS)
            for round_no in range(resets):
                # The pool full again (with new prompts), and the last reset's announcements
                # of the host tier read.
                base = 2 * 10**6 + round_no * refill
                _store_prompts(probe, range(base, base + refill), f"refill{round_no}")
                probe.drain_sub(idle_ms / 1000)
                # A store that evicts 512 blocks, copied to the host tier: the reset goes out
                # while it is under way or right behind it (the reset drops its request).
                tokens = rng.integers(0, 1 << 31, PROMPT_TOKENS, dtype=np.uint32)
                probe.send(
                    "store",
                    request_id=f"evict-{round_no}",
                    token_ids=tokens.astype("<u4").tobytes(),
                )
                time.sleep(float(rng.uniform(0, 0.001)))
                marker, reply = probe.time_reset(rank=0, tier="gpu")
                markers.append(marker)
                replies.append(reply)
            out["reset"] = {**summary(markers), "reply": summary(replies)}
            out["host_blocks_after"] = probe.client.stats().ranks[0].host_blocks_cached
        finally:
            probe.close()
    out["no_tier_blocks_per_s"] = measure_baseline(pool_blocks, on_host, device)
    return out


def bench_host_tier(
    pool_blocks: Annotated[int, typer.Option(help="Blocks in the pool.")] = 1_000_000,
    host_blocks: Annotated[int, typer.Option(help="Blocks in the host tier.")] = 4_000_000,
    resets: Annotated[int, typer.Option(help="Resets measured.")] = 20,
    device: Annotated[str, typer.Option(help="Pool device of the daemon: cpu or cuda:N.")] = "cpu",
    idle_ms: Annotated[
        float, typer.Option(help="Quiet time read from the stream before each reset.")
    ] = 20.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """A full host tier: store throughput with demotions and with promotions, and reset ->
    marker (the pool alone) while a store demotes."""
    check_positive("--pool-blocks", pool_blocks)
    check_positive("--host-blocks", host_blocks)
    check_positive("--resets", resets)
    _check_device(device)
    result = measure_host_tier(pool_blocks, host_blocks, resets, device, idle_ms)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(title=f"host tier: {pool_blocks:,} pool + {host_blocks:,} host blocks ({device})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("store, new blocks, demoting (blocks/s)", f"{result['fill_blocks_per_s']:,.0f}")
    table.add_row("store, promoted from host (blocks/s)", f"{result['promote_blocks_per_s']:,.0f}")
    table.add_row("  promoted fraction", f"{result['promoted_fraction']:.2f}")
    table.add_row("store, new blocks, full host (blocks/s)", f"{result['fresh_blocks_per_s']:,.0f}")
    table.add_row("  the same without a host tier", f"{result['no_tier_blocks_per_s']:,.0f}")
    reset = result["reset"]
    table.add_row(
        "reset gpu -> marker p50 / p99 (ms)",
        f"{reset['p50_us'] / 1000:.2f} / {reset['p99_us'] / 1000:.2f}",
    )
    table.add_row("host blocks after the resets", f"{result['host_blocks_after']:,}")
    Console().print(table)
