"""``kvpubd bench reset``: reset sent -> AllBlocksCleared received by a subscriber, on an idle
daemon at each cache size, beside the same daemon without the immediate flush and the floor (a
bare pyzmq loop); with ``--under LOAD`` the same while a load runs (bench_under)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpubd.exits import USAGE, check_positive, fail, warn
from kvpubd.tools.bench_floor import measure_floor
from kvpubd.tools.bench_probe import TINY_BLOCKS, ResetProbe
from kvpubd.tools.bench_report import err, summary
from kvpubd.tools.bench_under import measure_under, under_table
from kvpubd.tools.launcher import DaemonProcess


def measure_resets(
    sizes: list[int],
    resets: int,
    flush: bool,
    progress: Progress,
    device: str = "cpu",
    idle_ms: float = 20.0,
    cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Reset -> marker on an idle daemon holding each of ``sizes`` blocks (``cache``: more
    cache settings)."""
    results: dict[str, Any] = {}
    biggest = max([*sizes, 1024])
    overrides: dict[str, dict[str, Any]] = {
        "cache": {**TINY_BLOCKS, "num_blocks": biggest + 1024, "device": device, **(cache or {})},
        "events": {"flush_on_reset": flush, "buffer_steps": 1000},
        "service": {"log_level": "warning"},
    }
    label = "immediate flush" if flush else "baseline (next tick)"
    with DaemonProcess(overrides, transport="tcp") as daemon:
        probe = ResetProbe(daemon)
        try:
            probe.wait_connected()
            for size in sizes:
                # Refilling a large cache before every reset is slow: fewer rounds there.
                rounds = resets if size == 0 else max(10, min(resets, 2_000_000 // size))
                task = progress.add_task(f"{label}: {size:>9,} blocks", total=rounds)
                markers, replies = [], []
                for round_no in range(rounds):
                    if size:
                        probe.populate(size, round_no)
                    # The daemon is idle when the reset comes: nothing for idle_ms.
                    probe.drain_sub(idle_ms / 1000)
                    marker, reply = probe.time_reset()
                    markers.append(marker)
                    replies.append(reply)
                    progress.advance(task)
                results[str(size)] = {**summary(markers), "reply": summary(replies)}
        finally:
            probe.close()
    return results


# Fewer resets per size than this give percentiles that mean little.
MIN_RESETS = 100


def cache_sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated block counts >= 0 (at least one)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() for part in parts):
        raise fail(f"--sizes: {text!r} is not a comma-separated list of block counts >= 0", USAGE)
    return [int(part) for part in parts]


def _check_device(device: str) -> None:
    """``--device``: cpu, or cuda:N with CuPy and that GPU here (one line otherwise)."""
    from pydantic import ValidationError

    from kvpubd.daemon.pool import check_device
    from kvpubd.daemon.settings import CacheConfig

    try:
        CacheConfig(device=device)
    except ValidationError as exc:
        message = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise fail(f"--device: {message}", USAGE) from None
    try:
        check_device(device)
    except ValueError as exc:
        raise fail(f"--device: {exc}", USAGE) from None


def bench_reset(
    sizes: Annotated[
        str | None,
        typer.Option(
            help="Cached blocks before each reset, comma-separated.",
            show_default="0,10000,100000,1000000; with --under 0,100000",
        ),
    ] = None,
    resets: Annotated[
        int, typer.Option(help="Resets measured per size (fewer at large sizes).")
    ] = 200,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
    device: Annotated[str, typer.Option(help="Pool device of the daemon: cpu or cuda:N.")] = "cpu",
    idle_ms: Annotated[
        float,
        typer.Option(
            help="Quiet time before each reset (the daemon is idle); under a load, the most "
            "a reset waits after an operation of the load started."
        ),
    ] = 20.0,
    under: Annotated[
        str | None,
        typer.Option(
            help="Also time resets while this load runs in other processes: snapshot (the "
            "control op), snapshot-endpoint (REQ clients of the snapshot protocol), "
            "replay-flood, big-store or idle-conns."
        ),
    ] = None,
    reset_timeout: Annotated[
        float, typer.Option(help="With --under: a reset slower than this counts as a timeout.")
    ] = 30.0,
    snapshot_blocks: Annotated[
        int,
        typer.Option(
            help="With --under snapshot or snapshot-endpoint: published blocks the snapshot "
            "returns."
        ),
    ] = 200_000,
    snapshot_clients: Annotated[
        int,
        typer.Option(
            help="With --under snapshot-endpoint: REQ clients, each in its own process, "
            "asking for snapshots in a loop."
        ),
    ] = 8,
    flood_processes: Annotated[
        int, typer.Option(help="With --under replay-flood: flooding processes.")
    ] = 4,
    idle_connections: Annotated[
        int, typer.Option(help="With --under idle-conns: TCP connections held open.")
    ] = 2000,
) -> None:
    """Reset sent -> AllBlocksCleared received by a subscriber, idle daemon, at each cache size;
    beside it the same daemon with the immediate flush off (the marker waits for a tick).
    With --under LOAD: the same, idle, beside the same daemon while LOAD runs."""
    if under is not None:
        from kvpubd.tools.bench_load import LOADS

        if under not in LOADS:
            raise fail(f"--under: {under!r} is not a load; choose from {', '.join(LOADS)}", USAGE)
    size_list = cache_sizes(sizes or ("0,100000" if under else "0,10000,100000,1000000"))
    check_positive("--resets", resets, integer=True)
    check_positive("--reset-timeout", reset_timeout)
    check_positive("--snapshot-clients", snapshot_clients, integer=True)
    if not 0 <= idle_ms < float("inf"):
        raise fail(f"--idle-ms: {idle_ms} is not a number of milliseconds >= 0", USAGE)
    _check_device(device)
    if resets < MIN_RESETS:
        warn(
            f"{resets} resets per size is too small a sample for a p99 (or a stable p50); "
            f"use --resets {MIN_RESETS} or more"
        )
    if under is not None:
        with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
            result = measure_under(
                under,
                size_list,
                resets,
                progress,
                device,
                idle_ms,
                reset_timeout,
                snapshot_blocks,
                flood_processes,
                idle_connections,
                snapshot_clients,
            )
        if as_json:
            typer.echo(json.dumps(result))
        else:
            Console().print(under_table(result))
        return
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        immediate = measure_resets(size_list, resets, True, progress, device, idle_ms)
        baseline = measure_resets(size_list, resets, False, progress, device, idle_ms)
        floor = measure_floor(resets, idle_ms, progress)
    if as_json:
        typer.echo(json.dumps({"sizes": immediate, "baseline": baseline, "floor": floor}))
        return
    table = Table(
        title="reset -> marker received (loopback tcp, idle daemon)",
        caption="floor: a bare pyzmq loop that only publishes a marker and replies",
    )
    for column in (
        "cached blocks",
        "n",
        "p50 us",
        "p99 us",
        "max us",
        "reply p50 us",
        "baseline p50 us",
        "baseline p99 us",
    ):
        table.add_column(column, justify="right")
    for size in size_list:
        row, base = immediate[str(size)], baseline[str(size)]
        table.add_row(
            f"{size:,}",
            str(row["n"]),
            f"{row['p50_us']:.0f}",
            f"{row['p99_us']:.0f}",
            f"{row['max_us']:.0f}",
            f"{row['reply']['p50_us']:.0f}",
            f"{base['p50_us']:.0f}",
            f"{base['p99_us']:.0f}",
        )
    table.add_row(
        "floor",
        str(floor["n"]),
        f"{floor['p50_us']:.0f}",
        f"{floor['p99_us']:.0f}",
        f"{floor['max_us']:.0f}",
        f"{floor['reply']['p50_us']:.0f}",
        "",
        "",
    )
    Console().print(table)
