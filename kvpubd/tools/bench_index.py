"""``kvpubd bench index``: the radix index alone, ops/s of a store/match/evict mix and RSS
bytes per cached block."""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from kvpubd.exits import check_positive
from kvpubd.tools.bench_report import err


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_index(blocks: int, chain: int, rounds: int) -> dict[str, Any]:
    """Radix index alone: build ``blocks`` cached blocks in chains of ``chain``, then a mix of
    stores (match + insert), lookups (match) and evictions at that size."""
    from hashlib import sha256

    from kvpubd.daemon.radix import ROOT, RadixIndex

    gc.collect()
    before = _rss_bytes()
    index = RadixIndex(blocks)
    for start in range(0, blocks, chain):
        digest = sha256(start.to_bytes(8, "little")).digest()
        run = []
        for _ in range(start, min(start + chain, blocks)):
            digest = sha256(digest).digest()
            run.append(digest)
        ids = list(range(start, start + len(run)))
        index.insert_run(run, ids, ROOT, None)
        index.unpin(ids)
    gc.collect()
    bytes_per_block = (_rss_bytes() - before) / blocks

    rng = np.random.default_rng(0)
    chains = [list(range(s, min(s + chain, blocks))) for s in range(0, blocks, chain)]
    ops = {"match": 0, "insert": 0, "evict": 0}
    seconds = {"match": 0.0, "insert": 0.0, "evict": 0.0}
    next_digest = 0
    for _ in range(rounds):
        # Look up a few cached chains (what a store's prefix match does).
        picks = [chains[i] for i in rng.integers(0, len(chains), size=8)]
        lookups = [[index.digest[b] for b in c] for c in picks]
        t0 = time.perf_counter()
        for digests in lookups:
            ops["match"] += len(index.match(digests))
        seconds["match"] += time.perf_counter() - t0
        # Make room for one new chain, then store it under a cached prefix.
        t0 = time.perf_counter()
        freed = index.evict(chain)
        seconds["evict"] += time.perf_counter() - t0
        ops["evict"] += len(freed)
        fresh = [
            sha256(b"n" + (next_digest + i).to_bytes(8, "little")).digest() for i in range(chain)
        ]
        next_digest += chain
        t0 = time.perf_counter()
        index.insert_run(fresh, freed, ROOT, None)
        index.unpin(freed)
        seconds["insert"] += time.perf_counter() - t0
        ops["insert"] += len(freed)
    total_ops = sum(ops.values())
    total_s = sum(seconds.values())
    return {
        "blocks": blocks,
        "ops_per_s": round(total_ops / total_s),
        "bytes_per_block": round(bytes_per_block, 1),
        "by_op": {op: round(ops[op] / seconds[op]) for op in ops},
    }


def bench_index(
    blocks: Annotated[int, typer.Option(help="Cached blocks.")] = 1_000_000,
    chain: Annotated[int, typer.Option(help="Blocks per prompt chain.")] = 64,
    rounds: Annotated[int, typer.Option(help="Mixed rounds timed after the build.")] = 2000,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Radix index ops/s (store/match/evict mix) and RSS bytes per cached block."""
    for option, value in (("--blocks", blocks), ("--chain", chain), ("--rounds", rounds)):
        check_positive(option, value, integer=True)
    with err.status(f"building and exercising an index of {blocks:,} blocks"):
        result = measure_index(blocks, chain, rounds)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(title=f"radix index at {blocks:,} cached blocks (chains of {chain})")
    for column in ("ops/s (mix)", "match/s", "insert/s", "evict/s", "RSS bytes/block"):
        table.add_column(column, justify="right")
    by_op = result["by_op"]
    table.add_row(
        f"{result['ops_per_s']:,}",
        f"{by_op['match']:,}",
        f"{by_op['insert']:,}",
        f"{by_op['evict']:,}",
        f"{result['bytes_per_block']:.0f}",
    )
    Console().print(table)
