"""Long lists of integers in a request (``token_ids``, ``block_ids``) are never decoded in
one loop step (issue item 2): an over-limit list is refused from its header alone, and one
within the limit is decoded a slice per loop turn, so a reset sent behind it is answered
first. Loop turns and slices are counted, never time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgpack
import numpy as np
import pytest

from kvpubd.daemon.control_server import Reply
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.service import Service
from kvpubd.protocol.int_arrays import DECODE_SLICE
from tests.loop_turns import settled, started_service, turns_until

BLOCK_SIZE = 16
TOKENS = 24 * DECODE_SLICE  # a list decoded over a couple of dozen loop turns
MAX_TOKENS = 32 * DECODE_SLICE


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[Service]:
    async with started_service(
        tmp_path,
        control={
            "max_tokens_per_request": MAX_TOKENS,
            "max_blocks_per_store": MAX_TOKENS // BLOCK_SIZE,
            "max_message_bytes": 16 << 20,
        },
        cache={
            "num_blocks": 2 * MAX_TOKENS // BLOCK_SIZE,
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "uint8",
        },
    ) as started:
        yield started


def send_frame(service: Service, frame: bytes) -> Reply:
    assert service.control is not None
    reply = service.control.handle_frames([b"peer", b"", frame])
    assert reply is not None
    return reply


def store_frame(request_id: str, token_ids: Any, **fields: Any) -> bytes:
    request = {"op": "store", "id": request_id, "request_id": request_id, **fields}
    request["token_ids"] = token_ids  # last, as the client library sends it
    return cast(bytes, msgpack.packb(request, use_bin_type=True))


def tokens(count: int, seed: int) -> list[int]:
    return cast(list[int], np.random.default_rng(seed).integers(0, 1 << 32, size=count).tolist())


async def test_a_bad_token_at_the_end_is_found_slices_later_and_a_reset_goes_first(
    service: Service,
) -> None:
    """The list is not decoded in the request's step: the non-integer at its end is found
    only once the slices before it are decoded, one per loop turn, and a reset sent right
    behind the store is answered before that."""
    bad = [*tokens(TOKENS - 1, 1), "x"]
    reply = send_frame(service, store_frame("bad", bad))
    assert isinstance(reply, Pending), "the list was decoded in the request's step"
    replies: list[bytes] = []
    reply.then(lambda value, error: replies.append(bytes(value)) if value else None)
    reset = send_frame(service, msgpack.packb({"op": "reset", "id": "reset"}))
    assert isinstance(reset, bytes) and msgpack.unpackb(reset)["ok"]
    assert not replies
    turns = await turns_until(lambda: bool(replies))
    assert turns >= TOKENS // DECODE_SLICE - 1
    error = msgpack.unpackb(replies[0], raw=False)["error"]
    assert error["code"] == "bad_request", error
    assert f"token_ids.{TOKENS - 1}" in error["message"], error
    assert service.pipelines[0].open_requests == 0


async def test_a_list_store_equals_the_packed_bytes_store(service: Service) -> None:
    ids = tokens(TOKENS + 5, 2)
    first = await settled(send_frame(service, store_frame("list", ids)))
    assert first["ok"] and first["num_cached_tokens"] == 0, first
    packed = np.asarray(ids, dtype="<u4").tobytes()
    second = await settled(send_frame(service, store_frame("bytes", packed)))
    # Every full block the bytes form names was found cached: the same tokens.
    assert second["num_cached_tokens"] == TOKENS, second
    assert second["block_ids"][:-1] == first["block_ids"][:-1]


async def test_an_over_limit_list_is_refused_from_its_header_alone(service: Service) -> None:
    """Its items are never looked at: a non-integer among them does not change the answer
    (decoding them first would have found it)."""
    over = [*tokens(MAX_TOKENS, 3), "x"]
    reply = send_frame(service, store_frame("over", over))
    assert isinstance(reply, bytes)
    answer = msgpack.unpackb(reply, raw=False)
    assert answer["id"] == "over"
    assert answer["error"]["code"] == "too_large", answer
    assert f"{MAX_TOKENS + 1} tokens" in answer["error"]["message"]


async def test_a_long_list_must_be_the_last_field(service: Service) -> None:
    ids = tokens(DECODE_SLICE + 1, 4)
    frame = msgpack.packb({"op": "store", "token_ids": ids, "id": 1, "request_id": "first"})
    reply = send_frame(service, frame)
    assert isinstance(reply, bytes)
    error = msgpack.unpackb(reply, raw=False)["error"]
    assert error["code"] == "bad_request" and "token_ids" in error["message"], error
    assert "last field" in error["message"]
    # A short one may come anywhere.
    frame = msgpack.packb({"op": "store", "token_ids": ids[:64], "id": 2, "request_id": "short"})
    assert (await settled(send_frame(service, frame)))["ok"]


@pytest.mark.parametrize(
    ("item", "why"),
    [(True, "bool"), (1.5, "float"), (-1, "-1 is not in"), (1 << 32, "is not in"), ([1], "list")],
)
async def test_bad_items_are_named(service: Service, item: Any, why: str) -> None:
    ids = [*tokens(DECODE_SLICE + 10, 5), item, 7]
    answer = await settled(send_frame(service, store_frame("bad-item", ids)))
    error = answer["error"]
    assert error["code"] == "bad_request", error
    assert f"token_ids.{DECODE_SLICE + 10}" in error["message"] and why in error["message"], error


async def test_data_after_a_last_list_is_refused(service: Service) -> None:
    frame = store_frame("trailing", tokens(100, 6)) + msgpack.packb(1)
    answer = await settled(send_frame(service, frame))
    assert answer["error"]["code"] == "bad_request", answer
