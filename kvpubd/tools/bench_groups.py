"""``kvpubd bench groups``: a hybrid model's two KV cache groups against one, same prompts.

- **throughput**: ``bench throughput``'s workload (store + release, shared prefixes, a
  subscriber decoding every batch) on a daemon with one full-attention group, then on one
  with a full-attention and a sliding-window group: blocks/s published, and the daemon's
  CPU per prompt (a store of two groups stores and publishes each block twice);
- **reset**: reset -> AllBlocksCleared received by a subscriber, on an idle daemon holding
  that many blocks in each group, with and without the second group.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpubd.exits import check_positive
from kvpubd.tools.bench_reset import measure_resets
from kvpubd.tools.bench_throughput import measure_throughput


def hybrid_cache(window_tokens: int) -> dict[str, Any]:
    """The cache settings of a model with a full-attention and a sliding-window group."""
    return {
        "groups": [
            {"kind": "full_attention", "layers": [0]},
            {"kind": "sliding_window", "sliding_window": window_tokens, "layers": [1]},
        ]
    }


def measure_groups(
    requests: int, window: int, num_blocks: int, window_tokens: int, fill_blocks: int, resets: int
) -> dict[str, Any]:
    results: dict[str, Any] = {"window_tokens": window_tokens, "pool_blocks": num_blocks}
    for name, cache in (("one_group", None), ("two_groups", hybrid_cache(window_tokens))):
        run = measure_throughput(requests, window, num_blocks, cache=cache)
        cpu_s = (run["daemon_cpu_us_per_block"] or 0) * run["blocks"] / 1e6
        results[name] = {
            "blocks_per_s": run["blocks_per_s"],
            "blocks": run["blocks"],
            "requests_per_s": run["requests_per_s"],
            "daemon_cpu_us_per_block": run["daemon_cpu_us_per_block"],
            "daemon_cpu_us_per_request": round(cpu_s / requests * 1e6, 1),
            "gaps": run["gaps"],
            "decoded_by": run["decoded_by"],
        }
        with Progress(transient=True) as progress:
            results[name]["reset"] = measure_resets(
                [0, fill_blocks], resets, True, progress, cache=cache
            )
    one, two = results["one_group"], results["two_groups"]
    results["cpu_per_request_ratio"] = round(
        two["daemon_cpu_us_per_request"] / max(1e-9, one["daemon_cpu_us_per_request"]), 2
    )
    return results


def bench_groups(
    requests: Annotated[int, typer.Option(help="Store requests (each then released).")] = 2000,
    window: Annotated[int, typer.Option(help="Requests in flight.")] = 32,
    num_blocks: Annotated[
        int, typer.Option(help="Blocks of each group's pool (evictions when full).")
    ] = 400_000,
    window_tokens: Annotated[
        int, typer.Option(help="The sliding-window group's window, in tokens.")
    ] = 4096,
    fill_blocks: Annotated[
        int, typer.Option(help="Blocks cached when a reset is timed (besides an empty cache).")
    ] = 100_000,
    resets: Annotated[int, typer.Option(help="Resets timed per cache size.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Two KV cache groups (full attention + sliding window) against one: throughput, CPU per
    request and reset -> marker, each on a daemon started here."""
    for option, value in (
        ("--requests", requests),
        ("--window", window),
        ("--num-blocks", num_blocks),
        ("--window-tokens", window_tokens),
        ("--resets", resets),
    ):
        check_positive(option, value, integer=True)
    results = measure_groups(requests, window, num_blocks, window_tokens, fill_blocks, resets)
    if as_json:
        typer.echo(json.dumps(results))
        return
    table = Table(title=f"one group vs full attention + sliding window ({window_tokens} tokens)")
    for column in ("", "blocks/s", "CPU us/block", "CPU us/request", "reset p50/p99 us"):
        table.add_column(column)
    for name in ("one_group", "two_groups"):
        row = results[name]
        full = row["reset"][str(fill_blocks)]
        table.add_row(
            name.replace("_", " "),
            f"{row['blocks_per_s']:,}",
            f"{row['daemon_cpu_us_per_block']}",
            f"{row['daemon_cpu_us_per_request']}",
            f"{full['p50_us']} / {full['p99_us']} ({fill_blocks:,} blocks)",
        )
    Console().print(table)
