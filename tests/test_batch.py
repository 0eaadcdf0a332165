"""The ``batch`` op: several stores and releases in one message, each handled as if sent alone
and in order, replies in the same order; a batch never holds the loop for long (its stores past
the turn's budget run a slice per turn, as a large store does). Against the service in this
process, real sockets and msgpack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from kvpubd.client import ControlClient, release_request, store_request
from kvpubd.daemon.control_server import Reply
from kvpubd.daemon.service import Service
from kvpubd.protocol.control import MAX_BATCH_REQUESTS
from kvpubd.protocol.control_frames import ONE_CALL_BYTES
from tests.loop_turns import settled, started_service, turns_until

TINY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"}


def tokens(seed: int, blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 31, blocks * 16 + 3, dtype=np.uint32)


def requests() -> list[dict[str, Any]]:
    """A step's worth: stores (one a duplicate, one of another rank), releases (one unknown)."""
    first, second = tokens(1, 5), tokens(2, 3)
    return [
        {"op": "store", "id": 1, "request_id": "a", "token_ids": first.tobytes()},
        {"op": "store", "id": 2, "request_id": "b", "token_ids": second.tobytes(), "rank": 1},
        {"op": "store", "id": 3, "request_id": "a", "token_ids": second.tobytes()},
        {"op": "release", "id": 4, "request_id": "a"},
        {"op": "release", "id": 5, "request_id": "nobody"},
        # The same prompt again: its blocks are cached now.
        {"op": "store", "id": 6, "request_id": "c", "token_ids": first.tobytes()},
        {"op": "release", "id": 7, "request_id": "c"},
    ]


def frame(request: dict[str, Any]) -> list[bytes]:
    return [b"peer", b"", msgpack.packb(request, use_bin_type=True)]


async def answer(service: Service, request: dict[str, Any]) -> dict[str, Any]:
    assert service.control is not None
    reply: Reply | None = service.control.handle_frames(frame(request))
    assert reply is not None
    return await settled(reply)


async def test_a_batch_answers_what_its_requests_alone_would(tmp_path: Path) -> None:
    sections: dict[str, Any] = {"cache": {**TINY, "data_parallel_size": 2}}
    async with started_service(tmp_path / "alone", **sections) as alone:
        separately = [await answer(alone, r) for r in requests()]
    async with started_service(tmp_path / "batch", **sections) as batched:
        reply = await answer(batched, {"op": "batch", "id": "step", "requests": requests()})
        stats = [p.stats() for p in batched.pipelines]
    assert reply["ok"] is True and reply["id"] == "step"
    assert reply["replies"] == separately
    codes = [r.get("error", {}).get("code") for r in reply["replies"]]
    assert codes == [None, None, "duplicate_request", None, "unknown_request", None, None]
    assert reply["replies"][5]["num_cached_tokens"] == 5 * 16
    assert [s.requests_open for s in stats] == [0, 1]


async def test_a_batch_of_one_rank_names_it_once(tmp_path: Path) -> None:
    async with started_service(tmp_path, cache={**TINY, "data_parallel_size": 2}) as service:
        entries = [
            {"op": "store", "request_id": "x", "token_ids": tokens(3, 2).tobytes()},
            {"op": "store", "request_id": "y", "token_ids": tokens(4, 2).tobytes(), "rank": 0},
        ]
        reply = await answer(service, {"op": "batch", "rank": 1, "requests": entries})
    first, second = reply["replies"]
    assert first["ok"] and first["rank"] == 1
    assert (
        second["error"]["code"] == "bad_request" and "batch of rank 1" in second["error"]["message"]
    )


async def test_a_long_batch_runs_a_slice_per_loop_turn(tmp_path: Path) -> None:
    """Its stores past the turn's budget are queued: the reply comes turns later, whole and in
    order, and the loop turned meanwhile (a reset would have been read)."""
    async with started_service(tmp_path, cache={**TINY, "num_blocks": 40_000}) as service:
        entries = [
            {"op": "store", "request_id": n, "token_ids": tokens(n, 512).tobytes()}
            for n in range(48)
        ]
        assert service.control is not None
        reply = service.control.handle_frames(frame({"op": "batch", "requests": entries}))
        assert reply is not None and not isinstance(reply, bytes)
        got: list[bytes] = []
        reply.then(lambda value, _: got.append(bytes(value)) if value is not None else None)
        assert await turns_until(lambda: bool(got)) > 1
        replies = msgpack.unpackb(got[0])["replies"]
        assert [len(r["block_ids"]) for r in replies] == [513] * 48
        assert service.pipelines[0].open_requests == 48


async def test_a_batch_over_the_limits_is_refused_whole(tmp_path: Path) -> None:
    async with started_service(tmp_path, cache=TINY, control={"max_tokens_per_request": 100}) as s:
        many = [{"op": "release", "request_id": n} for n in range(MAX_BATCH_REQUESTS + 1)]
        too_many = await answer(s, {"op": "batch", "requests": many})
        long = [{"op": "store", "request_id": 1, "token_ids": list(range(101))}]
        too_long = await answer(s, {"op": "batch", "requests": long})
        other_op = await answer(s, {"op": "batch", "requests": [{"op": "reset"}]})
        assert s.pipelines[0].open_requests == 0
    assert too_many["error"]["code"] == "bad_request" and "requests" in too_many["error"]["message"]
    assert too_long["error"]["code"] == "too_large"
    assert other_op["error"]["code"] == "bad_request"


async def test_a_large_batch_is_read_whatever_the_order_of_its_keys(tmp_path: Path) -> None:
    """msgpack maps have no order: a batch whose op is not its first key, larger than what
    is decoded in one call, is the same batch (it was walked as a request of another kind,
    its token lists taken for lists of anything, and refused), with tokens packed or listed."""
    entries = [
        {"op": "store", "request_id": n, "token_ids": tokens(n, 40).tobytes()} for n in range(8)
    ]
    entries += [
        {"op": "store", "request_id": n, "token_ids": tokens(n, 40).tolist()} for n in range(8, 16)
    ]
    assert len(msgpack.packb(entries)) > ONE_CALL_BYTES
    replies: list[dict[str, Any]] = []
    for order in ({"op": "batch", "id": 9}, {"id": 9, "op": "batch"}):
        async with started_service(tmp_path / str(len(replies)), cache=TINY) as service:
            replies.append(await answer(service, {**order, "requests": entries}))
    assert replies[0]["ok"] and [r["ok"] for r in replies[0]["replies"]] == [True] * 16
    assert replies[1] == replies[0]


def test_the_client_sends_a_batch(start_daemon: Any) -> None:
    daemon = start_daemon(cache={**TINY, "data_parallel_size": 2})
    with ControlClient(daemon.control_endpoint) as client:
        prompt = tokens(9, 4)
        reply = client.batch(
            [store_request("p", prompt, rank=1), store_request("q", list(range(40)))]
        )
        assert [r["rank"] for r in reply.replies] == [1, 0]
        released = client.batch([release_request("p"), release_request("q")])
        assert [r["released"] for r in released.replies] == [5, 3]
