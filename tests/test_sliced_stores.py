"""No store or release holds the loop, however large, and no flood of small ones does either
(field-defect issue items 3, 6 and 11). Counted per loop turn on the service in this process:
a cached store's prefix is matched and pinned, a release unpinned, a new store captured and
published, a slice per turn; queued small stores run a budget per turn; a reset in the middle of
each leaves cache, pins and the published stream consistent. Open requests are bounded per
rank, and stats never walk them."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvpubd.daemon.cache import Lease
from kvpubd.daemon.encoded import EncodedArray, reply_ids
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.pipeline import FLUSH_BLOCKS
from kvpubd.daemon.stores import MAX_QUEUED, REQUEST_UNITS, SLICE_BLOCKS, SYNC_BLOCKS, TURN_UNITS
from kvpubd.protocol.control import StoreReply, ok_reply
from kvpubd.protocol.wire import AllBlocksCleared, BlockStored
from tests.inprocess import InProcess, in_process
from tests.streams import BLOCK_SIZE, packed_prompt, prompt

LARGE = 4 * SYNC_BLOCKS  # full blocks of a store that takes many loop turns


def steps(samples: list[int]) -> list[int]:
    """How much each loop turn changed the sampled value."""
    return [abs(after - before) for before, after in pairwise(samples)]


def pending(reply: bytes | Pending[Any]) -> Pending[Any]:
    assert isinstance(reply, Pending), "answered at once: the work ran in one step"
    return reply


async def stats(daemon: InProcess) -> dict[str, Any]:
    reply = await daemon.call("stats")
    rank: dict[str, Any] = reply["ranks"][0]
    return rank


async def stored_and_released(daemon: InProcess, tokens: bytes) -> None:
    assert (await daemon.call("store", request_id="first", token_ids=tokens))["ok"]
    assert (await daemon.call("release", request_id="first"))["ok"]
    await daemon.turns_until(lambda: daemon.cache.pinned_blocks == 0)  # unpinned in slices


# -- item 3: the steps of a large store or release, a slice per loop turn ---------------------


async def test_a_cached_store_matches_and_pins_its_prefix_a_slice_per_turn(
    tmp_path: Path,
) -> None:
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        tokens = packed_prompt(LARGE, 1)
        await stored_and_released(daemon, tokens)
        cache = daemon.cache
        reply = pending(daemon.send("store", request_id="again", token_ids=tokens))
        pinned = await daemon.per_turn(lambda: cache.pinned_blocks, lambda: reply.done)
        answer = await daemon.answer(reply)
        assert answer["num_cached_tokens"] == LARGE * BLOCK_SIZE
        assert answer["block_ids"] == cache.leases["again"].blocks
        assert pinned[-1] == LARGE
        assert max(steps(pinned)) <= SLICE_BLOCKS, max(steps(pinned))


async def test_a_cached_store_looks_its_prefix_up_a_slice_per_turn(tmp_path: Path) -> None:
    """The prefix match itself (a dict lookup per block) is sliced too: counted by a spy that
    passes every lookup on to the real index."""
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        tokens = packed_prompt(LARGE, 10)
        await stored_and_released(daemon, tokens)
        index = daemon.cache.index
        match = index.match
        looked_up = [0]

        def counted(digests: list[bytes]) -> list[int]:
            looked_up[0] += len(digests)
            return match(digests)

        index.match = counted  # type: ignore[method-assign]
        reply = pending(daemon.send("store", request_id="again", token_ids=tokens))
        lookups = await daemon.per_turn(lambda: looked_up[0], lambda: reply.done)
        assert (await daemon.answer(reply))["num_cached_tokens"] == LARGE * BLOCK_SIZE
        assert lookups[-1] == LARGE
        assert max(steps(lookups)) <= SLICE_BLOCKS, max(steps(lookups))


async def test_a_large_release_unpins_a_slice_per_turn(tmp_path: Path) -> None:
    """The request is closed and answered at once; its blocks are unpinned a slice per turn."""
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        assert (await daemon.call("store", request_id="r", token_ids=packed_prompt(LARGE, 2)))["ok"]
        cache = daemon.cache
        before = cache.pinned_blocks
        reply = daemon.send("release", request_id="r")
        pinned = [before] + await daemon.per_turn(
            lambda: cache.pinned_blocks, lambda: cache.pinned_blocks == 0
        )
        assert pinned[0] == LARGE
        assert max(steps(pinned)) <= SLICE_BLOCKS, max(steps(pinned))
        assert (await daemon.answer(reply))["released"] == LARGE
        rank = await stats(daemon)
        assert (rank["blocks_pinned"], rank["blocks_cached"], rank["requests_open"]) == (
            0,
            LARGE,
            0,
        )


async def test_a_new_store_is_captured_and_published_a_slice_at_a_time(tmp_path: Path) -> None:
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        sink = daemon.pipeline.sink
        reply = pending(daemon.send("store", request_id="r", token_ids=packed_prompt(LARGE, 3)))
        captured = await daemon.per_turn(lambda: len(sink.published), lambda: reply.done)
        answer = await daemon.answer(reply)
        assert answer["block_ids"] == daemon.cache.leases["r"].blocks
        assert len(answer["block_ids"]) == LARGE and captured[-1] == LARGE
        assert max(steps(captured)) <= SLICE_BLOCKS, max(steps(captured))
        assert len(await daemon.mirror()) == LARGE
        batch_blocks = [
            sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
            for _, events in daemon.history
        ]
        assert max(batch_blocks) <= FLUSH_BLOCKS + SLICE_BLOCKS, batch_blocks


# -- item 3: a reset in the middle of each sliced step ----------------------------------------


async def test_a_reset_while_a_cached_store_pins_its_prefix(tmp_path: Path) -> None:
    """The reset is answered and published while the store is under way; the store then
    lands on the emptied cache (nothing cached any more), and its reply names its blocks."""
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        tokens = packed_prompt(LARGE, 4)
        await stored_and_released(daemon, tokens)
        cache = daemon.cache
        reply = pending(daemon.send("store", request_id="again", token_ids=tokens))
        await daemon.turns_until(lambda: cache.pinned_blocks > 0)
        assert cache.pinned_blocks < LARGE and not reply.done, "not in the middle of pinning"
        assert (await daemon.call("reset"))["ok"]
        assert not reply.done
        answer = await daemon.answer(reply)
        assert answer["ok"] and answer["num_cached_tokens"] == 0
        assert answer["block_ids"] == cache.leases["again"].blocks
        rank = await stats(daemon)
        assert (rank["blocks_cached"], rank["blocks_pinned"], rank["requests_open"]) == (
            LARGE,
            LARGE,
            1,
        )
        assert len(await daemon.mirror()) == LARGE


async def test_a_reset_while_a_release_unpins(tmp_path: Path) -> None:
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        tokens = packed_prompt(LARGE, 5)
        assert (await daemon.call("store", request_id="r", token_ids=tokens))["ok"]
        cache = daemon.cache
        assert (await daemon.call("release", request_id="r"))["released"] == LARGE
        await daemon.turns_until(lambda: cache.pinned_blocks < LARGE)
        assert cache.pinned_blocks > 0, "not in the middle of unpinning"
        # Not refused busy: the request was closed when the release was answered.
        assert (await daemon.call("reset"))["ok"]
        rank = await stats(daemon)
        assert (rank["blocks_cached"], rank["blocks_pinned"], rank["requests_open"]) == (0, 0, 0)
        assert await daemon.mirror() == {}
        # The old index's pins are gone with it: the same prompt is stored anew, and pinned.
        again = await daemon.call("store", request_id="again", token_ids=tokens)
        assert again["num_cached_tokens"] == 0
        assert (await stats(daemon))["blocks_pinned"] == LARGE
        assert len(await daemon.mirror()) == LARGE


async def test_a_reset_while_a_new_store_is_captured(tmp_path: Path) -> None:
    """Part of the store was captured (and published) before the reset: the stream stores
    it, clears it, then stores the whole prompt again; the reply names the blocks now cached."""
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        sink = daemon.pipeline.sink
        reply = pending(daemon.send("store", request_id="r", token_ids=packed_prompt(LARGE, 6)))
        await daemon.turns_until(lambda: len(sink.published) > 0)
        assert len(sink.published) < LARGE and not reply.done, "not in the middle of capturing"
        assert (await daemon.call("reset"))["ok"]
        answer = await daemon.answer(reply)
        assert answer["ok"] and answer["num_cached_tokens"] == 0
        assert answer["block_ids"] == daemon.cache.leases["r"].blocks
        assert len(await daemon.mirror()) == LARGE
        kinds = [
            "marker" if isinstance(e, AllBlocksCleared) else "stored"
            for _, events in daemon.history[1:]
            for e in events
            if isinstance(e, AllBlocksCleared | BlockStored)
        ]
        cleared = kinds.index("marker")
        assert 0 < cleared < len(kinds) - 1, kinds  # stored, cleared, stored again


# -- item 6: small stores behind a large one ----------------------------------------------------


async def test_stores_queued_behind_a_large_one_run_a_budget_per_turn(tmp_path: Path) -> None:
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        big = pending(daemon.send("store", request_id="big", token_ids=packed_prompt(LARGE, 7)))
        small = [pending(daemon.send("store", request_id=i, token_ids=b"")) for i in range(300)]
        done = await daemon.per_turn(
            lambda: sum(r.done for r in small), lambda: all(r.done for r in small)
        )
        assert big.done
        assert max(steps(done)) <= TURN_UNITS // REQUEST_UNITS, max(steps(done))
        assert all([(await daemon.answer(r))["ok"] for r in small])


async def test_the_queue_is_bounded_in_requests_too(tmp_path: Path) -> None:
    """Empty stores cost the token bound nothing: past MAX_QUEUED requests queued, the next
    is refused busy and changes nothing; the queued ones are all stored."""
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        replies = [daemon.send("store", request_id="big", token_ids=packed_prompt(LARGE, 8))]
        replies += [daemon.send("store", request_id=i, token_ids=b"") for i in range(MAX_QUEUED)]
        refused = [i for i, r in enumerate(replies) if not isinstance(r, Pending)]
        assert refused == [MAX_QUEUED], refused  # the large store and MAX_QUEUED - 1 queued
        assert (await daemon.answer(replies[-1]))["error"]["code"] == "busy"
        assert all([(await daemon.answer(r))["ok"] for r in replies[:-1]])
        unknown = await daemon.call("release", request_id=MAX_QUEUED - 1)
        assert unknown["error"]["code"] == "unknown_request"
        assert (await stats(daemon))["requests_open"] == MAX_QUEUED


async def test_a_request_id_stored_again_behind_its_queued_release_is_no_duplicate(
    tmp_path: Path,
) -> None:
    """store A (queued behind nothing but taking many turns), release A, store A, pipelined:
    handled in order, as if sent one by one. The third was refused duplicate_request: the
    first store was still queued, its release behind it not counted."""
    async with in_process(tmp_path, 2 * LARGE) as daemon:
        first = pending(daemon.send("store", request_id="A", token_ids=packed_prompt(LARGE, 9)))
        released = daemon.send("release", request_id="A")
        again = daemon.send("store", request_id="A", token_ids=prompt(1, 2))
        twice = daemon.send("release", request_id="A")
        replies = [await daemon.answer(r) for r in (first, released, again, twice)]
        assert [r["ok"] for r in replies] == [True, True, True, True], replies
        assert replies[1]["released"] == LARGE
        assert replies[3]["released"] == 2
        unknown = await daemon.call("release", request_id="A")
        assert unknown["error"]["code"] == "unknown_request"  # closed: each store released
        await daemon.turns_until(lambda: daemon.cache.pinned_blocks == 0)
        assert (await stats(daemon))["requests_open"] == 0
        # The same in one batch.
        batch = await daemon.call(
            "batch",
            requests=[
                {"op": "store", "request_id": "B", "token_ids": packed_prompt(LARGE, 10)},
                {"op": "release", "request_id": "B"},
                {"op": "store", "request_id": "B", "token_ids": prompt(2, 2)},
            ],
        )
        assert [r["ok"] for r in batch["replies"]] == [True, True, True], batch


# -- item 11: open requests bounded, stats without walking them ---------------------------------


async def test_open_requests_are_bounded_per_rank(tmp_path: Path) -> None:
    async with in_process(tmp_path, 2 * LARGE, max_open_requests=3) as daemon:
        # Stores queued count: they open a request once done.
        queued = [daemon.send("store", request_id="big", token_ids=packed_prompt(LARGE, 9))]
        queued += [daemon.send("store", request_id=i, token_ids=b"") for i in range(2)]
        refused = await daemon.call("store", request_id="over", token_ids=b"")
        assert refused["error"]["code"] == "too_many_requests", refused
        assert "control.max_open_requests" in refused["error"]["message"]
        assert all([(await daemon.answer(r))["ok"] for r in queued])
        assert (await daemon.call("store", request_id="over", token_ids=b""))["error"]["code"] == (
            "too_many_requests"
        )
        assert (await stats(daemon))["requests_open"] == 3
        assert (await daemon.call("release", request_id=0))["ok"]
        assert (await daemon.call("store", request_id="over", token_ids=b""))["ok"]


class _NotWalked(dict[Any, Lease]):
    """Open requests that fail the test if anything iterates them."""

    def _walked(self, *_: object) -> Any:
        raise AssertionError("the open requests were walked")

    __iter__ = values = items = keys = _walked


async def test_stats_never_walk_the_open_requests(tmp_path: Path) -> None:
    """``blocks_pinned`` (tail blocks included) comes from counters, exact through stores,
    releases and a reset."""
    async with in_process(tmp_path, 256) as daemon:
        shared = prompt(1, 3)
        for request_id, tokens in (("a", [*shared, 1, 2]), ("b", [*shared, 3]), ("c", shared)):
            assert (await daemon.call("store", request_id=request_id, token_ids=tokens))["ok"]
        daemon.cache.leases = _NotWalked(daemon.cache.leases)
        assert (await stats(daemon))["blocks_pinned"] == 3 + 2  # shared blocks, two tails
        assert (await daemon.call("release", request_id="a"))["released"] == 4
        assert (await stats(daemon))["blocks_pinned"] == 3 + 1
        assert (await daemon.call("reset", force=True))["ok"]
        assert (await stats(daemon))["blocks_pinned"] == 0


# -- the reply's ids, encoded a slice at a time ---------------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 65_535, 65_536, 70_000])
def test_ids_encoded_in_slices_are_the_array_msgpack_encodes(count: int) -> None:
    ids = list(range(count))
    encoded = EncodedArray()
    for start in range(0, count, 7_000):
        encoded.extend(ids[start : start + 7_000])
    assert encoded.encode() == msgpack.packb(ids)
    assert encoded.decode() == ids
    assert ok_reply(7, StoreReply(0, reply_ids(encoded), 16)) == ok_reply(7, StoreReply(0, ids, 16))


async def test_with_a_host_tier_a_store_that_demotes_takes_half_a_slice_per_turn(
    tmp_path: Path,
) -> None:
    """Each block a store evicts is also copied to the host tier and published there: about
    twice the work per block, so half as many blocks per loop turn (a reset behind such a
    store waits as long as behind one without a host tier). A store of SYNC_BLOCKS blocks,
    one step without a host tier, takes two."""
    async with in_process(tmp_path, SYNC_BLOCKS, host_blocks=2 * SYNC_BLOCKS) as daemon:
        await stored_and_released(daemon, packed_prompt(SYNC_BLOCKS, 1))
        host = daemon.cache.host
        assert host is not None
        reply = pending(
            daemon.send("store", request_id="r", token_ids=packed_prompt(SYNC_BLOCKS, 2))
        )
        demoted = await daemon.per_turn(lambda: len(host), lambda: reply.done)
        assert (await daemon.answer(reply))["num_cached_tokens"] == 0
        assert demoted[-1] == SYNC_BLOCKS, demoted
        assert max(steps(demoted)) <= SLICE_BLOCKS // 2, demoted
