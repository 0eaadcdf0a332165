"""Work for clients' requests done a slice per loop turn takes turns (kvpubd.daemon.turns):
one slice in all per turn however many requests are under way, so the turn a reset arrives in
does not grow with them."""

from __future__ import annotations

import asyncio
import gc

import msgpack
import msgspec
import numpy as np

from kvpubd.daemon.decoding import decode_in_slices
from kvpubd.protocol.int_arrays import DECODE_SLICE, IntArray, IntArrayDecoder, located

JOBS = 4
ITEMS = 3 * DECODE_SLICE


def id_list(count: int) -> IntArrayDecoder:
    array = located(msgspec.Raw(msgpack.packb(list(range(count)))))
    assert isinstance(array, IntArray)
    return array.decoder("block_ids", 0, count)


async def test_concurrent_requests_decode_one_slice_per_loop_turn_in_all() -> None:
    """Four requests' id lists decoded at once: each loop turn decodes one slice of one of
    them, round robin, and every list comes out whole. With a slice per request per turn,
    a turn decoded four."""
    loop = asyncio.get_running_loop()
    decoders = [id_list(ITEMS) for _ in range(JOBS)]
    per_turn: list[int] = []
    last = 0

    def tick() -> None:  # once per loop turn: what was decoded since the last
        nonlocal last
        now = sum(d.decoded for d in decoders)
        per_turn.append(now - last)
        last = now
        if now < JOBS * ITEMS:
            loop.call_soon(tick)

    loop.call_soon(tick)
    results = await asyncio.gather(*(decode_in_slices(d) for d in decoders))
    assert all(np.array_equal(r, np.arange(ITEMS)) for r in results)
    assert sum(per_turn) == JOBS * ITEMS
    assert max(per_turn) == DECODE_SLICE


async def test_a_cancelled_request_leaves_its_turn_to_the_others() -> None:
    decoders = [id_list(ITEMS) for _ in range(2)]
    gone = asyncio.ensure_future(decode_in_slices(decoders[0]))
    kept = asyncio.ensure_future(decode_in_slices(decoders[1]))
    await asyncio.sleep(0)
    gone.cancel()
    assert np.array_equal(await kept, np.arange(ITEMS))
    assert gone.cancelled()


async def test_a_request_alone_decodes_a_slice_every_loop_turn() -> None:
    """Taking turns costs a request alone nothing: it is let go again in the turn it does its
    slice, so it does one every turn (it did one every second turn)."""
    loop = asyncio.get_running_loop()
    decoder = id_list(ITEMS)
    per_turn: list[int] = []
    last = 0

    def tick() -> None:
        nonlocal last
        per_turn.append(decoder.decoded - last)
        last = decoder.decoded
        if last < ITEMS:
            loop.call_soon(tick)

    loop.call_soon(tick)
    result = await decode_in_slices(decoder)
    assert np.array_equal(result, np.arange(ITEMS))
    # From its first slice on (the last one is done in the turn it returns, after the tick).
    working = per_turn[per_turn.index(DECODE_SLICE) :]
    assert working == [DECODE_SLICE] * (ITEMS // DECODE_SLICE - 1)


async def test_a_request_nothing_else_holds_is_not_collected_while_it_waits_for_its_turn() -> None:
    """A request's job is a task the loop holds only weakly; while it waits for its turn, its
    future is all that holds it (the daemon keeps no other reference: its reply comes from the
    task's done callback). Futures held weakly here let the garbage collector take the task
    and its reply with it: checksums never answered in the soak."""
    decoded: list[np.ndarray] = []

    async def job() -> None:
        decoded.append(await decode_in_slices(id_list(ITEMS)))

    # No reference kept, on purpose: while it waits, what turns holds must keep it alive.
    asyncio.ensure_future(job())  # noqa: RUF006
    turns = ITEMS // DECODE_SLICE + 2
    await asyncio.sleep(0)  # one loop turn: the job starts and waits for its turn
    gc.collect()
    for _ in range(turns):  # loop turns, counted: a slice per turn, then the result
        await asyncio.sleep(0)
        if decoded:
            break
    assert len(decoded) == 1 and np.array_equal(decoded[0], np.arange(ITEMS))
