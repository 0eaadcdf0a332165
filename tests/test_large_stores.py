"""Stores too large for one loop step are carried out a slice at a time: they keep arrival
order with the stores behind them, a reset behind one is answered first and wins (the store
then lands on the emptied cache), and the stream stays exact."""

from __future__ import annotations

import asyncio
import gc
import signal
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvpubd.client import ControlError
from kvpubd.daemon.cache import CacheError, RankCache
from kvpubd.daemon.settings import CacheConfig
from kvpubd.daemon.sink import EventSink
from kvpubd.daemon.stores import QUEUED_REQUESTS, SYNC_BLOCKS, StoreQueue
from kvpubd.protocol.control import Store, packed_uint32
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.mirrors import assert_mirror_is_snapshot, go_live, subscriber
from tests.streams import chain_hashes, packed_prompt, prompt

# The daemon is stopped (SIGSTOP) while requests pile up: a process.
pytestmark = pytest.mark.daemon_process

BLOCK_SIZE = 16
LARGE = 4 * SYNC_BLOCKS  # full blocks of a store that takes several loop turns
HUGE = 4 * LARGE


@pytest.fixture
def large_daemon(start_daemon: DaemonFactory) -> Daemon:
    return start_daemon(cache={"num_blocks": 8 * LARGE})


@contextmanager
def control_dealer(daemon: Daemon) -> Iterator[zmq.Socket[bytes]]:
    """A raw DEALER on the daemon's control socket, for requests sent back to back."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.control_endpoint)
    try:
        yield sock
    finally:
        sock.close()
        context.term()


@pytest.fixture
def dealer(large_daemon: Daemon) -> Iterator[zmq.Socket[bytes]]:
    with control_dealer(large_daemon) as sock:
        yield sock


def send_all(
    sock: zmq.Socket[bytes], *requests: dict[str, Any], daemon: Daemon | None = None
) -> list[dict[str, Any]]:
    """Send the requests back to back on one DEALER; the replies in the order they came. With
    ``daemon``, it is stopped (SIGSTOP) while they are sent, so that they reach it together
    however slow this process is: the later ones arrive while the first is under way."""
    if daemon is not None:
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
    try:
        for request in requests:
            sock.send_multipart([b"", msgpack.packb(request, use_bin_type=True)])
    finally:
        if daemon is not None:
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGCONT)
    replies: list[dict[str, Any]] = []
    while len(replies) < len(requests):
        assert sock.poll(30_000), f"replies so far: {replies}"
        replies.append(msgpack.unpackb(sock.recv_multipart()[-1], raw=False))
    return replies


def test_stores_keep_arrival_order_behind_a_large_one(
    large_daemon: Daemon, dealer: zmq.Socket[bytes]
) -> None:
    """A small store sent right behind a large one sharing its prefix is answered after it,
    and finds the large store's blocks cached."""
    big = packed_prompt(LARGE, 1)
    small = big[: 8 * BLOCK_SIZE * 4]  # its first 8 blocks
    replies = send_all(
        dealer,
        {"op": "store", "id": "big", "request_id": "big", "token_ids": big},
        {"op": "store", "id": "small", "request_id": "small", "token_ids": small},
        daemon=large_daemon,
    )
    assert [r["id"] for r in replies] == ["big", "small"]
    big_reply, small_reply = replies
    assert big_reply["ok"] and small_reply["ok"], replies
    assert len(big_reply["block_ids"]) == LARGE and big_reply["num_cached_tokens"] == 0
    assert small_reply["num_cached_tokens"] == 8 * BLOCK_SIZE
    assert small_reply["block_ids"] == big_reply["block_ids"][:8]


def test_duplicate_id_of_a_store_under_way_is_refused(
    large_daemon: Daemon, dealer: zmq.Socket[bytes]
) -> None:
    replies = send_all(
        dealer,
        {"op": "store", "id": 1, "request_id": "same", "token_ids": packed_prompt(LARGE, 2)},
        {"op": "store", "id": 2, "request_id": "same", "token_ids": packed_prompt(2, 3)},
        daemon=large_daemon,
    )
    by_id = {r["id"]: r for r in replies}
    assert by_id[1]["ok"]
    assert by_id[2]["error"]["code"] == "duplicate_request"


def test_reset_behind_a_large_store_is_answered_first_and_the_stream_stays_exact(
    large_daemon: Daemon, dealer: zmq.Socket[bytes]
) -> None:
    sub = subscriber("sync", large_daemon)
    try:
        with large_daemon.client() as client:
            go_live(sub, client, [0])
            replies = send_all(
                dealer,
                # Four times as large: dozens of loop turns, so the reset right behind it
                # arrives while it is under way even on a starved machine.
                {
                    "op": "store",
                    "id": "store",
                    "request_id": "r",
                    "token_ids": packed_prompt(HUGE, 4),
                },
                {"op": "reset", "id": "reset", "force": True},
                daemon=large_daemon,
            )
            assert [r["id"] for r in replies] == ["reset", "store"], replies
            reset, store = replies[0], replies[1]
            assert reset["ok"] and store["ok"], replies
            # The reset came first, so the store's blocks are what the cache holds now.
            assert len(store["block_ids"]) == HUGE
            assert client.stats().ranks[0].blocks_cached == HUGE
            assert_mirror_is_snapshot(sub, client, [0])
            client.release("r")
    finally:
        sub.close()


@pytest.mark.parametrize("algorithm", ["sha256", "xxhash"])
def test_a_store_hashed_in_slices_chains_across_them(
    start_daemon: DaemonFactory, algorithm: str
) -> None:
    """A store hashed over several loop turns continues each slice's chain from the last
    digest of the one before, with either hash algorithm: every published hash is the one
    the whole prompt's chain gives."""
    daemon = start_daemon(cache={"num_blocks": 2 * LARGE, "hash_algorithm": algorithm})
    sub = subscriber("sync", daemon)
    try:
        with daemon.client() as client:
            go_live(sub, client, [0])
            tokens = packed_prompt(LARGE, 9)
            assert len(client.store("r", tokens).block_ids) == LARGE
            assert_mirror_is_snapshot(sub, client, [0])
            expected = chain_hashes(np.frombuffer(tokens, "<u4").tolist(), algorithm=algorithm)
            # (besides the blocks go_live stored)
            mirror = sub.mirror(0)
            assert mirror is not None
            assert set(expected) <= set(mirror.blocks)
    finally:
        sub.close()


def test_release_sent_right_behind_a_large_store_releases_it(
    large_daemon: Daemon, dealer: zmq.Socket[bytes]
) -> None:
    """A client that pipelines store and release (as engines and the load generator do) gets
    the release applied once the store is done, answered right after it: nothing stays
    pinned. A second release of the same request then finds it no longer open."""
    replies = send_all(
        dealer,
        {"op": "store", "id": "store", "request_id": "r", "token_ids": packed_prompt(LARGE, 5)},
        {"op": "release", "id": "release", "request_id": "r"},
        {"op": "release", "id": "again", "request_id": "r"},
        daemon=large_daemon,
    )
    assert [r["id"] for r in replies] == ["store", "release", "again"], replies
    store, release, again = replies
    assert store["ok"] and release["ok"], replies
    assert release["released"] == LARGE and release["rank"] == 0
    assert again["error"]["code"] == "unknown_request"
    with large_daemon.client() as client:
        # Closed at once; a release that finds its store done unpins a slice per loop turn
        # after its reply (pipeline.release), so the count reaches 0 a few turns later.
        assert client.stats().ranks[0].requests_open == 0
        rank = wait_for(
            lambda: next((r for r in client.stats().ranks if r.blocks_pinned == 0), None),
            what="the released blocks unpinned",
        )
        assert (rank.blocks_pinned, rank.requests_open, rank.blocks_cached) == (0, 0, LARGE)


def test_release_of_a_queued_store_that_fails_is_refused(
    start_daemon: DaemonFactory,
) -> None:
    """A store that cannot be done (more blocks than the pool) behind a large one fails; the
    release sent behind it is refused as not open, after the store's refusal."""
    daemon = start_daemon(cache={"num_blocks": LARGE + 16})
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.control_endpoint)
    try:
        replies = send_all(
            sock,
            {"op": "store", "id": "big", "request_id": "big", "token_ids": packed_prompt(LARGE, 6)},
            {"op": "store", "id": "more", "request_id": "more", "token_ids": packed_prompt(64, 7)},
            {"op": "release", "id": "release", "request_id": "more"},
            daemon=daemon,
        )
    finally:
        sock.close()
        context.term()
    assert [r["id"] for r in replies] == ["big", "more", "release"], replies
    assert replies[0]["ok"]
    assert replies[1]["error"]["code"] == "pool_exhausted"
    assert replies[2]["error"]["code"] == "unknown_request"


def test_stores_queued_past_the_bound_are_refused_busy_and_change_nothing(
    start_daemon: DaemonFactory,
) -> None:
    """A client that pipelines large stores without reading the replies: once the rank's
    queue holds QUEUED_REQUESTS largest requests' worth of tokens, further stores are refused
    with ``busy`` (the queue drains a slice per loop turn, requests are read far faster: it
    grew the daemon's memory without bound). Nothing of a refused store is left: its request
    id is not open, and the stream still mirrors the cache exactly."""
    daemon = start_daemon(
        cache={"num_blocks": 8 * LARGE}, control={"max_tokens_per_request": HUGE * BLOCK_SIZE}
    )
    count = QUEUED_REQUESTS + 2
    sub = subscriber("sync", daemon)
    try:
        with daemon.client() as client, control_dealer(daemon) as sock:
            go_live(sub, client, [0])
            replies = send_all(
                sock,
                *(
                    {
                        "op": "store",
                        "id": i,
                        "request_id": f"q{i}",
                        "token_ids": packed_prompt(HUGE, 10 + i),
                    }
                    for i in range(count)
                ),
                daemon=daemon,
            )
            codes = {r["id"]: r["error"]["code"] if "error" in r else "ok" for r in replies}
            # The pool holds two of them (the others find it pinned full); every store past
            # the bound is refused before it is queued.
            assert [codes[i] for i in range(QUEUED_REQUESTS)] == [
                "ok",
                "ok",
                *["pool_exhausted"] * (QUEUED_REQUESTS - 2),
            ], codes
            assert [codes[i] for i in range(QUEUED_REQUESTS, count)] == ["busy", "busy"], codes
            for i in range(QUEUED_REQUESTS, count):
                with pytest.raises(ControlError) as refused:
                    client.release(f"q{i}")
                assert refused.value.code == "unknown_request"
            assert client.stats().ranks[0].blocks_cached == 2 * HUGE
            assert_mirror_is_snapshot(sub, client, [0])
            # The queue took stores again once it had drained.
            client.release("q0")
            client.store("again", prompt(99, 2))
    finally:
        sub.close()


async def test_a_refused_large_store_leaves_nothing_behind() -> None:
    """A large store the pool cannot hold is refused, and its tokens are freed as soon as the
    caller lets go of the reply: nothing keeps them alive until a full garbage collection
    (the error's traceback once held the store's frame, and through it the request)."""
    sink = EventSink(block_size=BLOCK_SIZE, medium="CPU", max_events_per_tick=1 << 20)
    cache = RankCache(CacheConfig(num_blocks=64, block_size=BLOCK_SIZE), sink, "u64")
    queue = StoreQueue(cache, max_queued_tokens=1 << 20)
    tokens = np.frombuffer(packed_prompt(LARGE, 7), dtype="<u4").copy()
    alive = weakref.ref(tokens)
    gc.disable()
    try:
        request = Store(request_id="too-big", token_ids=packed_uint32(tokens.tobytes()))
        result = queue.submit(request, tokens)
        del tokens, request
        errors: list[BaseException | None] = []
        result.then(lambda _value, error: errors.append(error))
        for _ in range(10_000):
            if errors:
                break
            await asyncio.sleep(0)
        (error,) = errors
        assert isinstance(error, CacheError) and error.code == "pool_exhausted", error
        del result, error
        errors.clear()
        assert alive() is None, "the refused store's tokens are still referenced"
    finally:
        gc.enable()
        queue.close()
        cache.pool.close()
