"""The KV block pool: one contiguous ``[num_blocks, block_bytes]`` array and its free list.

``HostPool`` keeps the array in POSIX shared memory (NumPy), ``CudaPool`` in GPU memory (CuPy),
so that the engine beside the daemon can map it (see ``info()``) and write KV data into the
blocks it is handed. Freed blocks are zeroed (``scrub_on_free``) before they are handed out
again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from kvpubd.daemon import kernels
from kvpubd.daemon.settings import CacheConfig, ConfigError
from kvpubd.protocol.control import PoolInfo

log = logging.getLogger(__name__)


# Bytes of the blocks a reset freed zeroed per loop turn: zeroing them all in one step held
# the next reset back (58 ms on the default pool, 0.5 s on a 512 MiB one).
SCRUB_SLICE_BYTES = 2 << 20
# Bytes of blocks (and at most this many ids) checksummed per loop turn: a checksum of the
# whole pool in one step took 0.25 s on the default 64 MiB pool.
CHECKSUM_SLICE_BYTES = 256 << 10
CHECKSUM_SLICE_IDS = 16384

# Where POSIX shared memory lives on Linux (shm_open creates its segments here).
SHM_DIR = Path("/dev/shm")
_SHM_HINT = " (grow it, e.g. docker run --shm-size, or lower cache.num_blocks)"


class PoolExhausted(Exception):
    pass


class PoolDoesNotFit(ConfigError):
    """The configured pool is larger than the shared memory left: one line naming both."""


class BlockPool:
    """Allocation bookkeeping shared by both backends.

    Blocks below ``_watermark`` have been handed out at least once since the last reset; the
    rest are free without being on the free list, which makes ``free_all`` O(1). With
    ``scrub_on_free``, the blocks a reset freed are zeroed ``SCRUB_SLICE_BYTES`` per call of
    ``scrub_some`` (one per loop turn), and any of them an allocation reaches first is zeroed
    by that allocation: no block is handed out unscrubbed."""

    medium = "CPU"

    def __init__(self, num_blocks: int, block_bytes: int, scrub_on_free: bool) -> None:
        # False: the owner waits for enqueued scrubs itself (see take_unsynced), so handing
        # blocks out never waits for the stream (where tier copies may run ahead of them).
        self.sync_scrubs = True
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.scrub_on_free = scrub_on_free
        self._free: list[int] = []
        self._watermark = 0
        # Blocks freed one by one but not yet zeroed; zeroed before any allocation.
        self._dirty: list[int] = []
        # The blocks a reset freed that are not zeroed yet: [_scrub_from, _dirty_below).
        self._scrub_from = 0
        self._dirty_below = 0

    @property
    def free_count(self) -> int:
        return len(self._free) + (self.num_blocks - self._watermark)

    @property
    def used_count(self) -> int:
        return self.num_blocks - self.free_count

    @property
    def scrubbing(self) -> bool:
        """Blocks a reset freed are still waiting for ``scrub_some``."""
        return self._scrub_from < self._dirty_below

    def allocate(self, count: int) -> list[int]:
        if count > self.free_count:
            raise PoolExhausted(f"need {count} blocks, {self.free_count} free")
        self._scrub_listed()
        free = self._free
        take = min(count, len(free))
        ids = free[len(free) - take :]
        del free[len(free) - take :]
        rest = count - take
        if rest:
            end = self._watermark + rest
            # New blocks come from the bottom, where the scrub after a reset started: the
            # part of them it has not reached yet is zeroed now (it would be next anyway).
            if self._scrub_from < min(end, self._dirty_below):
                self._scrub_from = self._zero_to(min(end, self._dirty_below))
            ids.extend(range(self._watermark, end))
            self._watermark = end
        self._scrub_done()
        return ids

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)
        if self.scrub_on_free:
            self._dirty.extend(block_ids)

    def free_all(self) -> None:
        """Every block free again, in O(1); the scrub is left for ``scrub_some``."""
        if self.scrub_on_free:
            # Every handed-out block lies below the watermark, every block a running scrub
            # has not reached below _dirty_below: scrubbing from 0 to the higher covers both.
            self._dirty_below = max(self._dirty_below if self.scrubbing else 0, self._watermark)
            self._scrub_from = 0
            self._dirty = []
        self._free = []
        self._watermark = 0

    def scrub_some(self, max_bytes: int) -> bool:
        """Zero (or, on the GPU, enqueue zeroing of) up to ``max_bytes`` more of the blocks a
        reset freed, and the blocks freed one by one; True once nothing is left."""
        self._scrub_listed()
        if self.scrubbing:
            blocks = max(1, max_bytes // self.block_bytes)
            self._scrub_from = self._zero_to(min(self._scrub_from + blocks, self._dirty_below))
        return not self.scrubbing

    def scrub_listed(self, block_ids: np.ndarray) -> None:
        """Zero those of ``block_ids`` still waiting for a scrub (before reading them)."""
        self._scrub_listed()
        if self.scrubbing:
            waiting = block_ids[(block_ids >= self._scrub_from) & (block_ids < self._dirty_below)]
            if waiting.size:
                self._zero_blocks(waiting)

    def _scrub_listed(self) -> None:
        if self._dirty:
            self._zero_blocks(np.asarray(self._dirty, dtype=np.int64))
            self._dirty = []

    def _zero_to(self, end: int) -> int:
        self._zero_range(self._scrub_from, end)
        return end

    def checksum_steps(self, block_ids: np.ndarray) -> Iterator[np.ndarray | None]:
        """Per-block 64-bit checksums (``kvpubd.daemon.kernels``) of the blocks as they are
        (a block still waiting for its scrub is zeroed first), one slice of ids per step:
        each step yields that slice's checksums, or None while they are still being
        computed (GPU). Take one step per loop turn."""
        raise NotImplementedError

    def _checksum_slices(self, block_ids: np.ndarray) -> Iterator[np.ndarray]:
        per_step = max(1, min(CHECKSUM_SLICE_IDS, CHECKSUM_SLICE_BYTES // self.block_bytes))
        for start in range(0, len(block_ids), per_step):
            part = block_ids[start : start + per_step]
            self.scrub_listed(part)
            yield part

    def info(self, rank: int) -> PoolInfo:
        """How another process maps this pool (the pool of ``rank``)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _zero_range(self, start: int, end: int) -> None:
        raise NotImplementedError

    def _zero_blocks(self, block_ids: np.ndarray) -> None:
        raise NotImplementedError

    def _scrub_done(self) -> None:
        """Wait until enqueued scrubs have run (before blocks are handed out)."""

    def take_unsynced(self) -> bool:
        """Whether scrubs were enqueued and not waited for since the last call (only with
        ``sync_scrubs`` off); the caller waits for them before the blocks leave the daemon."""
        return False


class HostPool(BlockPool):
    """NumPy pool in a POSIX shared memory segment, readable and writable by this user only
    (``shm_open`` mode 0600); the segment is unlinked on ``close``."""

    def __init__(
        self, num_blocks: int, block_bytes: int, scrub_on_free: bool, name: str | None = None
    ) -> None:
        super().__init__(num_blocks, block_bytes, scrub_on_free)
        name = name or f"kvpubd-{os.getpid()}-{secrets.token_hex(6)}"
        size = num_blocks * block_bytes
        what = describe_pools(1, num_blocks, block_bytes)
        if (SHM_DIR / name).exists():
            # Before the space check: a dead run's segment of this name holds space it frees.
            name = _replace_stale_segment(name)
        check_shm_space(size, what)
        # A fresh segment reads as zeros; the resource tracker unlinks it if only we are killed.
        try:
            self._shm = _create_segment(name, size)
        except FileExistsError:
            name = _replace_stale_segment(name)
            self._shm = _create_segment(name, size)
        try:
            reserve_pages(self._shm._fd, size, what)  # type: ignore[attr-defined]
        except PoolDoesNotFit:
            self._shm.close()
            self._shm.unlink()
            raise
        self.data: np.ndarray | None = np.ndarray(
            (num_blocks, block_bytes), dtype=np.uint8, buffer=self._shm.buf
        )

    def _array(self) -> np.ndarray:
        if self.data is None:
            raise RuntimeError("the pool is closed")
        return self.data

    def _zero_range(self, start: int, end: int) -> None:
        self._array()[start:end] = 0

    def _zero_blocks(self, block_ids: np.ndarray) -> None:
        # The pool's own freed ids: no checks (kernels.numpy_scrub is the checked form).
        self._array()[block_ids] = 0

    def checksum_steps(self, block_ids: np.ndarray) -> Iterator[np.ndarray | None]:
        for part in self._checksum_slices(block_ids):
            yield kernels.numpy_checksum(self._array(), part)

    def info(self, rank: int) -> PoolInfo:
        return PoolInfo(
            rank=rank,
            kind="shm",
            name=self._shm.name,
            shape=(self.num_blocks, self.block_bytes),
            dtype="uint8",
            block_bytes=self.block_bytes,
        )

    def close(self) -> None:
        if self.data is None:
            return
        self.data = None  # the buffer cannot close while an array views it
        self._shm.close()
        self._shm.unlink()


class CudaPool(BlockPool):
    """CuPy pool in one ``cudaMalloc`` allocation (so a CUDA IPC handle covers exactly it),
    with its own stream: every scrub, copy and checksum is enqueued there."""

    medium = "GPU"

    def __init__(self, num_blocks: int, block_bytes: int, scrub_on_free: bool, device: int) -> None:
        super().__init__(num_blocks, block_bytes, scrub_on_free)
        cupy = kernels._import_cupy()
        self.device = device
        self._cupy = cupy
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._memory = cupy.cuda.Memory(num_blocks * block_bytes)
            pointer = cupy.cuda.MemoryPointer(self._memory, 0)
            self.data = cupy.ndarray((num_blocks, block_bytes), dtype=cupy.uint8, memptr=pointer)
            self.kernels = kernels.KernelSet.load(self.stream)
            with self.stream:
                self.data.fill(0)
            self.stream.synchronize()
        self._unsynced = False

    def _zero_range(self, start: int, end: int) -> None:
        with self._cupy.cuda.Device(self.device), self.stream:
            self.data[start:end].fill(0)
        self._unsynced = True

    def _zero_blocks(self, block_ids: np.ndarray) -> None:
        with self._cupy.cuda.Device(self.device):
            self.kernels.scrub(self.data, block_ids)
        self._unsynced = True

    def _scrub_done(self) -> None:
        # The engine writes on its own stream: zeroing must be finished, not just enqueued,
        # before a block id leaves the daemon (here, or by the owner: take_unsynced).
        if self._unsynced and self.sync_scrubs:
            self.stream.synchronize()
            self._unsynced = False

    def take_unsynced(self) -> bool:
        unsynced, self._unsynced = self._unsynced, False
        return unsynced

    def checksum_steps(self, block_ids: np.ndarray) -> Iterator[np.ndarray | None]:
        # The same slices as the host pool; each is enqueued with its copy back to pinned
        # memory and an event, which later steps poll: no step waits for the stream.
        cuda = self._cupy.cuda
        for part in self._checksum_slices(block_ids):
            with cuda.Device(self.device):
                sums = self.kernels.checksum(self.data, part)
                pinned = cuda.alloc_pinned_memory(max(1, sums.nbytes))
                host = np.frombuffer(pinned, dtype=np.uint64, count=sums.size)
                sums.get(stream=self.stream, out=host, blocking=False)
                copied = self.stream.record()
            while not copied.done:
                yield None
            yield np.array(host)

    def info(self, rank: int) -> PoolInfo:
        handle = self._cupy.cuda.runtime.ipcGetMemHandle(self._memory.ptr)
        return PoolInfo(
            rank=rank,
            kind="cuda_ipc",
            handle=bytes(handle),
            device=self.device,
            offset=0,
            shape=(self.num_blocks, self.block_bytes),
            dtype="uint8",
            block_bytes=self.block_bytes,
        )

    def close(self) -> None:
        self.stream.synchronize()
        self.data = None
        self._memory = None


def check_shm_space(size: int, what: str, directory: Path = SHM_DIR, reclaimable: int = 0) -> None:
    """PoolDoesNotFit unless ``directory`` (a tmpfs) has ``size`` bytes free, counting
    ``reclaimable`` bytes of dead runs' segments that starting removes as free."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return  # no such filesystem here (not Linux): shm_open reports what it must
    free = stats.f_bavail * stats.f_frsize + reclaimable
    if size > free:
        raise PoolDoesNotFit(
            f"{what} does not fit in {directory}: {_mib(free)} free of "
            f"{_mib(stats.f_blocks * stats.f_frsize)}{_SHM_HINT}"
        )


# Memory each cached block costs beyond its pool bytes at full occupancy: the index, the
# published record and the token table's Python side (measured: about 380 bytes).
INDEX_BYTES_PER_BLOCK = 400


def cache_bytes(num_blocks: int, block_size: int, pool_bytes: int) -> int:
    """Memory one rank's cache takes once full: index and token table, and its pool when
    that lives in host memory (``pool_bytes``; 0 for a GPU pool)."""
    return num_blocks * (INDEX_BYTES_PER_BLOCK + 4 * block_size) + pool_bytes


def check_memory(size: int, what: str, meminfo: Path = Path("/proc/meminfo")) -> None:
    """PoolDoesNotFit unless ``size`` bytes fit in available memory and swap: a cache larger
    than the machine would be found out by the OOM killer, under load, not by a log line."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        available = int(fields["MemAvailable"].split()[0]) + int(fields["SwapFree"].split()[0])
    except (OSError, KeyError, ValueError):
        return  # not Linux: nothing to check against
    available *= 1024
    if size > available:
        raise PoolDoesNotFit(
            f"{what} needs about {_mib(size)} of memory once full: {_mib(available)} is "
            "available (lower cache.num_blocks)"
        )


def reserve_pages(fd: int, size: int, what: str, directory: Path = SHM_DIR) -> None:
    """Allocate every page of a tmpfs file now: a page the filesystem cannot give later would
    be a SIGBUS on first touch, under load, with no log line."""
    if not hasattr(os, "posix_fallocate"):  # pragma: no cover - not on macOS
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        stats = os.statvfs(directory)
        raise PoolDoesNotFit(
            f"{what} does not fit in {directory}: {exc.strerror}, "
            f"{_mib(stats.f_bavail * stats.f_frsize)} free{_SHM_HINT}"
        ) from None


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def describe_pools(ranks: int, num_blocks: int, block_bytes: int) -> str:
    """How errors name the host pool(s) of ``ranks`` ranks."""
    size = num_blocks * block_bytes
    one = f"{num_blocks} blocks of {block_bytes} bytes, {_mib(size)}"
    return f"pool ({one})" if ranks == 1 else f"{ranks} pools ({one} each)"


def _create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """A new segment ``name`` (FileExistsError if there is one). If creating fails after
    shm_open made it (the resource tracker's registration needs a pipe, so at the fd limit it
    fails last), the segment is removed rather than left in /dev/shm."""
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=size)
    except FileExistsError:
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            (SHM_DIR / name).unlink()
        raise


def _replace_stale_segment(name: str) -> str:
    """The name to create a pool under when segment ``name`` exists already. Ours: left by a
    daemon on the same control endpoint that died with its resource tracker (a kill of the
    whole process group; the caller made sure none runs), so it is removed and the name
    reused. Another user's (its name is predictable, and /dev/shm is shared): left alone, and
    a fresh random name is used instead, so that squatting the name cannot stop the start."""
    path = SHM_DIR / name
    try:
        owner = path.lstat().st_uid
    except FileNotFoundError:
        return name  # gone meanwhile
    if owner == os.getuid():
        # By path: opening it would map it, which fails for an empty or truncated segment.
        path.unlink(missing_ok=True)
        log.warning("removed stale shared memory segment %s", name)
        return name
    fresh = f"kvpubd-{os.getpid()}-{secrets.token_hex(6)}"
    log.warning(
        "shared memory segment %s belongs to uid %d, not this user: left alone, the pool is %s",
        name,
        owner,
        fresh,
    )
    return fresh


def stale_segment_bytes(names: list[str]) -> int:
    """Bytes held by segments of these names that this user owns: a dead run's, which
    starting on the same endpoint replaces (see ``_replace_stale_segment``)."""
    total = 0
    for name in names:
        try:
            stats = (SHM_DIR / name).lstat()
        except OSError:
            continue
        if stats.st_uid == os.getuid():
            total += stats.st_blocks * 512
    return total


def pool_segment_name(control_endpoint: str, rank: int) -> str:
    """The shared memory name of a daemon's rank: derived from its control endpoint (one daemon
    per endpoint), so that a restart finds and replaces what a killed run left behind."""
    digest = hashlib.sha256(control_endpoint.encode()).hexdigest()[:12]
    return f"kvpubd-{os.getuid()}-{digest}-r{rank}"


def create_pool(
    device: str,
    num_blocks: int,
    block_bytes: int,
    scrub_on_free: bool,
    rank: int = 0,
    name: str | None = None,
) -> BlockPool:
    """The pool for ``device`` ("cpu" or "cuda:N"); ``name`` names a host pool's segment."""
    if device == "cpu":
        return HostPool(num_blocks, block_bytes, scrub_on_free, name)
    return CudaPool(num_blocks, block_bytes, scrub_on_free, int(device.split(":", 1)[1]))


def cuda_device_count() -> int:
    """GPUs CuPy sees here (0 without CuPy or a driver)."""
    try:
        return int(kernels._import_cupy().cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def rank_device(config: CacheConfig, rank: int) -> str:
    """The device ``rank``'s pool lives on ("cpu" or "cuda:N"; see CacheConfig.device)."""
    uses_count = config.device == "cuda" and not config.rank_devices
    return config.device_of(rank, cuda_device_count() if uses_count else 0)


def check_device(device: str) -> None:
    """Raise ValueError with one clear line when ``device`` cannot be used here ("cuda":
    when no GPU can)."""
    if device == "cpu":
        return
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    try:
        cupy = kernels._import_cupy()
    except kernels.KernelUnavailable:
        raise ValueError(
            f"{device!r} needs CuPy: pip install 'kvpubd[gpu]' (CUDA 12) or 'kvpubd[gpu-cuda13]'"
        ) from None
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        raise ValueError(f"{device!r}: no usable CUDA driver or GPU ({exc})") from None
    if index >= count:
        raise ValueError(f"{device!r}: this machine has {count} CUDA device(s)")
