"""``kvpubd bench tiers``: GB/s of the tier copier (primary pool <-> host tier) against the bus.

For each block size a primary pool and a host tier of ``total_mib`` MiB each are made; every
block is demoted to a slot and promoted back, ids and slots both in random order (no two
neighbours consecutive, so no run coalescing helps). Each copy is timed by the wall clock from
the call to the end of a stream synchronisation (CPU time to enqueue included), several times,
median reported, beside the ANCHOR measured in the same run: one contiguous copy of the same
bytes in the same direction (``cudaMemcpyAsync`` between the pool and the registered host tier,
and between the pool and ``cupy.cuda.alloc_pinned_memory`` for reference). The target is a
copier at >= 80 % of the anchor in both directions for every block size.

Without CuPy and a GPU (or with ``cpu``) the NumPy copier between two shared memory pools is
measured instead, against a contiguous ``np.copyto`` of the same bytes.

Every method's round trip is checked: after demote, scribble, promote the pool equals what it
held before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvpubd.daemon import tier_copy
from kvpubd.daemon.kernels import gpu_available
from kvpubd.daemon.pool import SHM_DIR, CudaPool, HostPool
from kvpubd.tools.bench_kernels import _fill_pattern as fill_pattern
from kvpubd.tools.bench_report import err

MIB = 1 << 20
TARGET_PCT = 80.0
DEFAULT_BLOCK_BYTES = (64 << 10, 2 << 20)
GPU_METHODS = ("auto", "kernel", "memcpy", "batch")
_H2D, _D2H = 1, 2
Log = Callable[[str], None] | None


def run_tier_bench(
    total_mib: int,
    block_sizes: list[int],
    *,
    repeats: int = 7,
    warmup: int = 2,
    methods: list[str] | None = None,
    variants: list[tuple[int, int]] | None = None,
    cpu: bool = False,
    log: Log = None,
    seed: int = 1,
) -> dict[str, Any]:
    """Measure; the result is JSON-ready (``rows``: one per method, block size, direction)."""
    on_gpu = gpu_available() and not cpu
    total = _fit_total(total_mib * MIB, copies=1 if on_gpu else 2)
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    anchors: list[dict[str, Any]] = []
    for bb in block_sizes:
        n = max(1, total // bb)
        ids, slots = rng.permutation(n), rng.permutation(n)
        if log:
            log(f"{_size(bb)} blocks x {n} ({n * bb / MIB:.0f} MiB per direction)")
        if on_gpu:
            _gpu_block_size(rows, anchors, bb, n, ids, slots, methods, variants, repeats, warmup)
        else:
            _numpy_block_size(rows, anchors, bb, n, ids, slots, repeats, warmup)
    result: dict[str, Any] = {
        "mode": "gpu" if on_gpu else "numpy",
        "device": _device_name() if on_gpu else "host (no GPU measured)",
        "total_bytes": total,
        "requested_bytes": total_mib * MIB,
        "repeats": repeats,
        "target_pct": TARGET_PCT,
        "kernel_below_bytes": tier_copy.KERNEL_BELOW_BYTES,
        "anchors": anchors,
        "rows": rows,
        "checks": {f"{r['method']} {_size(r['block_bytes'])}": r["check"] for r in rows},
    }
    if not on_gpu:
        result["note"] = "NumPy copier only: " + ("--cpu given" if cpu else "no CuPy/GPU here")
    return result


def _fit_total(requested: int, copies: int) -> int:
    """``requested`` bytes, or less where /dev/shm cannot hold ``copies`` pools of it."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return requested
    free = stats.f_bavail * stats.f_frsize
    room = int(free * 0.8) // copies // (2 * MIB) * (2 * MIB)
    return max(2 * MIB, min(requested, room))


def _median_times(
    fn: Callable[[], object], finish: Callable[[], object], warmup: int, repeats: int
) -> tuple[float, float]:
    """Median wall seconds of ``fn(); finish()`` and median seconds ``fn`` alone took."""
    for _ in range(warmup):
        fn()
        finish()
    walls, enqueues = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        finish()
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        enqueues.append(t1 - t0)
    return float(np.median(walls)), float(np.median(enqueues))


def _row(
    rows: list[dict[str, Any]],
    *,
    bb: int,
    n: int,
    method: str,
    direction: str,
    wall: float,
    enqueue: float,
    anchor_gbs: float,
    check: bool,
) -> None:
    gbs = n * bb / wall / 1e9
    rows.append(
        {
            "block_bytes": bb,
            "blocks": n,
            "method": method,
            "direction": direction,
            "ms_median": round(wall * 1e3, 3),
            "enqueue_ms": round(enqueue * 1e3, 3),
            "gbs": round(gbs, 2),
            "anchor_gbs": round(anchor_gbs, 2),
            "pct_of_anchor": round(100 * gbs / anchor_gbs, 1),
            "check": check,
        }
    )


# -- GPU ---------------------------------------------------------------------------------------


def _gpu_block_size(
    rows: list[dict[str, Any]],
    anchors: list[dict[str, Any]],
    bb: int,
    n: int,
    ids: np.ndarray,
    slots: np.ndarray,
    methods: list[str] | None,
    variants: list[tuple[int, int]] | None,
    repeats: int,
    warmup: int,
) -> None:
    import cupy

    with _pools(n, bb, gpu=True) as (primary, host):
        assert isinstance(primary, CudaPool)
        stream = primary.stream
        # The anchors copy over the pool: fill it after them.
        anchor = _gpu_anchors(primary, host, repeats, warmup)
        fill_pattern(primary.data, stream, bb)
        stream.synchronize()
        original = cupy.asnumpy(primary.data)
        anchor["block_bytes"] = bb
        anchors.append(anchor)
        todo: list[tuple[str, dict[str, int]]] = [(m, {}) for m in (methods or GPU_METHODS)]
        todo += [(f"kernel u{u} c{c}", {"unroll": u, "ctas_per_sm": c}) for u, c in variants or []]
        for label, knobs in todo:
            method = label.split()[0]
            try:
                copier = tier_copy.CudaCopier(primary, host, method, **knobs)  # type: ignore[arg-type]
            except Exception as exc:  # a method this machine lacks: say so, measure the rest
                rows.append({"block_bytes": bb, "method": label, "error": str(exc), "check": True})
                continue
            try:
                if method == "auto":
                    label = f"auto ({copier.method})"
                check = _round_trip_ok(copier, primary, host, ids, slots, original)
                done = stream.synchronize
                for direction, fn in _directions(copier, ids, slots):
                    wall, enq = _median_times(fn, done, warmup, repeats)
                    ref = anchor[
                        "registered_d2h_gbs" if direction == "demote" else "registered_h2d_gbs"
                    ]
                    _row(rows, bb=bb, n=n, method=label, direction=direction, wall=wall,
                         enqueue=enq, anchor_gbs=ref, check=check)  # fmt: skip
            except Exception as exc:  # one method failing must not hide the others
                rows.append(
                    {"block_bytes": bb, "method": label, "error": repr(exc), "check": False}
                )
            finally:
                copier.close()


def _directions(
    copier: tier_copy.TierCopier, ids: np.ndarray, slots: np.ndarray
) -> list[tuple[str, Callable[[], None]]]:
    return [
        ("demote", lambda: copier.demote(ids, slots)),
        ("promote", lambda: copier.promote(slots, ids)),
    ]


def _round_trip_ok(
    copier: tier_copy.CudaCopier,
    primary: CudaPool,
    host: HostPool,
    ids: np.ndarray,
    slots: np.ndarray,
    original: np.ndarray,
) -> bool:
    """Demote every block, scribble over the pool, promote them back: the pool as before."""
    assert host.data is not None and primary.data is not None
    host.data[...] = 0
    copier.demote(ids, slots)
    copier.stream.synchronize()
    demoted = bool(np.array_equal(host.data[slots[:64]], original[ids[:64]]))
    with copier.stream:
        primary.data.fill(0x5A)
    copier.promote(slots, ids)
    fence = copier.fence()
    copier.stream.synchronize()
    return demoted and fence.done and bool(np.array_equal(primary.data.get(), original))


def _gpu_anchors(primary: CudaPool, host: HostPool, repeats: int, warmup: int) -> dict[str, Any]:
    """One contiguous copy of the whole pool each way: to and from the host tier (registered
    here as the copier registers it) and to and from memory from alloc_pinned_memory."""
    import cupy

    assert host.data is not None and primary.data is not None
    runtime = cupy.cuda.runtime
    size = primary.num_blocks * primary.block_bytes
    dev = int(primary.data.data.ptr)
    stream = primary.stream
    out: dict[str, Any] = {"bytes": size}
    pinned = cupy.cuda.alloc_pinned_memory(size)
    registered = int(host.data.ctypes.data)
    runtime.hostRegister(registered, size, 1 | 2)
    try:
        for name, hptr in (("registered", registered), ("pinned", int(pinned.ptr))):
            for direction, kind, dst, src in (("h2d", _H2D, dev, hptr), ("d2h", _D2H, hptr, dev)):
                copy = functools.partial(runtime.memcpyAsync, dst, src, size, kind, stream.ptr)
                wall, _ = _median_times(copy, stream.synchronize, warmup, repeats)
                out[f"{name}_{direction}_gbs"] = round(size / wall / 1e9, 2)
    finally:
        runtime.hostUnregister(registered)
    return out


def _device_name() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


# -- NumPy -------------------------------------------------------------------------------------


def _numpy_block_size(
    rows: list[dict[str, Any]],
    anchors: list[dict[str, Any]],
    bb: int,
    n: int,
    ids: np.ndarray,
    slots: np.ndarray,
    repeats: int,
    warmup: int,
) -> None:
    with _pools(n, bb, gpu=False) as (primary, host):
        assert isinstance(primary, HostPool) and primary.data is not None
        assert host.data is not None
        primary.data[...] = np.random.default_rng(bb).integers(0, 256, primary.data.shape, np.uint8)
        original = primary.data.copy()
        src, dst = primary.data, host.data
        wall, _ = _median_times(lambda: np.copyto(dst, src), lambda: None, warmup, repeats)
        anchor_gbs = n * bb / wall / 1e9
        anchors.append({"block_bytes": bb, "bytes": n * bb, "copyto_gbs": round(anchor_gbs, 2)})
        copier = tier_copy.NumpyCopier(primary, host)
        copier.demote(ids, slots)
        primary.data[...] = 0x5A
        copier.promote(slots, ids)
        check = bool(np.array_equal(primary.data, original))
        for direction, fn in _directions(copier, ids, slots):
            wall, enq = _median_times(fn, lambda: None, warmup, repeats)
            _row(rows, bb=bb, n=n, method="numpy", direction=direction, wall=wall,
                 enqueue=enq, anchor_gbs=anchor_gbs, check=check)  # fmt: skip


@contextlib.contextmanager
def _pools(n: int, bb: int, *, gpu: bool) -> Iterator[tuple[HostPool | CudaPool, HostPool]]:
    primary: HostPool | CudaPool = CudaPool(n, bb, False, 0) if gpu else HostPool(n, bb, False)
    try:
        host = HostPool(n, bb, False)
        try:
            yield primary, host
        finally:
            host.close()
    finally:
        primary.close()


# -- report ------------------------------------------------------------------------------------


def format_table(result: dict[str, Any]) -> Table:
    """The bench result as a rich Table (one row per method, block size and direction)."""
    table = Table(
        title=(
            f"Tier copies on {escape(result['device'])}: {result['total_bytes'] / MIB:.0f} MiB "
            f"per direction, scattered ids; target >= {result['target_pct']:g}% of the anchor"
        )
    )
    for name in ("block", "method", "direction", "ms", "enqueue ms", "GB/s", "anchor GB/s", "%"):
        table.add_column(name, justify="left" if name in ("method", "direction") else "right")
    for row in result["rows"]:
        if "error" in row:
            table.add_row(_size(row["block_bytes"]), escape(row["method"]), "error", "", "", "",
                          "", escape(row["error"][:80]))  # fmt: skip
            continue
        pct = row["pct_of_anchor"]
        style = "green" if pct >= result["target_pct"] else "red"
        table.add_row(
            _size(row["block_bytes"]),
            escape(row["method"]),
            row["direction"],
            f"{row['ms_median']:.2f}",
            f"{row['enqueue_ms']:.2f}",
            f"{row['gbs']:.1f}",
            f"{row['anchor_gbs']:.1f}",
            f"[{style}]{pct:.0f}[/{style}]",
        )
    anchors = "; ".join(
        f"{_size(a['block_bytes'])}: "
        + ", ".join(f"{k.removesuffix('_gbs')} {v:.1f}" for k, v in a.items() if k.endswith("_gbs"))
        for a in result["anchors"]
    )
    bad = [k for k, ok in result["checks"].items() if not ok]
    table.caption = (
        f"anchors GB/s: {anchors}. round trips: "
        + ("all equal" if not bad else "FAILED " + ", ".join(bad))
        + (f". {result['note']}" if result.get("note") else "")
    )
    return table


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n % MIB == 0 else f"{n >> 10} KiB" if n % 1024 == 0 else f"{n} B"


# -- command -----------------------------------------------------------------------------------


def bench_tiers(
    total_mib: Annotated[int, typer.Option(help="MiB copied per direction and block size.")] = 512,
    block_bytes: Annotated[
        list[int] | None, typer.Option(help="Block size in bytes (repeatable).")
    ] = None,
    method: Annotated[
        list[str] | None,
        typer.Option(help="GPU copy method: auto, kernel, memcpy, batch (repeatable)."),
    ] = None,
    variant: Annotated[
        list[str] | None,
        typer.Option(help="Also time the kernel with UNROLL:CTAS_PER_SM (repeatable)."),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Timed copies per direction (median).")] = 7,
    warmup: Annotated[int, typer.Option(help="Untimed copies first.")] = 2,
    cpu: Annotated[bool, typer.Option(help="Measure the NumPy copier even with a GPU.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """GB/s of demoting blocks to the host tier and promoting them back, against one
    contiguous copy of the same bytes (NumPy copier and np.copyto without a GPU)."""
    for name in method or []:
        if name not in tier_copy.COPY_METHODS:
            err.print(f"kvpubd: unknown method {name!r} (auto, kernel, memcpy, batch)")
            raise typer.Exit(2)
    variants = [(int(u), int(c)) for u, c in (spec.split(":") for spec in variant or [])]
    result = run_tier_bench(
        total_mib,
        block_bytes or list(DEFAULT_BLOCK_BYTES),
        repeats=repeats,
        warmup=warmup,
        methods=method,
        variants=variants,
        cpu=cpu,
        log=None if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]")),
    )
    if as_json:
        typer.echo(json.dumps(result))
    else:
        Console(width=200).print(format_table(result))
    if not all(result["checks"].values()):
        raise typer.Exit(1)
