"""``kvpubd bench kernels``: the command; bench_kernels measures (imported only when it runs,
on a machine with CuPy and a GPU)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from kvpubd.tools.bench_report import err


def bench_kernels(
    pool_gib: Annotated[float, typer.Option(help="GPU pool size per block size, GiB.")] = 8.0,
    block_bytes: Annotated[
        list[int] | None, typer.Option(help="Block size in bytes (repeatable).")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Timed runs per operation (median).")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed runs first.")] = 2,
    bandwidth_gib: Annotated[
        float, typer.Option(help="Size of the device-to-device copy that sets the bandwidth.")
    ] = 4.0,
    variant: Annotated[
        list[str] | None,
        typer.Option(help="Also time a build TILE:UNROLL[:STREAMING] (repeatable)."),
    ] = None,
    check: Annotated[bool, typer.Option(help="Only compare every kernel with its NumPy twin.")] = (
        False
    ),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """GB/s of the GPU scrub and checksum kernels beside CuPy's own operations and the
    device's measured bandwidth (needs CuPy and a GPU)."""
    from kvpubd.daemon.kernels import gpu_available
    from kvpubd.tools import bench_kernels as kb

    if not gpu_available():
        err.print("kvpubd: bench kernels needs CuPy and a CUDA GPU")
        raise typer.Exit(1)
    if check:
        failures = kb.self_check()
        for failure in failures:
            err.print(f"FAIL {failure}")
        typer.echo(f"self-check: {'OK' if not failures else f'{len(failures)} failures'}")
        raise typer.Exit(1 if failures else 0)
    builds = []
    for spec in variant or []:
        parts = [int(x) for x in spec.split(":")] + [0]
        builds.append((parts[0], parts[1], bool(parts[2])))
    result = kb.run_kernel_bench(
        pool_gib,
        block_bytes or list(kb.DEFAULT_BLOCK_BYTES),
        repeats=repeats,
        warmup=warmup,
        bandwidth_gib=bandwidth_gib,
        variants=builds,
        log=None if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]")),
    )
    if as_json:
        typer.echo(json.dumps(result))
    else:
        Console(width=200).print(kb.format_table(result))
    if not all(result["checks"].values()):
        raise typer.Exit(1)
