"""GPU block kernels (scrub, checksum) over the KV block pool, and their NumPy twins.

The pool is a 2-D ``uint8`` array ``[num_blocks, block_bytes]``; ``block_bytes`` is any positive
integer (not necessarily a multiple of 16). On the GPU the kernels come from
``kvpubd/daemon/_kernels/block_ops.cu`` (``kernels/block_ops.cu`` at the top of the
repository links to it), compiled at run time by ``cupy.RawModule``. CuPy is imported lazily:
this module imports and its NumPy twins run where CuPy or a GPU is absent (CI).

Operations
----------
``scrub(pool, ids)``
    Zero every listed block. Ids may repeat.
``checksum(pool, ids) -> uint64[len(ids)]``
    A 64-bit checksum of each listed block, defined below. Ids may repeat.

Every id must lie in ``[0, num_blocks)``; the wrappers raise ``ValueError`` otherwise. Empty id
lists are allowed and do nothing (``checksum`` returns an empty array).

Checksum definition
-------------------
All arithmetic is on unsigned 64-bit integers, modulo 2**64. With::

    mix64(z):                       # the finaliser of SplitMix64
        z = z ^ (z >> 30); z = z * 0xBF58476D1CE4E5B9
        z = z ^ (z >> 27); z = z * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        return z
    GOLDEN    = 0x9E3779B97F4A7C15
    SIZE_SALT = 0xD1B54A32D192ED03

a block of ``n = block_bytes`` bytes ``b[0..n-1]`` is read as ``W = ceil(n / 8)`` words,
``word[i] = sum_{j<8} b[8*i + j] << (8*j)`` (little-endian; bytes past ``n`` count as zero), and::

    S        = sum_{i<W} mix64(word[i] ^ (i * GOLDEN))
    checksum = mix64(S ^ (n * SIZE_SALT))

Because ``S`` is a sum modulo 2**64 its terms can be added in any order, so the GPU's parallel
reduction (per-lane sums, warp shuffles, 64-bit atomics across warps) is exact and deterministic
and equals :func:`numpy_checksum` bit for bit. Properties: ``mix64`` is a bijection, so changing
any single word (hence any single byte) always changes the checksum; the word index salt makes
it depend on where bytes are, not just on which bytes there are; the final ``n * SIZE_SALT``
term separates blocks that differ only in zero padding (8 zero bytes against 16). It is an
integrity check against accidents, not a cryptographic hash.
"""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "GOLDEN",
    "SIZE_SALT",
    "TILE_BYTES",
    "KernelSet",
    "KernelUnavailable",
    "gpu_available",
    "kernel_source",
    "kernel_source_path",
    "numpy_checksum",
    "numpy_scrub",
    "validate_ids",
]

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
SIZE_SALT = 0xD1B54A32D192ED03
MIX_C1 = 0xBF58476D1CE4E5B9
MIX_C2 = 0x94D049BB133111EB

# Defaults for KV_TILE / KV_UNROLL / KV_STREAMING, passed to block_ops.cu with -D;
# WARPS_PER_CTA must match KV_WARPS_PER_CTA there.
TILE_BYTES = 8192
UNROLL = 4
STREAMING = False
WARPS_PER_CTA = 8
THREADS_PER_CTA = 32 * WARPS_PER_CTA

_KERNEL_PACKAGE = "kvpubd.daemon"
_KERNEL_FILE = "_kernels/block_ops.cu"
_KERNEL_NAMES = ("kv_scrub", "kv_checksum_partial", "kv_checksum_final")


class KernelUnavailable(RuntimeError):
    """CuPy or a CUDA device is missing, or the kernels failed to build."""


# ---------------------------------------------------------------------------------------------
# Id validation (shared by the twins and the GPU wrappers)


def _as_host_ids(ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"block ids must be a 1-D list, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"block ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def validate_ids(num_blocks: int, ids: Any) -> np.ndarray:
    """``ids`` as a 1-D int64 array, after checking each lies in ``[0, num_blocks)``."""
    arr = _as_host_ids(ids)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_blocks):
        raise ValueError(
            f"block id out of range [0, {num_blocks}): min {int(arr.min())}, max {int(arr.max())}"
        )
    return arr


def _check_host_pool(pool: np.ndarray) -> None:
    if not isinstance(pool, np.ndarray) or pool.dtype != np.uint8 or pool.ndim != 2:
        raise ValueError("pool must be a 2-D numpy uint8 array [num_blocks, block_bytes]")
    if pool.shape[1] < 1:
        raise ValueError("block_bytes must be positive")


# ---------------------------------------------------------------------------------------------
# NumPy twins


def numpy_scrub(pool: np.ndarray, block_ids: Any) -> None:
    """Zero the listed blocks of ``pool`` in place."""
    _check_host_pool(pool)
    ids = validate_ids(pool.shape[0], block_ids)
    if ids.size:
        pool[ids] = 0


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, element-wise on a uint64 array (modifies and returns ``z``)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(MIX_C1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(MIX_C2)
    z ^= z >> np.uint64(31)
    return z


@functools.lru_cache(maxsize=16)
def _word_salts(num_words: int) -> np.ndarray:
    salts = np.arange(num_words, dtype=np.uint64)
    salts *= np.uint64(GOLDEN)  # wraps modulo 2**64
    salts.flags.writeable = False
    return salts


def _checksum_rows(rows: np.ndarray) -> np.ndarray:
    """Checksums of the rows of a 2-D uint8 array (one row a block)."""
    count, nbytes = rows.shape
    num_words = -(-nbytes // 8)
    padded = np.zeros((count, num_words * 8), dtype=np.uint8)
    padded[:, :nbytes] = rows
    words = padded.view(np.dtype("<u8"))  # (count, num_words), little-endian on any host
    z = _mix64(words ^ _word_salts(num_words))
    sums = z.sum(axis=1, dtype=np.uint64)  # integer sums wrap modulo 2**64
    sums ^= np.uint64((nbytes * SIZE_SALT) & MASK64)
    return _mix64(sums)


def numpy_checksum(pool: np.ndarray, block_ids: Any, *, chunk_bytes: int = 32 << 20) -> np.ndarray:
    """Checksum (as defined in the module docstring) of each listed block, as ``uint64``."""
    _check_host_pool(pool)
    ids = validate_ids(pool.shape[0], block_ids)
    out = np.empty(ids.size, dtype=np.uint64)
    per_chunk = max(1, chunk_bytes // pool.shape[1])
    for start in range(0, ids.size, per_chunk):
        sel = ids[start : start + per_chunk]
        out[start : start + sel.size] = _checksum_rows(pool[sel])
    return out


# ---------------------------------------------------------------------------------------------
# GPU side


def kernel_source_path() -> Path:
    """Path of ``block_ops.cu`` as shipped inside the package (package data)."""
    resource = importlib.resources.files(_KERNEL_PACKAGE).joinpath(_KERNEL_FILE)
    return Path(str(resource))


def kernel_source() -> str:
    """The CUDA source of the block kernels."""
    return (
        importlib.resources.files(_KERNEL_PACKAGE)
        .joinpath(_KERNEL_FILE)
        .read_text(encoding="utf-8")
    )


def _import_cupy() -> Any:
    try:
        import cupy
    except Exception as exc:
        raise KernelUnavailable(
            "the GPU block kernels need CuPy (e.g. pip install cupy-cuda12x) and a CUDA GPU; "
            f"importing cupy failed: {exc}"
        ) from exc
    return cupy


def gpu_available() -> bool:
    """Whether CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


@functools.lru_cache(maxsize=16)
def _load_module(device_id: int, tile_bytes: int, unroll: int, streaming: bool) -> Any:
    cupy = _import_cupy()
    options = (
        "-std=c++17",
        f"-DKV_TILE={tile_bytes}",
        f"-DKV_UNROLL={unroll}",
        f"-DKV_STREAMING={int(streaming)}",
    )
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(code=kernel_source(), options=options)
        # Compile and look up every kernel now, so a build error surfaces at load time.
        functions = {name: module.get_function(name) for name in _KERNEL_NAMES}
    return functions


class KernelSet:
    """The block kernels bound to one CUDA stream (the pool's stream).

    Every method only enqueues work on that stream and returns without waiting for it, except
    where validation of device-resident id lists needs a result (see ``validate``). Host id lists
    (lists, NumPy arrays) are checked on the host and uploaded once per call; device id lists
    (CuPy arrays) are used as they are.
    """

    def __init__(
        self, functions: dict[str, Any], stream: Any, device_id: int, tile_bytes: int = TILE_BYTES
    ) -> None:
        self._fn = functions
        self.stream = stream
        self.device_id = device_id
        self.tile_bytes = tile_bytes
        cupy = _import_cupy()
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
        self.num_sms = int(props["multiProcessorCount"])
        # Enough CTAs to fill every SM a few times over; warps then stride over the tiles.
        self.max_ctas = self.num_sms * 16

    @classmethod
    def load(
        cls,
        stream: Any = None,
        *,
        tile_bytes: int = TILE_BYTES,
        unroll: int = UNROLL,
        streaming: bool = STREAMING,
    ) -> KernelSet:
        """Build (once per device, cached) and return the kernels for ``stream``.

        ``stream`` is a ``cupy.cuda.Stream`` (``None``: CuPy's current stream at load time).
        ``tile_bytes`` (bytes of a block per warp, a multiple of 16), ``unroll`` (16-byte
        accesses in flight per lane) and ``streaming`` (evict-first cache hints on the 16-byte
        accesses) are tuning knobs; results do not depend on them.
        Raises :class:`KernelUnavailable` when CuPy or a GPU is missing or the build fails.
        """
        if tile_bytes < 16 or tile_bytes % 16 or unroll < 1:
            raise ValueError("tile_bytes must be a positive multiple of 16, unroll positive")
        cupy = _import_cupy()
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise KernelUnavailable("no CUDA device is visible")
            if stream is None:
                stream = cupy.cuda.get_current_stream()
            device_id = getattr(stream, "device_id", None)
            if device_id is None or device_id < 0:
                device_id = int(cupy.cuda.runtime.getDevice())
            device_id = int(device_id)
            functions = _load_module(device_id, tile_bytes, unroll, bool(streaming))
        except KernelUnavailable:
            raise
        except Exception as exc:
            raise KernelUnavailable(f"could not build the block kernels: {exc}") from exc
        return cls(functions, stream, device_id, tile_bytes)

    # -- helpers ---------------------------------------------------------------------------

    def _geometry(self, pool: Any) -> tuple[int, int, int]:
        cupy = _import_cupy()
        if not isinstance(pool, cupy.ndarray) or pool.dtype != cupy.uint8 or pool.ndim != 2:
            raise ValueError("pool must be a 2-D cupy uint8 array [num_blocks, block_bytes]")
        num_blocks, block_bytes = pool.shape
        if block_bytes < 1:
            raise ValueError("block_bytes must be positive")
        if pool.strides[1] != 1 or (num_blocks > 1 and pool.strides[0] < block_bytes):
            raise ValueError("pool rows must be contiguous and must not overlap")
        if pool.device.id != self.device_id:
            raise ValueError(f"pool is on device {pool.device.id}, kernels on {self.device_id}")
        row_stride = pool.strides[0] if num_blocks > 1 else block_bytes
        return num_blocks, block_bytes, row_stride

    def _device_ids(self, ids: Any, num_blocks: int, validate: bool) -> Any:
        cupy = _import_cupy()
        if isinstance(ids, cupy.ndarray):
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise ValueError("device block ids must be a 1-D integer cupy array")
            with self.stream:
                dev = cupy.ascontiguousarray(ids, dtype=cupy.int64)
                if validate and dev.size:
                    bad = bool(((dev < 0) | (dev >= num_blocks)).any())  # syncs the stream
                    if bad:
                        raise ValueError(f"block id out of range [0, {num_blocks})")
            return dev
        host = validate_ids(num_blocks, ids) if validate else _as_host_ids(ids)
        with self.stream:
            return cupy.asarray(np.ascontiguousarray(host, dtype=np.int64))

    def _grid(self, n_tiles: int) -> int:
        ctas = -(-n_tiles // WARPS_PER_CTA)
        return max(1, min(ctas, self.max_ctas))

    def _tiles_per_block(self, block_bytes: int) -> int:
        return -(-block_bytes // self.tile_bytes)

    # -- kernels ---------------------------------------------------------------------------

    def scrub(self, pool: Any, block_ids: Any, *, validate: bool = True) -> None:
        """Zero the listed blocks (enqueued on the stream)."""
        num_blocks, block_bytes, row_stride = self._geometry(pool)
        ids = self._device_ids(block_ids, num_blocks, validate)
        n = int(ids.size)
        if n == 0:
            return
        tpb = self._tiles_per_block(block_bytes)
        with self.stream:
            geometry = (pool, np.uint64(row_stride), np.uint64(block_bytes))
            args = (*geometry, ids, np.int64(n), np.uint64(tpb))
            self._fn["kv_scrub"]((self._grid(n * tpb),), (THREADS_PER_CTA,), args)

    def checksum(self, pool: Any, block_ids: Any, *, validate: bool = True) -> Any:
        """Checksums of the listed blocks as a ``cupy`` uint64 array (filled on the stream;
        synchronise the stream, or ``.get()`` it, before reading it on the host)."""
        cupy = _import_cupy()
        num_blocks, block_bytes, row_stride = self._geometry(pool)
        ids = self._device_ids(block_ids, num_blocks, validate)
        n = int(ids.size)
        tpb = self._tiles_per_block(block_bytes)
        with self.stream:
            # With one tile per block each sum is written whole; otherwise warps add into it.
            sums = cupy.empty(n, dtype=cupy.uint64) if tpb == 1 else cupy.zeros(n, cupy.uint64)
            if n == 0:
                return sums
            geometry = (pool, np.uint64(row_stride), np.uint64(block_bytes))
            args = (*geometry, ids, np.int64(n), np.uint64(tpb), sums)
            self._fn["kv_checksum_partial"]((self._grid(n * tpb),), (THREADS_PER_CTA,), args)
            final_ctas = max(1, min(-(-n // 256), self.num_sms * 4))
            self._fn["kv_checksum_final"](
                (final_ctas,), (256,), (sums, np.int64(n), np.uint64(block_bytes))
            )
        return sums
