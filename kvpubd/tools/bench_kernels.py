"""``kvpubd bench kernels``: GB/s of the GPU block kernels against the device's own bandwidth.

Allocates a pool of ``pool_gib`` GiB on the GPU for each block size and times, with CUDA events
on one stream over repeated runs (median reported), the kvpubd kernels and, beside them on the
same data, CuPy's own ways of doing the same thing. The device bandwidth is that of a large
device-to-device ``cupy.copyto`` (bytes read + written). Bytes counted per operation:

* scrub: bytes zeroed (written);
* checksum / sum: bytes read.

Run as ``kvpubd bench kernels`` (``--help``); ``--check`` runs a quick GPU-vs-NumPy comparison
of every kernel instead, for machines without pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
from rich.markup import escape
from rich.table import Table

from kvpubd.daemon.kernels import (
    TILE_BYTES,
    UNROLL,
    KernelSet,
    numpy_checksum,
    numpy_scrub,
)

GIB = 1 << 30
TARGET_PCT = 85.0
DEFAULT_BLOCK_BYTES = (65536, 2 << 20)


def _cupy() -> Any:
    from kvpubd.daemon.kernels import _import_cupy

    return _import_cupy()


def _time_ms(fn: Callable[[], Any], stream: Any, warmup: int, repeats: int) -> list[float]:
    """Per-run times in ms of ``fn`` (which enqueues work on ``stream``), by CUDA events."""
    cp = _cupy()
    with stream:
        for _ in range(warmup):
            fn()
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeats)]
        for start, end in events:
            start.record(stream)
            fn()
            end.record(stream)
        stream.synchronize()
    return [float(cp.cuda.get_elapsed_time(s, e)) for s, e in events]


def _fill_pattern(pool: Any, stream: Any, seed: int) -> None:
    """Fill ``pool`` with cheap pseudo-random bytes (a hash of the byte index)."""
    cp = _cupy()
    kern = cp.ElementwiseKernel(
        "uint64 seed",
        "uint8 x",
        """
        unsigned long long z = (unsigned long long)i * 0x9E3779B97F4A7C15ULL + seed;
        z ^= z >> 31; z *= 0xBF58476D1CE4E5B9ULL; z ^= z >> 29;
        x = (unsigned char)(z >> 24);
        """,
        "kvpubd_fill_pattern",
    )
    with stream:
        kern(np.uint64(seed), pool.reshape(-1))


def _row(
    rows: list[dict[str, Any]],
    *,
    block_bytes: int,
    num_blocks: int,
    impl: str,
    op: str,
    what: str,
    nbytes: int,
    times: list[float],
    device_gbs: float,
) -> None:
    med = float(np.median(times))
    gbs = nbytes / (med * 1e-3) / 1e9
    rows.append(
        {
            "block_bytes": block_bytes,
            "num_blocks": num_blocks,
            "impl": impl,
            "op": op,
            "what": what,
            "bytes": int(nbytes),
            "ms_median": round(med, 4),
            "ms_min": round(min(times), 4),
            "gbs": round(gbs, 1),
            "pct_of_device": round(100.0 * gbs / device_gbs, 1),
        }
    )


def measure_device_bandwidth(
    stream: Any, nbytes: int = 4 * GIB, warmup: int = 2, repeats: int = 10
) -> dict[str, Any]:
    """Device-to-device copy bandwidth (read + write bytes), and a memset's for reference.
    The two buffers are freed into CuPy's memory pool on return."""
    cp = _cupy()
    with stream:
        a = cp.empty(nbytes, dtype=cp.uint8)
        b = cp.empty(nbytes, dtype=cp.uint8)
        _fill_pattern(a, stream, 1)
    copy_t = _time_ms(lambda: cp.copyto(b, a), stream, warmup, repeats)
    fill_t = _time_ms(lambda: b.fill(0), stream, warmup, repeats)
    copy_ms = float(np.median(copy_t))
    fill_ms = float(np.median(fill_t))
    return {
        "copy_bytes": 2 * nbytes,
        "copy_ms": round(copy_ms, 4),
        "gbs": round(2 * nbytes / (copy_ms * 1e-3) / 1e9, 1),
        "memset_gbs": round(nbytes / (fill_ms * 1e-3) / 1e9, 1),
    }


def _bench_block_size(
    rows: list[dict[str, Any]],
    checks: dict[str, bool],
    kernel_sets: list[tuple[str, KernelSet]],
    stream: Any,
    rng: np.random.Generator,
    block_bytes: int,
    num_blocks: int,
    device_gbs: float,
    *,
    warmup: int,
    repeats: int,
    seed: int,
    verify: bool,
) -> None:
    """Time every operation on one pool of ``num_blocks`` blocks of ``block_bytes``."""
    cp = _cupy()
    default_ks = kernel_sets[0][1]
    with stream:
        pool = cp.empty((num_blocks, block_bytes), dtype=cp.uint8)
    _fill_pattern(pool, stream, seed + block_bytes)
    perm = rng.permutation(num_blocks)
    half = num_blocks // 2
    with stream:
        all_ids = cp.asarray(perm)
        in_order_ids = cp.arange(num_blocks, dtype=cp.int64)
        half_ids = cp.asarray(np.sort(perm[:half]))  # random half, in address order
        half_ids_shuffled = cp.asarray(perm[:half])
    common: dict[str, Any] = {
        "block_bytes": block_bytes,
        "num_blocks": num_blocks,
        "device_gbs": device_gbs,
    }
    full_bytes = num_blocks * block_bytes
    half_bytes = half * block_bytes

    def kv(rows_impl: str, op: str, what: str, nbytes: int, fn: Callable[[], Any]) -> None:
        times = _time_ms(fn, stream, warmup, repeats)
        _row(rows, impl=rows_impl, op=op, what=what, nbytes=nbytes, times=times, **common)

    # checksum first, while the pool holds the pattern
    for label, ks in kernel_sets:
        kv(label, "checksum", "all blocks, random order (read)", full_bytes,
           partial(ks.checksum, pool, all_ids, validate=False))  # fmt: skip
    if block_bytes % 8 == 0:
        words = pool.view(cp.uint64)
        kv("cupy", "checksum", "words.sum(axis=1), all blocks, contiguous", full_bytes,
           lambda: words.sum(axis=1))  # fmt: skip
        kv("cupy", "checksum", "words[ids].sum(axis=1), random half", half_bytes,
           lambda: words[half_ids_shuffled].sum(axis=1))  # fmt: skip
    if verify:
        sums = default_ks.checksum(pool, all_ids[:8], validate=False).get(stream=stream)
        sample = pool[all_ids[:8]].get(stream=stream)
        checks[f"checksum_twin_{block_bytes}"] = bool(
            np.array_equal(sums, numpy_checksum(sample, np.arange(8)))
        )

    # scrub
    for label, ks in kernel_sets:
        kv(label, "scrub", "random half (write)", half_bytes,
           partial(ks.scrub, pool, half_ids_shuffled, validate=False))  # fmt: skip
        kv(label, "scrub", "all blocks, random order (write)", full_bytes,
           partial(ks.scrub, pool, all_ids, validate=False))  # fmt: skip
        kv(label, "scrub", "all blocks, address order (write)", full_bytes,
           partial(ks.scrub, pool, in_order_ids, validate=False))  # fmt: skip

    def cupy_scatter_zero() -> None:
        pool[half_ids_shuffled] = 0

    kv("cupy", "scrub", "pool[ids] = 0, random half", half_bytes, cupy_scatter_zero)
    kv("cupy", "scrub", "pool[:n].fill(0), contiguous half", half_bytes,
       lambda: pool[:half].fill(0))  # fmt: skip
    kv("cupy", "scrub", "pool.fill(0), whole pool", full_bytes, lambda: pool.fill(0))
    if verify:
        _fill_pattern(pool, stream, seed + 1)
        default_ks.scrub(pool, half_ids_shuffled, validate=False)
        with stream:
            zeroed = not bool(pool[half_ids].any())
            # Blocks outside the scrubbed half keep their (non-zero) pattern.
            kept = bool(pool[cp.asarray(perm[half:])].any(axis=1).all())
        checks[f"scrub_{block_bytes}"] = zeroed and kept


def run_kernel_bench(
    pool_gib: float = 8.0,
    block_bytes_list: Sequence[int] = DEFAULT_BLOCK_BYTES,
    *,
    repeats: int = 10,
    warmup: int = 2,
    seed: int = 0,
    bandwidth_gib: float = 4.0,
    variants: Sequence[tuple[int, int, bool]] = (),
    verify: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time the kvpubd block kernels and CuPy baselines on a ``pool_gib`` GiB pool.

    ``block_bytes_list``: block sizes, one pool each. ``variants``: extra ``(tile_bytes,
    unroll, streaming)`` builds of the kernels to time beside the default one.
    ``bandwidth_gib``: size of the copy that measures the device bandwidth (>= 2 GiB
    recommended). Returns a dict (JSON serialisable) with ``device``, ``bandwidth`` and one row
    per measured operation.
    """
    cp = _cupy()
    say = log or (lambda _msg: None)
    stream = cp.cuda.Stream(non_blocking=True)
    default_ks = KernelSet.load(stream)
    kernel_sets: list[tuple[str, KernelSet]] = [("kvpubd", default_ks)]
    for tile, unroll, streaming in variants:
        name = f"kvpubd[tile={tile},unroll={unroll}{',cs' if streaming else ''}]"
        ks = KernelSet.load(stream, tile_bytes=tile, unroll=unroll, streaming=streaming)
        kernel_sets.append((name, ks))
    props = cp.cuda.runtime.getDeviceProperties(default_ks.device_id)
    name = props["name"]
    device_name = name.decode() if isinstance(name, bytes) else str(name)

    say(f"device bandwidth: copying {bandwidth_gib:g} GiB device to device")
    bandwidth = measure_device_bandwidth(stream, int(bandwidth_gib * GIB), warmup, repeats)
    stream.synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    device_gbs = float(bandwidth["gbs"])
    rows: list[dict[str, Any]] = []
    checks: dict[str, bool] = {}
    rng = np.random.default_rng(seed)

    for block_bytes in block_bytes_list:
        num_blocks = int(pool_gib * GIB) // block_bytes
        if num_blocks < 4:
            raise ValueError(f"pool of {pool_gib} GiB holds fewer than 4 blocks of {block_bytes}")
        say(f"block_bytes={block_bytes}: pool of {num_blocks} blocks")
        with stream:  # every CuPy operation below is ordered on the one stream
            _bench_block_size(
                rows, checks, kernel_sets, stream, rng, block_bytes, num_blocks, device_gbs,
                warmup=warmup, repeats=repeats, seed=seed, verify=verify,
            )  # fmt: skip
        stream.synchronize()
        cp.get_default_memory_pool().free_all_blocks()

    return {
        "device": device_name,
        "pool_gib": pool_gib,
        "repeats": repeats,
        "warmup": warmup,
        "tile_bytes": TILE_BYTES,
        "unroll": UNROLL,
        "bandwidth": bandwidth,
        "target_pct": TARGET_PCT,
        "rows": rows,
        "checks": checks,
    }


def format_table(result: dict[str, Any]) -> Table:
    """The bench result as a rich Table (one row per measured operation)."""
    bw = result["bandwidth"]
    table = Table(
        title=(
            f"Block kernels on {escape(result['device'])}: pool {result['pool_gib']:g} GiB; device "
            f"bandwidth {bw['gbs']:.0f} GB/s (D2D copy, read+write); target >= "
            f"{result['target_pct']:g}%"
        )
    )
    table.add_column("block", justify="right")
    table.add_column("op")
    table.add_column("impl")
    table.add_column("what")
    table.add_column("GiB", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("GB/s", justify="right")
    table.add_column("% dev BW", justify="right")
    for row in result["rows"]:
        pct = row["pct_of_device"]
        pct_text = f"{pct:.1f}"
        if row["impl"].startswith("kvpubd"):
            style = "green" if pct >= result["target_pct"] else "red"
            pct_text = f"[{style}]{pct_text}[/{style}]"
        table.add_row(
            _size(row["block_bytes"]),
            row["op"],
            escape(row["impl"]),
            escape(row["what"]),
            f"{row['bytes'] / GIB:.2f}",
            f"{row['ms_median']:.3f}",
            f"{row['gbs']:.0f}",
            pct_text,
        )
    if result.get("checks"):
        bad = [k for k, ok in result["checks"].items() if not ok]
        table.caption = "checks: " + ("all passed" if not bad else "FAILED " + ", ".join(bad))
    return table


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def self_check(seed: int = 0) -> list[str]:
    """GPU kernels against their NumPy twins on small pools; returns the failures."""
    cp = _cupy()
    stream = cp.cuda.Stream(non_blocking=True)
    failures: list[str] = []
    rng = np.random.default_rng(seed)
    for tile, unroll, streaming in ((TILE_BYTES, UNROLL, False), (48, 1, True)):
        ks = KernelSet.load(stream, tile_bytes=tile, unroll=unroll, streaming=streaming)
        for block_bytes in (1, 7, 24, 100, 4099, 16397, 65536):
            for offset in (0, 4, 3):
                nb = max(2, min(33, (2 << 20) // block_bytes))
                host = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
                with stream:
                    raw = cp.zeros(nb * block_bytes + offset, dtype=cp.uint8)
                    pool = raw[offset:].reshape(nb, block_bytes)
                    pool.set(host)
                ids = rng.integers(0, nb, size=nb + 5)
                tag = f"tile={tile} block_bytes={block_bytes} offset={offset}"
                got = ks.checksum(pool, ids).get(stream=stream)
                if not np.array_equal(got, numpy_checksum(host, ids)):
                    failures.append(f"checksum {tag}")
                perm = rng.permutation(nb)
                sel = perm[: max(1, nb // 3)]
                ks.scrub(pool, sel)
                numpy_scrub(host, sel)
                if not np.array_equal(pool.get(stream=stream), host):
                    failures.append(f"scrub {tag}")
    return failures
