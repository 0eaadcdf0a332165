"""Tier copies between the primary pool and a host tier: NumPy everywhere, CUDA where a GPU is."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpubd.daemon import tier_copy
from kvpubd.daemon.kernels import gpu_available
from kvpubd.daemon.pool import CudaPool, HostPool

HAS_GPU = gpu_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a CUDA GPU")

# Scattered ids with a run where both sides are consecutive (7, 8, 9 -> 2, 3, 4), a run
# consecutive on one side only (20, 21 -> 9, 0), and the last block and slot.
BLOCK_IDS = np.array([13, 7, 8, 9, 20, 21, 0, 31], dtype=np.int64)
SLOTS = np.array([5, 2, 3, 4, 9, 0, 7, 11], dtype=np.int64)
PRIMARY_BLOCKS = 32
HOST_SLOTS = 12


MakeHostTier = Callable[[int], HostPool]


@pytest.fixture
def host_tier() -> Iterator[MakeHostTier]:
    pools: list[HostPool] = []

    def make(block_bytes: int) -> HostPool:
        pool = HostPool(HOST_SLOTS, block_bytes, scrub_on_free=False)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def _random_bytes(shape: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _round_trip(
    copier: tier_copy.TierCopier,
    write_primary: Callable[[np.ndarray], None],
    read_primary: Callable[[], np.ndarray],
    host: HostPool,
    shape: tuple[int, int],
) -> None:
    """Demote, check the tier, scribble over the primary, promote, check the primary."""
    assert host.data is not None
    original = _random_bytes(shape, 1)
    write_primary(original)
    host_before = _random_bytes(host.data.shape, 2)
    host.data[...] = host_before

    copier.demote(BLOCK_IDS, SLOTS)
    _wait(copier)
    expected_host = host_before.copy()
    expected_host[SLOTS] = original[BLOCK_IDS]
    assert np.array_equal(host.data, expected_host)  # listed slots copied, the others untouched

    scribbled = np.full(shape, 0x5A, dtype=np.uint8)
    write_primary(scribbled)
    copier.promote(SLOTS, BLOCK_IDS)
    _wait(copier)
    expected_primary = scribbled.copy()
    expected_primary[BLOCK_IDS] = original[BLOCK_IDS]
    assert np.array_equal(read_primary(), expected_primary)


def _wait(copier: tier_copy.TierCopier) -> None:
    fence = copier.fence()
    stream = getattr(copier, "stream", None)
    if stream is not None:
        stream.synchronize()
    assert fence.done


# -- NumPy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_bytes", [100, 4096, 64 << 10])
def test_numpy_round_trip_moves_the_listed_blocks_only(
    host_tier: MakeHostTier, block_bytes: int
) -> None:
    primary = HostPool(PRIMARY_BLOCKS, block_bytes, scrub_on_free=False)
    host = host_tier(block_bytes)
    copier = tier_copy.create_copier(primary, host)
    try:
        assert isinstance(copier, tier_copy.NumpyCopier)
        assert copier.fence().done  # synchronous copies: nothing outstanding

        def write(values: np.ndarray) -> None:
            assert primary.data is not None
            primary.data[...] = values

        def read() -> np.ndarray:
            assert primary.data is not None
            return np.array(primary.data)

        _round_trip(copier, write, read, host, (PRIMARY_BLOCKS, block_bytes))
    finally:
        copier.close()
        primary.close()


def test_ids_out_of_range_or_unpaired_are_refused(host_tier: MakeHostTier) -> None:
    primary = HostPool(PRIMARY_BLOCKS, 64, scrub_on_free=False)
    host = host_tier(64)
    copier = tier_copy.create_copier(primary, host)
    try:
        with pytest.raises(ValueError, match="out of range"):
            copier.demote(np.array([PRIMARY_BLOCKS]), np.array([0]))
        with pytest.raises(ValueError, match="out of range"):
            copier.demote(np.array([0]), np.array([HOST_SLOTS]))
        with pytest.raises(ValueError, match="out of range"):
            copier.promote(np.array([-1]), np.array([0]))
        with pytest.raises(ValueError, match="sources"):
            copier.promote(np.array([0, 1]), np.array([0]))
    finally:
        primary.close()


def test_the_host_tier_must_have_the_primary_block_size(host_tier: MakeHostTier) -> None:
    primary = HostPool(PRIMARY_BLOCKS, 64, scrub_on_free=False)
    try:
        with pytest.raises(ValueError, match="128 bytes, primary blocks 64"):
            tier_copy.create_copier(primary, host_tier(128))
    finally:
        primary.close()


def test_runs_join_ids_consecutive_on_both_sides_only() -> None:
    starts, lengths = tier_copy._runs(SLOTS, BLOCK_IDS)
    assert starts.tolist() == [0, 1, 4, 5, 6, 7]
    assert lengths.tolist() == [1, 3, 1, 1, 1, 1]
    empty = np.zeros(0, np.int64)
    assert [a.size for a in tier_copy._runs(empty, empty)] == [0, 0]


# -- CUDA --------------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize(
    ("method", "block_bytes"),
    [
        ("auto", 4096),
        ("auto", 100),  # not a multiple of 16: the copy engines
        ("auto", 2 << 20),
        ("kernel", 4096),
        ("kernel", 16 * 257 * 4),  # chunks of 16 KiB and a short last one
        ("memcpy", 4096),
        ("batch", 4096),
    ],
)
def test_cuda_round_trip_moves_the_listed_blocks_only(
    host_tier: MakeHostTier, method: tier_copy.CopyMethod, block_bytes: int
) -> None:
    import cupy

    primary = CudaPool(PRIMARY_BLOCKS, block_bytes, scrub_on_free=False, device=0)
    host = host_tier(block_bytes)
    try:
        copier = tier_copy.CudaCopier(primary, host, method)
    except RuntimeError as exc:
        if method == "batch":
            pytest.skip(str(exc))
        raise
    try:

        def write(values: np.ndarray) -> None:
            primary.data[...] = cupy.asarray(values)
            cupy.cuda.get_current_stream().synchronize()

        def read() -> np.ndarray:
            return np.asarray(primary.data.get())

        _round_trip(copier, write, read, host, (PRIMARY_BLOCKS, block_bytes))
    finally:
        copier.close()
        primary.close()


_SPIN = r"""
extern "C" __global__ void spin_until_set(const volatile int* flag) {
    while (*flag == 0) {}
}
"""


@needs_gpu
def test_cuda_fence_is_done_only_once_the_copies_before_it_are(host_tier: MakeHostTier) -> None:
    """The pool's stream is held by a kernel spinning on a host flag: a demote enqueued
    behind it has not run, so its fence is not done; once the flag is set, both are."""
    import cupy

    block_bytes = 4096
    primary = CudaPool(PRIMARY_BLOCKS, block_bytes, scrub_on_free=False, device=0)
    host = host_tier(block_bytes)
    copier = tier_copy.create_copier(primary, host)
    pinned = cupy.cuda.alloc_pinned_memory(4)
    flag = np.frombuffer(pinned, dtype=np.int32, count=1)
    flag[0] = 0
    try:
        assert isinstance(copier, tier_copy.CudaCopier)
        with primary.stream:
            primary.data.fill(7)
        spin = cupy.RawKernel(_SPIN, "spin_until_set")
        with primary.stream:
            spin((1,), (1,), (np.uint64(flag.ctypes.data),))
        copier.demote(BLOCK_IDS, SLOTS)
        fence = copier.fence()
        assert not fence.done
        assert host.data is not None and not host.data[SLOTS].any()
        flag[0] = 1
        primary.stream.synchronize()
        assert fence.done
        assert (host.data[SLOTS] == 7).all()
    finally:
        flag[0] = 1  # never leave the kernel spinning
        copier.close()
        primary.close()
