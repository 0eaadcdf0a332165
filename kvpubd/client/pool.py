"""Map the daemon's block pool into this process (POSIX shared memory or CUDA IPC)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpubd.client.control import ControlClient
from kvpubd.client.replies import PoolInfo


class MappedPool:
    """The daemon's block pool mapped into this process: ``array`` is ``[num_blocks,
    block_bytes]`` uint8, a NumPy array over shared memory or a CuPy array over a CUDA IPC
    mapping. Close it before the daemon stops."""

    def __init__(self, info: PoolInfo) -> None:
        shape = info.shape
        self.info = info
        self._shm: Any = None
        self._ipc_ptr: int | None = None
        self.array: Any  # numpy.ndarray or cupy.ndarray (None once closed)
        if info.kind == "shm" and info.name is not None:
            from multiprocessing import resource_tracker, shared_memory

            self._shm = shared_memory.SharedMemory(name=info.name)
            # Before Python 3.13 attaching registers the segment with this process's resource
            # tracker, which would unlink the daemon's segment when we exit.
            resource_tracker.unregister(self._shm._name, "shared_memory")
            self.array = np.ndarray(shape, dtype=np.uint8, buffer=self._shm.buf)
        elif info.kind == "cuda_ipc" and info.handle is not None and info.device is not None:
            import cupy

            self._device = info.device
            with cupy.cuda.Device(self._device):
                self._ipc_ptr = cupy.cuda.runtime.ipcOpenMemHandle(
                    info.handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
                )
                size = shape[0] * shape[1]
                memory = cupy.cuda.UnownedMemory(self._ipc_ptr + info.offset, size, self)
                pointer = cupy.cuda.MemoryPointer(memory, 0)
                self.array = cupy.ndarray(shape, dtype=cupy.uint8, memptr=pointer)
        else:
            raise ValueError(f"cannot map a pool of kind {info.kind!r} described as {info}")

    def __enter__(self) -> MappedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.array = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._ipc_ptr is not None:
            import cupy

            with cupy.cuda.Device(self._device):
                cupy.cuda.runtime.deviceSynchronize()
                cupy.cuda.runtime.ipcCloseMemHandle(self._ipc_ptr)
            self._ipc_ptr = None


def map_pool(control: ControlClient, rank: int | None = None) -> MappedPool:
    """Map rank ``rank``'s block pool (default: the first rank served) of the daemon behind
    ``control`` into this process."""
    return MappedPool(control.pool_info(rank))


def map_host_tier(control: ControlClient, rank: int | None = None) -> MappedPool:
    """Map rank ``rank``'s host tier (``cache.host_blocks``; ValueError where it is off): a
    NumPy array ``[host_blocks, block_bytes]`` over shared memory."""
    info = control.pool_info(rank)
    if info.host is None:
        raise ValueError(f"rank {info.rank} has no host tier (cache.host_blocks = 0)")
    host = info.host
    return MappedPool(
        PoolInfo(
            rank=info.rank,
            kind="shm",
            shape=host.shape,
            dtype=host.dtype,
            block_bytes=info.block_bytes,
            name=host.name,
        )
    )
