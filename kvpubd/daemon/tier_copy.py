"""Block copies between the primary pool and its host tier (a second pool in host memory).

Demoting copies primary blocks to host tier slots, promoting copies slots back into primary
blocks. Both take int64 arrays of the same length: ``block_ids[k]`` pairs with ``slots[k]``.
The host tier is a :class:`~kvpubd.daemon.pool.HostPool` (POSIX shared memory, so another
process can map it) with the primary's ``block_bytes``.

* A host primary gets a :class:`NumpyCopier`: NumPy copies, done when the call returns.
* A GPU primary gets a :class:`CudaCopier`: the copies are enqueued on the pool's own stream
  (ordered with its scrubs) and the copier never waits for them. ``fence()`` records an event
  there; poll ``fence.done`` to learn that every copy enqueued before it has finished.

A caller must not write a demoted block, or read a promoted one, before the copy's fence is
done, and must ``close()`` the copier before closing the host tier (the copier un-pins it).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
from collections import deque
from typing import Any, Literal, Protocol

import numpy as np

from kvpubd.daemon.kernels import _import_cupy, validate_ids
from kvpubd.daemon.pool import BlockPool, CudaPool, HostPool

__all__ = [
    "BATCH_MIN_RUNS",
    "COPY_METHODS",
    "CudaCopier",
    "Fence",
    "NumpyCopier",
    "TierCopier",
    "create_copier",
]

CopyMethod = Literal["auto", "kernel", "memcpy", "batch"]
COPY_METHODS: tuple[CopyMethod, ...] = ("auto", "kernel", "memcpy", "batch")

# Blocks of at least this many bytes are copied by the copy engines (cudaMemcpyAsync per run
# of consecutive ids); smaller ones by the gather/scatter kernel, where a call per block
# would cost more CPU time than the copy takes on the bus.
KERNEL_BELOW_BYTES = 1 << 20
# With "batch", lists of fewer runs than this go through plain cudaMemcpyAsync calls.
BATCH_MIN_RUNS = 4
# NumPy copies go through a gathered temporary of at most this many bytes (kept in cache).
NUMPY_CHUNK_BYTES = 8 << 20
# From this block size on, NumPy copies a run at a time (the per-call cost is small beside
# the bytes); below it, through the gathered temporary.
NUMPY_RUNS_FROM_BYTES = 32 << 10

_KERNEL_FILE = "_kernels/tier_copy.cu"
_COPY_THREADS = 256
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2
_MEMCPY_HOST_TO_DEVICE = 1
_MEMCPY_DEVICE_TO_HOST = 2
_ATTR_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem


class Fence(Protocol):
    @property
    def done(self) -> bool:
        """Every copy enqueued before the fence was taken has finished."""
        ...


class TierCopier(Protocol):
    # True: every copy is done when its call returns (fences are always done).
    synchronous: bool

    def demote(self, block_ids: np.ndarray, slots: np.ndarray) -> None:
        """Copy primary blocks ``block_ids[k]`` to host tier slots ``slots[k]`` (enqueue)."""
        ...

    def promote(self, slots: np.ndarray, block_ids: np.ndarray) -> None:
        """Copy host tier slots ``slots[k]`` to primary blocks ``block_ids[k]`` (enqueue)."""
        ...

    def fence(self) -> Fence: ...

    def close(self) -> None: ...


def create_copier(primary: BlockPool, host: HostPool) -> TierCopier:
    """The copier for ``primary``'s kind of pool; ``host`` must have its block size."""
    if host.block_bytes != primary.block_bytes:
        raise ValueError(
            f"host tier blocks are {host.block_bytes} bytes, primary blocks {primary.block_bytes}"
        )
    if isinstance(primary, CudaPool):
        return CudaCopier(primary, host)
    if isinstance(primary, HostPool):
        return NumpyCopier(primary, host)
    raise TypeError(f"no tier copier for a {type(primary).__name__}")


def _checked_pairs(
    dst_blocks: int, dst_ids: Any, src_blocks: int, src_ids: Any
) -> tuple[np.ndarray, np.ndarray]:
    dst = validate_ids(dst_blocks, dst_ids)
    src = validate_ids(src_blocks, src_ids)
    if dst.size != src.size:
        raise ValueError(f"{src.size} sources for {dst.size} destinations")
    return dst, src


class _Done:
    done = True


class NumpyCopier:
    """Host primary: NumPy copies between the two shared memory arrays, finished on return."""

    synchronous = True

    def __init__(self, primary: HostPool, host: HostPool) -> None:
        self._primary = primary
        self._host = host

    def demote(self, block_ids: np.ndarray, slots: np.ndarray) -> None:
        self._copy(self._host, slots, self._primary, block_ids)

    def promote(self, slots: np.ndarray, block_ids: np.ndarray) -> None:
        self._copy(self._primary, block_ids, self._host, slots)

    def fence(self) -> Fence:
        return _Done()

    def close(self) -> None:
        pass

    @staticmethod
    def _copy(dst_pool: HostPool, dst_ids: Any, src_pool: HostPool, src_ids: Any) -> None:
        dst_data, src_data = dst_pool.data, src_pool.data
        if dst_data is None or src_data is None:
            raise RuntimeError("a pool of the tier copy is closed")
        dst, src = _checked_pairs(dst_pool.num_blocks, dst_ids, src_pool.num_blocks, src_ids)
        if dst_pool.block_bytes >= NUMPY_RUNS_FROM_BYTES:
            # One slice copy per run: no temporary, each byte read and written once.
            starts, lengths = _runs(dst, src)
            for i, n in zip(starts.tolist(), lengths.tolist(), strict=True):
                d, s = int(dst[i]), int(src[i])
                dst_data[d : d + n] = src_data[s : s + n]
            return
        # Gather then scatter a cache-sized piece at a time: the temporary stays in cache.
        step = max(1, NUMPY_CHUNK_BYTES // dst_pool.block_bytes)
        for start in range(0, dst.size, step):
            dst_data[dst[start : start + step]] = src_data[src[start : start + step]]


class _EventFence:
    def __init__(self, event: Any) -> None:
        self._event = event

    @property
    def done(self) -> bool:
        return bool(self._event.done)  # cudaEventQuery: never blocks


def _runs(dst: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start indices and lengths of the runs where both ``dst`` and ``src`` go up by one."""
    if dst.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    breaks = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [dst.size]))).astype(np.int64)
    return starts, lengths


class CudaCopier:
    """GPU primary: copies enqueued on the pool's stream, over a page-locked, mapped host tier.

    ``method`` picks how scattered blocks are copied:

    * ``kernel``: one launch of a gather/scatter kernel that reads or writes the host tier
      through its device pointer (block_bytes must be a multiple of 16);
    * ``memcpy``: one ``cudaMemcpyAsync`` per run of consecutive ids (copy engines, no SMs);
    * ``batch``: the same runs in one ``cuMemcpyBatchAsync`` (CUDA 12.8 or later);
    * ``auto``: the kernel below ``KERNEL_BELOW_BYTES``, memcpy at and above it (measured with
      ``kvpubd bench tiers``).
    """

    synchronous = False

    def __init__(
        self,
        primary: CudaPool,
        host: HostPool,
        method: CopyMethod = "auto",
        *,
        unroll: int = 4,
        ctas_per_sm: int = 8,
    ) -> None:
        if host.block_bytes != primary.block_bytes:
            raise ValueError("the host tier and the primary pool differ in block size")
        if host.data is None or primary.data is None:
            raise RuntimeError("a pool of the tier copy is closed")
        cupy = _import_cupy()
        self._cupy = cupy
        self._primary = primary
        self._host = host
        self.block_bytes = primary.block_bytes
        self.stream = primary.stream
        self._device = primary.device
        self._device_base = int(primary.data.data.ptr)
        self._host_ptr = int(host.data.ctypes.data)
        self._host_size = host.num_blocks * host.block_bytes
        kernel_fits = self.block_bytes % 16 == 0
        if method == "auto":
            method = "kernel" if kernel_fits and self.block_bytes < KERNEL_BELOW_BYTES else "memcpy"
        if method == "kernel" and not kernel_fits:
            raise ValueError("the copy kernel needs block_bytes to be a multiple of 16")
        self.method: CopyMethod = method
        self._unroll = unroll
        # Everything that can fail comes before the registration, which must not leak.
        self._kernel = _load_kernel(self._device, unroll) if method == "kernel" else None
        self._batch = _batch_copy_function() if method == "batch" else None
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(self._device):
            props = runtime.getDeviceProperties(self._device)
            self._grid_cap = int(props["multiProcessorCount"]) * ctas_per_sm
            # Page-locked for DMA; mapped, so that the kernel can reach it; portable, so that
            # every context of the process sees it page-locked.
            runtime.hostRegister(
                self._host_ptr, self._host_size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
            )
            try:
                self._host_device_base = _mapped_pointer(runtime, self._host_ptr, self._device)
            except BaseException:
                runtime.hostUnregister(self._host_ptr)  # a registration outlives its mapping
                raise
            self._registered = True
        # Pinned id lists whose upload may still be in flight, with the event after it.
        self._staged: deque[tuple[Any, Any]] = deque()

    def demote(self, block_ids: np.ndarray, slots: np.ndarray) -> None:
        dst, src = _checked_pairs(self._host.num_blocks, slots, self._primary.num_blocks, block_ids)
        self._copy(dst, src, to_host=True)

    def promote(self, slots: np.ndarray, block_ids: np.ndarray) -> None:
        dst, src = _checked_pairs(self._primary.num_blocks, block_ids, self._host.num_blocks, slots)
        self._copy(dst, src, to_host=False)

    def fence(self) -> Fence:
        with self._cupy.cuda.Device(self._device):
            return _EventFence(self.stream.record())

    def close(self) -> None:
        if not self._registered:
            return
        with self._cupy.cuda.Device(self._device):
            # Un-pinning memory a copy still reads or writes is undefined: wait for them.
            try:
                self.stream.synchronize()
            finally:
                self._registered = False
                self._staged.clear()
                self._cupy.cuda.runtime.hostUnregister(self._host_ptr)

    # -- the three ways ----------------------------------------------------------------------

    def _copy(self, dst: np.ndarray, src: np.ndarray, *, to_host: bool) -> None:
        if not self._registered:
            raise RuntimeError("the tier copier is closed")
        if dst.size == 0:
            return
        with self._cupy.cuda.Device(self._device):
            if self._kernel is not None:
                self._copy_kernel(dst, src, to_host)
            else:
                self._copy_runs(dst, src, to_host)

    def _bases(self, to_host: bool, *, mapped: bool) -> tuple[int, int]:
        host = self._host_device_base if mapped else self._host_ptr
        return (host, self._device_base) if to_host else (self._device_base, host)

    def _copy_kernel(self, dst: np.ndarray, src: np.ndarray, to_host: bool) -> None:
        cupy = self._cupy
        n = int(dst.size)
        self._release_staged()
        # Ids go up through pinned memory: an upload from pageable memory may wait for the
        # stream, which would stall the caller behind earlier copies.
        pinned = cupy.cuda.alloc_pinned_memory(2 * n * 8)
        ids = np.frombuffer(pinned, dtype=np.int64, count=2 * n)
        ids[:n] = dst
        ids[n:] = src
        with self.stream:
            dev_ids = cupy.empty(2 * n, dtype=cupy.int64)
            cupy.cuda.runtime.memcpyAsync(
                dev_ids.data.ptr,
                ids.ctypes.data,
                2 * n * 8,
                _MEMCPY_HOST_TO_DEVICE,
                self.stream.ptr,
            )
            vecs = self.block_bytes // 16
            chunks = -(-vecs // (_COPY_THREADS * self._unroll))
            grid = max(1, min(n * chunks, self._grid_cap))
            dst_base, src_base = self._bases(to_host, mapped=True)
            assert self._kernel is not None
            self._kernel(
                (grid,),
                (_COPY_THREADS,),
                (
                    np.uint64(dst_base),
                    np.uint64(src_base),
                    np.uint64(vecs),
                    dev_ids,
                    np.int64(n),
                    np.uint64(chunks),
                ),
            )
        self._staged.append((self.stream.record(), pinned))

    def _release_staged(self) -> None:
        while self._staged and self._staged[0][0].done:
            self._staged.popleft()

    def _copy_runs(self, dst: np.ndarray, src: np.ndarray, to_host: bool) -> None:
        starts, lengths = _runs(dst, src)
        dst_base, src_base = self._bases(to_host, mapped=False)
        bb = self.block_bytes
        dst_ptrs = dst_base + dst[starts] * bb
        src_ptrs = src_base + src[starts] * bb
        sizes = lengths * bb
        if self._batch is not None and starts.size >= BATCH_MIN_RUNS:
            self._batch(dst_ptrs, src_ptrs, sizes, to_host, self._device, self.stream.ptr)
            return
        kind = _MEMCPY_DEVICE_TO_HOST if to_host else _MEMCPY_HOST_TO_DEVICE
        memcpy = self._cupy.cuda.runtime.memcpyAsync
        stream = self.stream.ptr
        for d, s, size in zip(dst_ptrs.tolist(), src_ptrs.tolist(), sizes.tolist(), strict=True):
            memcpy(d, s, size, kind, stream)


def _mapped_pointer(runtime: Any, host_ptr: int, device: int) -> int:
    """The device's address of registered, mapped host memory at ``host_ptr``."""
    if runtime.deviceGetAttribute(_ATTR_HOST_POINTER_FOR_REGISTERED_MEM, device):
        return host_ptr  # the usual case: unified addressing, the same address
    # CuPy does not wrap cudaHostGetDevicePointer; the driver's twin gives the same answer.
    pointer = ctypes.c_uint64(0)
    result = _driver().cuMemHostGetDevicePointer_v2(
        ctypes.byref(pointer), ctypes.c_void_p(host_ptr), ctypes.c_uint(0)
    )
    if result != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed: CUresult {result}")
    return int(pointer.value)


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    # By its soname, as the CUDA runtime loads it: find_library would start ldconfig.
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=8)
def _load_kernel(device: int, unroll: int) -> Any:
    cupy = _import_cupy()
    source = importlib.resources.files("kvpubd.daemon").joinpath(_KERNEL_FILE).read_text("utf-8")
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=source, options=("-std=c++17", f"-DKV_COPY_UNROLL={unroll}"))
        return module.get_function("kv_copy_blocks")


# -- cuMemcpyBatchAsync, through the driver library (CuPy does not wrap it) --------------------


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_SRC_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2


class _BatchCopy:
    """``cuMemcpyBatchAsync`` over lists of pointers and sizes (NumPy int64 arrays)."""

    def __init__(self, driver: ctypes.CDLL) -> None:
        # CUDA 13 names the form without the failIdx argument _v2; 12.8 and 12.9 have only the
        # form with it.
        fn = getattr(driver, "cuMemcpyBatchAsync_v2", None)
        self._with_fail_index = fn is None
        self._fn: Any = fn if fn is not None else driver.cuMemcpyBatchAsync  # else AttributeError

    def __call__(
        self,
        dsts: np.ndarray,
        srcs: np.ndarray,
        sizes: np.ndarray,
        to_host: bool,
        device: int,
        stream: int,
    ) -> None:
        device_loc = _MemLocation(_LOCATION_DEVICE, device)
        host_loc = _MemLocation(_LOCATION_HOST, 0)
        attrs = _MemcpyAttributes(
            _SRC_ACCESS_ORDER_STREAM,
            device_loc if to_host else host_loc,
            host_loc if to_host else device_loc,
            0,
        )
        d = np.ascontiguousarray(dsts, dtype=np.uint64)
        s = np.ascontiguousarray(srcs, dtype=np.uint64)
        z = np.ascontiguousarray(sizes, dtype=np.uint64)
        attr_index = ctypes.c_size_t(0)
        args: list[Any] = [
            ctypes.c_void_p(d.ctypes.data),
            ctypes.c_void_p(s.ctypes.data),
            ctypes.c_void_p(z.ctypes.data),
            ctypes.c_size_t(d.size),
            ctypes.byref(attrs),
            ctypes.byref(attr_index),
            ctypes.c_size_t(1),
        ]
        if self._with_fail_index:
            args.append(ctypes.byref(ctypes.c_size_t(0)))
        args.append(ctypes.c_void_p(stream))
        result = self._fn(*args)
        if result != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {result}")


@functools.lru_cache(maxsize=1)
def _batch_copy_function() -> _BatchCopy:
    try:
        return _BatchCopy(_driver())
    except (OSError, AttributeError) as exc:
        raise RuntimeError(f"cuMemcpyBatchAsync is not available: {exc}") from exc
