"""The pool work a request or a reset leaves behind is done a slice per loop turn, so a reset
is never held back behind it: the scrub of the blocks a reset freed (issue item 5) and a
``checksum`` of the pool (item 4). Each test counts loop turns and slices, never time; the
scrub's wait after a reset (so that the marker leaves first) is off but where it is tested."""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvpubd.daemon.control_server import Reply
from kvpubd.daemon.kernels import numpy_checksum
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.pool import CHECKSUM_SLICE_BYTES, SCRUB_SLICE_BYTES, HostPool
from kvpubd.daemon.service import Service
from tests.loop_turns import settled, started_service, turns_until

BLOCK_BYTES = 64 << 10  # the default cache's block (2 layers, 8 heads, 64 dims, 16 tokens)
NUM_BLOCKS = 256  # 16 MiB: several scrub slices
BLOCK_SIZE = 16


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    async with started_service(tmp_path, cache={"num_blocks": NUM_BLOCKS}) as started:
        assert started.settings.cache.block_bytes == BLOCK_BYTES
        started.pipelines[0].scrub_delay_s = 0
        yield started


def send(service: Service, op: str, **fields: Any) -> Reply:
    assert service.control is not None
    frames = [b"peer", b"", msgpack.packb({"op": op, "id": op, **fields}, use_bin_type=True)]
    reply = service.control.handle_frames(frames)
    assert reply is not None
    return reply


def answer(reply: Reply) -> dict[str, Any]:
    assert isinstance(reply, bytes), reply
    decoded: dict[str, Any] = msgpack.unpackb(reply, raw=False)
    assert decoded["ok"], decoded
    return decoded


def pool_data(service: Service) -> np.ndarray:
    pool = service.pipelines[0].cache.pool
    assert isinstance(pool, HostPool)
    data = pool.data
    assert isinstance(data, np.ndarray)
    return data


def fill_pool(service: Service) -> None:
    """Every block handed out, then written to as an engine would."""
    tokens = np.arange(NUM_BLOCKS * BLOCK_SIZE, dtype="<u4").tobytes()
    answer(send(service, "store", request_id="all", token_ids=tokens))
    answer(send(service, "release", request_id="all"))
    pool_data(service)[:] = 0xAB


def dirty_blocks(service: Service) -> int:
    return int(np.count_nonzero(pool_data(service).any(axis=1)))


async def test_scrub_after_a_reset_takes_a_slice_per_loop_turn(service: Service) -> None:
    fill_pool(service)
    answer(send(service, "reset"))
    per_turn = SCRUB_SLICE_BYTES // BLOCK_BYTES
    assert dirty_blocks(service) == NUM_BLOCKS  # the reset step itself zeroed nothing
    counts = [dirty_blocks(service)]
    while counts[-1]:
        await asyncio.sleep(0)
        counts.append(dirty_blocks(service))
        assert len(counts) < 10 * NUM_BLOCKS, "the scrub never finished"
    assert all(before - after <= per_turn for before, after in itertools.pairwise(counts))
    assert len(counts) > NUM_BLOCKS // per_turn


async def test_the_scrub_starts_once_the_reset_has_had_its_quiet_time(service: Service) -> None:
    """Work started right after a marker delays its delivery (see reaper.QUIET_AFTER_RESET_S):
    the scrub zeroes nothing until its delay has passed, then everything."""
    delay_s = 0.3
    service.pipelines[0].scrub_delay_s = delay_s
    fill_pool(service)
    reset_at = time.monotonic()
    answer(send(service, "reset"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert dirty_blocks(service) == NUM_BLOCKS
    counts = [NUM_BLOCKS]
    while counts[-1]:
        await asyncio.sleep(0.01)
        counts.append(dirty_blocks(service))
        assert len(counts) < 1000, "the scrub never finished"
    # asyncio.sleep never wakes early: the first block was zeroed after the delay.
    assert time.monotonic() - reset_at >= delay_s


async def test_a_reset_during_the_scrub_is_one_step_and_the_scrub_still_covers_all(
    service: Service,
) -> None:
    fill_pool(service)
    answer(send(service, "reset"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    left = dirty_blocks(service)
    assert 0 < left < NUM_BLOCKS
    answer(send(service, "reset", id="again"))
    assert dirty_blocks(service) == left  # the second reset zeroed nothing itself
    await turns_until(lambda: dirty_blocks(service) == 0)


async def test_no_block_is_handed_out_before_it_is_scrubbed(service: Service) -> None:
    """A store right behind the reset gets blocks the sliced scrub has not reached: they are
    zero when handed out; the rest are scrubbed later."""
    fill_pool(service)
    answer(send(service, "reset"))
    tokens = np.arange(100, 100 + 64 * BLOCK_SIZE, dtype="<u4").tobytes()
    stored = answer(send(service, "store", request_id="next", token_ids=tokens))
    block_ids = stored["block_ids"]
    assert len(block_ids) == 64
    assert not pool_data(service)[block_ids].any()
    assert dirty_blocks(service) == NUM_BLOCKS - 64
    await turns_until(lambda: dirty_blocks(service) == 0)


def test_scrub_some_bounds_the_bytes_it_zeroes() -> None:
    pool = HostPool(32, 4096, scrub_on_free=True)
    try:
        pool.allocate(32)
        assert pool.data is not None
        pool.data[:] = 1
        pool.free_all()
        calls = 1
        while not pool.scrub_some(3 * 4096):
            calls += 1
        assert calls == 11  # 32 blocks, 3 per call
        assert not pool.data.any()
    finally:
        pool.close()


async def test_checksum_of_the_pool_is_sliced_and_a_reset_goes_first(service: Service) -> None:
    fill_pool(service)
    data = pool_data(service)
    data[:] = np.random.default_rng(0).integers(0, 256, size=data.shape, dtype=np.uint8)
    block_ids = [*range(NUM_BLOCKS - 1, 7, -1), *[9] * 7, 0]  # ids may repeat
    expected = numpy_checksum(data, block_ids).tolist()
    reply = send(service, "checksum", block_ids=block_ids)
    assert isinstance(reply, Pending), "the checksum was computed in the request's step"
    replies: list[bytes] = []
    reply.then(lambda value, error: replies.append(bytes(value)) if value else None)
    turns = await turns_until(lambda: bool(replies))
    slices = len(block_ids) * BLOCK_BYTES // CHECKSUM_SLICE_BYTES
    assert turns >= slices
    assert answer(replies[0])["checksums"] == expected

    # A reset sent behind a checksum is answered while the checksum is under way; blocks
    # the reset freed read as zeros then.
    replies.clear()
    reply = send(service, "checksum", block_ids=block_ids)
    assert isinstance(reply, Pending)
    reply.then(lambda value, error: replies.append(bytes(value)) if value else None)
    for _ in range(6):  # the ids decoded, then the first slice checksummed, each in its turn
        await asyncio.sleep(0)
    answer(send(service, "reset"))
    assert not replies
    await turns_until(lambda: bool(replies))
    checksums = answer(replies[0])["checksums"]
    zero = int(numpy_checksum(np.zeros((1, BLOCK_BYTES), np.uint8), [0])[0])
    assert checksums[:1] == expected[:1]  # the slice before the reset
    assert checksums[-1] == zero  # block 0, after it


@pytest.mark.parametrize(
    ("block_ids", "item"),
    [
        ([NUM_BLOCKS], "block_ids.0"),
        ([1, 2, -1], "block_ids.2"),
        ([3, True], "block_ids.1"),
        (b"\x00\x01", "block_ids: expected a list of integers"),
    ],
)
async def test_checksum_errors_name_the_field(service: Service, block_ids: Any, item: str) -> None:
    error = (await settled(send(service, "checksum", block_ids=block_ids)))["error"]
    assert error["code"] == "bad_request" and item in error["message"], error


async def test_a_checksum_under_way_is_answered_whatever_the_garbage_collector_does(
    service: Service,
) -> None:
    """Nothing outside the daemon holds a checksum's job (the client's reply comes from its
    done callback), and the loop holds tasks only weakly: were the job collectable while it
    waits for its next slice, its reply would never come (two checksums unanswered in a
    180 s soak)."""
    fill_pool(service)
    reply = send(service, "checksum", block_ids=list(range(NUM_BLOCKS)))
    assert isinstance(reply, Pending)
    replies: list[bytes] = []
    reply.then(lambda value, error: replies.append(bytes(value)) if value else None)

    def collected_then_answered() -> bool:
        gc.collect()
        return bool(replies)

    await turns_until(collected_then_answered, limit=1000)
    assert len(answer(replies[0])["checksums"]) == NUM_BLOCKS
