"""``kvpubd bench store-rtt``: one client, one store and its release at a time, of new prompts
into a daemon whose pool is full and churning: the round trip of each pair. Whatever holds
the daemon's loop (a table rebuilt at once, a collection) shows as a round trip far above
the median, and a reset sent then would wait as long."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from kvpubd.exits import check_positive
from kvpubd.protocol.hashing import HashAlgorithm
from kvpubd.tools.bench_probe import TINY_BLOCKS
from kvpubd.tools.bench_report import err, percentile, summary
from kvpubd.tools.launcher import DaemonProcess

BLOCK_SIZE = 16
SLOW = 10  # a round trip this many times the median counts as slow


def measure_store_rtt(
    num_blocks: int, prompt_blocks: int, rounds: int, hash_algorithm: HashAlgorithm
) -> dict[str, Any]:
    """``rounds`` store+release pairs of distinct ``prompt_blocks``-block prompts (nothing
    shared: every block new, evicting once the pool is full), one pair at a time."""
    settings: dict[str, dict[str, Any]] = {
        "cache": {
            **TINY_BLOCKS,
            "num_blocks": num_blocks,
            "block_size": BLOCK_SIZE,
            "hash_algorithm": hash_algorithm,
        },
        "service": {"log_level": "warning"},
    }
    rng = np.random.default_rng(0)
    round_trips: list[int] = []  # ns
    with DaemonProcess(settings) as daemon:
        daemon.start()
        with daemon.client(timeout=60) as client:
            start = time.perf_counter()
            for number in range(rounds):
                tokens = rng.integers(0, 1 << 20, prompt_blocks * BLOCK_SIZE, dtype=np.int64)
                sent = time.perf_counter_ns()
                client.store(f"r{number}", tokens)
                client.release(f"r{number}")
                round_trips.append(time.perf_counter_ns() - sent)
            seconds = time.perf_counter() - start
    median = float(np.median(round_trips))
    slow = [number for number, rtt in enumerate(round_trips) if rtt > SLOW * median]
    return {
        "num_blocks": num_blocks,
        "prompt_blocks": prompt_blocks,
        "rounds": rounds,
        "hash_algorithm": hash_algorithm,
        "blocks_per_s": round(rounds * prompt_blocks / seconds),
        # The pool is full from this round on: later rounds evict as many blocks as they store.
        "full_from_round": -(-num_blocks // prompt_blocks),
        "round_trip": {
            **summary(round_trips),
            "p999_us": round(percentile(round_trips, 99.9) / 1000, 1),
        },
        "slow_rounds": slow,
    }


def bench_store_rtt(
    num_blocks: Annotated[int, typer.Option(help="Pool blocks.")] = 1_000_000,
    prompt_blocks: Annotated[int, typer.Option(help="New blocks per prompt.")] = 256,
    rounds: Annotated[int, typer.Option(help="Store+release pairs, one at a time.")] = 12_000,
    hash_algorithm: Annotated[
        HashAlgorithm, typer.Option(help="The daemon's cache.hash_algorithm.")
    ] = "xxhash",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Round trips of store+release pairs, one at a time, into a full, churning pool: the
    longest is how long the daemon's loop was held."""
    for option, value in (
        ("--num-blocks", num_blocks),
        ("--prompt-blocks", prompt_blocks),
        ("--rounds", rounds),
    ):
        check_positive(option, value, integer=True)
    with err.status(f"{rounds:,} store+release pairs into a pool of {num_blocks:,} blocks"):
        result = measure_store_rtt(num_blocks, prompt_blocks, rounds, hash_algorithm)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(title=f"store+release round trips, pool of {num_blocks:,} blocks")
    for column in ("blocks/s", "p50 ms", "p99 ms", "p99.9 ms", "max ms", f">{SLOW}x p50"):
        table.add_column(column, justify="right")
    rtt = result["round_trip"]
    table.add_row(
        f"{result['blocks_per_s']:,}",
        *(f"{rtt[key] / 1000:.2f}" for key in ("p50_us", "p99_us", "p999_us", "max_us")),
        str(len(result["slow_rounds"])),
    )
    Console().print(table)
