"""Block kernels: the NumPy twins' contract (everywhere), and GPU == twin (where a GPU is)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpubd.daemon.kernels import (
    KernelSet,
    KernelUnavailable,
    gpu_available,
    kernel_source,
    numpy_checksum,
    numpy_scrub,
)

MASK = (1 << 64) - 1
# The checksum's constants as the definition states them (not imported: the reference below
# must not share a typo with the implementation).
GOLDEN = 0x9E3779B97F4A7C15
SIZE_SALT = 0xD1B54A32D192ED03
HAS_GPU = gpu_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a CUDA GPU")

# Sizes around every alignment path: below a word, not a multiple of 8 or 16, several tiles
# (8 KiB each) with a ragged end, and the realistic power-of-two sizes.
BLOCK_SIZES = [1, 7, 8, 16, 24, 100, 4096 + 3, 2 * 8192 + 13, 65536]


def ref_mix64(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    return z


def ref_checksum(block: bytes) -> int:
    """The checksum of the module docstring, with plain Python ints, word by word."""
    n = len(block)
    padded = block + bytes(-n % 8)
    total = 0
    for i in range(len(padded) // 8):
        word = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        total = (total + ref_mix64(word ^ ((i * GOLDEN) & MASK))) & MASK
    return ref_mix64(total ^ ((n * SIZE_SALT) & MASK))


def random_pool(rng: np.random.Generator, num_blocks: int, block_bytes: int) -> np.ndarray:
    return rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# NumPy twins


def test_mix64_known_values() -> None:
    # SplitMix64 seeded with 0 yields mix64(GOLDEN) first; its published first output.
    assert ref_mix64(GOLDEN) == 0xE220A8397B1DCDAF
    assert ref_mix64(0) == 0


def test_checksum_known_answer_tiny_input() -> None:
    # Literals from the plain-Python reference above, which is written from the definition
    # alone (its constants included), so an error shared with the implementation cannot hide.
    expected = [0x1370176A6A711E10, 0xCE3327AA100CF11F]
    assert [ref_checksum(bytes(range(1, 11))), ref_checksum(bytes(range(11, 21)))] == expected
    # Hand-expanded for the first block: words 0x0807060504030201 and 0x0a09 (zero-padded).
    s = ref_mix64(0x0807060504030201) + ref_mix64(0x0A09 ^ GOLDEN)
    assert expected[0] == ref_mix64((s & MASK) ^ ((10 * SIZE_SALT) & MASK))
    pool = np.frombuffer(bytes(range(1, 21)), dtype=np.uint8).reshape(2, 10).copy()
    got = numpy_checksum(pool, [0, 1])
    assert got.dtype == np.uint64
    assert [int(x) for x in got] == expected
    assert int(numpy_checksum(np.zeros((1, 8), np.uint8), [0])[0]) == 0xF3E0D4D508E2660B


@pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
def test_checksum_matches_reference(block_bytes: int) -> None:
    rng = np.random.default_rng(block_bytes)
    pool = random_pool(rng, 5, block_bytes)
    ids = [4, 0, 2, 2]
    got = numpy_checksum(pool, ids)
    assert [int(x) for x in got] == [ref_checksum(pool[i].tobytes()) for i in ids]


def test_checksum_changes_with_any_single_byte() -> None:
    rng = np.random.default_rng(1)
    pool = random_pool(rng, 3, 37)
    base = numpy_checksum(pool, [1])[0]
    for pos in range(37):
        for delta in (1, 0x80, 0xFF):
            changed = pool.copy()
            changed[1, pos] ^= np.uint8(delta)
            assert numpy_checksum(changed, [1])[0] != base, (pos, delta)
            # Other blocks are untouched, and so are their checksums.
            assert np.array_equal(numpy_checksum(changed, [0, 2]), numpy_checksum(pool, [0, 2]))


def test_checksum_is_per_block_and_content_addressed() -> None:
    rng = np.random.default_rng(2)
    pool = random_pool(rng, 6, 100)
    pool[4] = pool[1]
    sums = numpy_checksum(pool, range(6))
    assert sums[4] == sums[1]
    assert len(set(sums.tolist())) == 5
    # Computed alone or amid others, in any order, a block's checksum is the same.
    assert numpy_checksum(pool, [3])[0] == sums[3]
    assert np.array_equal(numpy_checksum(pool, [5, 3, 1]), sums[[5, 3, 1]])
    # Same content in another pool with other neighbours: same checksum.
    other = random_pool(rng, 2, 100)
    other[1] = pool[2]
    assert numpy_checksum(other, [1])[0] == sums[2]
    # Chunked evaluation (one block per chunk) gives the same answers.
    assert np.array_equal(numpy_checksum(pool, range(6), chunk_bytes=1), sums)


def test_checksum_zero_padding_does_not_collide() -> None:
    sizes = [1, 7, 8, 9, 15, 16, 24, 32]
    sums = [int(numpy_checksum(np.zeros((1, n), np.uint8), [0])[0]) for n in sizes]
    assert len(set(sums)) == len(sizes)
    assert sums[sizes.index(8)] == ref_checksum(bytes(8))
    assert sums[sizes.index(16)] == ref_checksum(bytes(16))
    # A trailing zero byte is not the same as a shorter block.
    a = np.array([[1, 2, 3]], np.uint8)
    b = np.array([[1, 2, 3, 0]], np.uint8)
    assert numpy_checksum(a, [0])[0] != numpy_checksum(b, [0])[0]


def test_checksum_depends_on_word_position() -> None:
    pool = np.zeros((2, 16), np.uint8)
    pool[0, :8] = 7  # same word, at index 0 ...
    pool[1, 8:] = 7  # ... and at index 1
    a, b = numpy_checksum(pool, [0, 1])
    assert a != b


def test_checksum_empty_list() -> None:
    out = numpy_checksum(np.zeros((3, 8), np.uint8), [])
    assert out.dtype == np.uint64 and out.shape == (0,)


def test_scrub_zeroes_exactly_the_listed_blocks() -> None:
    rng = np.random.default_rng(3)
    pool = random_pool(rng, 10, 24)
    pool[pool == 0] = 1  # so that "untouched" and "zeroed" can't be confused
    before = pool.copy()
    numpy_scrub(pool, [7, 2, 2, 9])
    for i in range(10):
        if i in (2, 7, 9):
            assert not pool[i].any()
        else:
            assert np.array_equal(pool[i], before[i])
    numpy_scrub(pool, [])
    numpy_scrub(pool, np.array([], dtype=np.int64))


def test_ids_are_checked() -> None:
    pool = np.zeros((4, 4), np.uint8)
    with pytest.raises(ValueError, match="out of range"):
        numpy_scrub(pool, [4])
    with pytest.raises(ValueError, match="out of range"):
        numpy_checksum(pool, [0, -1])
    with pytest.raises(ValueError, match="integers"):
        numpy_scrub(pool, [0.5])
    with pytest.raises(ValueError, match="2-D"):
        numpy_scrub(np.zeros(16, np.uint8), [0])


def test_kernel_source_ships_with_the_package() -> None:
    src = kernel_source()
    assert 'extern "C"' in src
    for name in ("kv_scrub", "kv_checksum_partial", "kv_checksum_final"):
        assert name in src


@pytest.mark.skipif(HAS_GPU, reason="only where no GPU is usable")
def test_load_without_gpu_raises_clearly() -> None:
    with pytest.raises(KernelUnavailable):
        KernelSet.load()


# ---------------------------------------------------------------------------------------------
# GPU kernels against their twins


@pytest.fixture(scope="module")
def gpu() -> Iterator[tuple[Any, KernelSet]]:
    """CuPy and the kernels on a non-blocking stream; every test makes that stream current, so
    its set-up, the kernels and the read-back are ordered on the one stream."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    ks = KernelSet.load(stream)
    with stream:
        yield cupy, ks
    stream.synchronize()


def _device_pool(cp: Any, host: np.ndarray, offset: int) -> Any:
    """A device copy of ``host`` whose first byte sits ``offset`` bytes past a 256-byte
    boundary, to exercise every alignment path."""
    num_blocks, block_bytes = host.shape
    raw = cp.zeros(num_blocks * block_bytes + offset, dtype=cp.uint8)
    pool = raw[offset:].reshape(num_blocks, block_bytes)
    pool.set(host)
    return pool


def _id_cases(rng: np.random.Generator, num_blocks: int) -> list[np.ndarray]:
    cases = [np.zeros(0, np.int64), np.array([num_blocks - 1]), np.arange(num_blocks)]
    cases.append(rng.integers(0, num_blocks, size=2 * num_blocks + 3))  # repeats allowed
    cases.append(rng.permutation(num_blocks)[: max(1, num_blocks // 2)])
    return cases


@needs_gpu
@pytest.mark.parametrize("block_bytes", [*BLOCK_SIZES, 100_003])
@pytest.mark.parametrize("offset", [0, 8, 4, 3])
def test_gpu_checksum_equals_twin(
    gpu: tuple[Any, KernelSet], block_bytes: int, offset: int
) -> None:
    cp, ks = gpu
    rng = np.random.default_rng(block_bytes * 7 + offset)
    num_blocks = max(1, min(37, (4 << 20) // block_bytes))
    host = random_pool(rng, num_blocks, block_bytes)
    pool = _device_pool(cp, host, offset)
    for ids in _id_cases(rng, num_blocks):
        want = numpy_checksum(host, ids)
        got = ks.checksum(pool, ids).get(stream=ks.stream)
        ks.stream.synchronize()
        assert got.dtype == np.uint64
        assert np.array_equal(got, want), (block_bytes, offset, ids[:8])
        # Device id lists give the same answer.
        with ks.stream:
            dev_ids = cp.asarray(ids)
        got2 = ks.checksum(pool, dev_ids).get(stream=ks.stream)
        ks.stream.synchronize()
        assert np.array_equal(got2, want)


@needs_gpu
@pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
@pytest.mark.parametrize("offset", [0, 8, 4, 3])
def test_gpu_scrub_equals_twin(gpu: tuple[Any, KernelSet], block_bytes: int, offset: int) -> None:
    cp, ks = gpu
    rng = np.random.default_rng(block_bytes * 11 + offset)
    num_blocks = max(1, min(29, (4 << 20) // block_bytes))
    for ids in _id_cases(rng, num_blocks):
        host = random_pool(rng, num_blocks, block_bytes)
        host[host == 0] = 1
        raw_len = num_blocks * block_bytes + offset + 64
        guard = cp.full(raw_len, 0xAB, dtype=cp.uint8)
        pool = guard[offset : offset + num_blocks * block_bytes].reshape(num_blocks, block_bytes)
        pool.set(host)
        ks.scrub(pool, ids)
        numpy_scrub(host, ids)
        got = pool.get(stream=ks.stream)
        ks.stream.synchronize()
        assert np.array_equal(got, host), (block_bytes, offset)
        # Nothing outside the pool was written.
        outside = cp.concatenate([guard[:offset], guard[offset + num_blocks * block_bytes :]])
        assert bool((outside == 0xAB).all())


@needs_gpu
def test_gpu_single_block_pool(gpu: tuple[Any, KernelSet]) -> None:
    cp, ks = gpu
    rng = np.random.default_rng(6)
    host = random_pool(rng, 1, 65536 + 5)
    pool = cp.asarray(host)
    got = ks.checksum(pool, [0]).get(stream=ks.stream)
    assert np.array_equal(got, numpy_checksum(host, [0]))
    ks.scrub(pool, [0])
    assert not bool(pool.any())


@needs_gpu
def test_gpu_wrappers_validate(gpu: tuple[Any, KernelSet]) -> None:
    cp, ks = gpu
    with ks.stream:
        pool = cp.zeros((8, 32), dtype=cp.uint8)
    with pytest.raises(ValueError, match="out of range"):
        ks.scrub(pool, [8])
    with pytest.raises(ValueError, match="out of range"):
        ks.checksum(pool, cp.asarray([0, 9]))
    with pytest.raises(ValueError, match="2-D"):
        ks.scrub(pool.reshape(-1), [0])
    assert ks.checksum(pool, []).size == 0


@needs_gpu
@pytest.mark.parametrize(
    ("tile_bytes", "unroll", "streaming"),
    [(16, 1, False), (48, 2, True), (512, 1, False), (32768, 8, False), (8192, 4, True)],
)
def test_gpu_tuning_knobs_do_not_change_results(
    gpu: tuple[Any, KernelSet], tile_bytes: int, unroll: int, streaming: bool
) -> None:
    """Other builds cut blocks into other tiles (many warps per block: their sums meet through
    atomics); the results must be the same."""
    cp, base = gpu
    ks = KernelSet.load(base.stream, tile_bytes=tile_bytes, unroll=unroll, streaming=streaming)
    rng = np.random.default_rng(tile_bytes)
    for block_bytes in (7, 100, 4099, 65536 + 8):
        for offset in (0, 8, 3):
            num_blocks = 9
            host = random_pool(rng, num_blocks, block_bytes)
            pool = _device_pool(cp, host, offset)
            ids = rng.integers(0, num_blocks, size=12)
            got = ks.checksum(pool, ids).get(stream=ks.stream)
            assert np.array_equal(got, numpy_checksum(host, ids)), (block_bytes, offset)
            ks.scrub(pool, [1, 6])
            numpy_scrub(host, [1, 6])
            assert np.array_equal(pool.get(stream=ks.stream), host), (block_bytes, offset)


def test_bench_table_renders() -> None:
    from rich.console import Console

    from kvpubd.tools.bench_kernels import format_table

    row = {
        "block_bytes": 65536,
        "num_blocks": 4,
        "impl": "kvpubd[tile=8192]",
        "op": "scrub",
        "what": "pool[ids] = 0",
        "bytes": 1 << 30,
        "ms_median": 0.25,
        "ms_min": 0.24,
        "gbs": 4295.0,
        "pct_of_device": 99.0,
    }
    result = {
        "device": "Fake GPU",
        "pool_gib": 1.0,
        "bandwidth": {"gbs": 4338.0},
        "target_pct": 85.0,
        "rows": [row, {**row, "impl": "cupy", "pct_of_device": 50.0}],
        "checks": {"scrub_65536": True},
    }
    console = Console(width=200, record=True)
    console.print(format_table(result))
    text = console.export_text()
    assert "Fake GPU" in text and "64 KiB" in text and "99.0" in text and "all passed" in text
    assert "kvpubd[tile=8192]" in text and "pool[ids] = 0" in text  # not eaten as markup
