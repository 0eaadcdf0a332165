"""Bad control input against a real daemon: every malformed request gets a well-formed error
reply (or, for unusable framing, none), changes nothing, and the daemon keeps serving."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any, cast

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpubd.client import (
    ControlClient,
    ControlError,
    Mirror,
    SnapshotReply,
    StatsReply,
    Subscriber,
)
from kvpubd.protocol.wire import BlockStored
from tests.conftest import DaemonFactory
from tests.daemon import Daemon
from tests.streams import chain_hashes, seq_of

MAX_MESSAGE_BYTES = 4096
MAX_TOKENS = 64
BLOCK_SIZE = 16
LIMITS = {"max_message_bytes": MAX_MESSAGE_BYTES, "max_tokens_per_request": MAX_TOKENS}
ERROR_CODES = {
    "bad_request",
    "unknown_op",
    "too_large",
    "busy",
    "pool_exhausted",
    "unknown_request",
    "duplicate_request",
}
REPLY_TIMEOUT = 5.0


def pack(obj: Any) -> bytes:
    return cast(bytes, msgpack.packb(obj, use_bin_type=True))


def unpack(frame: bytes) -> Any:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def check_error_reply(reply: Any, request_id: Any = None) -> dict[str, Any]:
    """The error reply shape: {"ok": False, "id": <echoed>, "error": {"code", "message"}}."""
    assert isinstance(reply, dict), reply
    assert set(reply) == {"ok", "id", "error"}, reply
    assert reply["ok"] is False, reply
    assert pack(reply["id"]) == pack(request_id), f"id not echoed: {reply}"
    error = reply["error"]
    assert isinstance(error, dict) and set(error) == {"code", "message"}, reply
    assert isinstance(error["code"], str) and error["code"] in ERROR_CODES, reply
    assert isinstance(error["message"], str) and error["message"].strip(), reply
    assert not error["message"].rstrip().endswith(":"), reply  # says what, after its colon
    return error


def dealer(daemon: Daemon, context: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    """A raw DEALER on the control socket: frames go out exactly as given."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.control_endpoint)
    return sock


def recv_map(
    sock: zmq.Socket[bytes], timeout: float = REPLY_TIMEOUT, envelope: list[bytes] | None = None
) -> Any:
    """The next reply's map (the frame after the empty delimiter), coming back through
    ``envelope``: the frames the request carried before its delimiter (none by default)."""
    assert sock.poll(int(timeout * 1000)), "no reply from the daemon"
    frames = sock.recv_multipart()
    expected = envelope or []
    assert len(frames) == len(expected) + 2 and frames[: len(expected) + 1] == [*expected, b""], (
        frames
    )
    return unpack(frames[-1])


_fence_ids = itertools.count()


def replies_before_fence(sock: zmq.Socket[bytes], envelope: list[bytes] | None = None) -> list[Any]:
    """Send a valid ping on ``sock`` and return every reply that arrived before the ping's,
    those coming back through ``envelope``.

    Replies on one connection come in request order, so this proves what an earlier message
    on the same socket was (or was not) answered with."""
    fence_id = f"fence-{next(_fence_ids)}"
    sock.send_multipart([b"", pack({"op": "ping", "id": fence_id})])
    before: list[Any] = []
    while True:
        reply = recv_map(sock, envelope=None if before else envelope)
        if isinstance(reply, dict) and reply.get("id") == fence_id:
            assert reply["ok"] is True, reply
            return before
        before.append(reply)


class Probe:
    """Control client plus a subscriber mirroring the whole stream of rank 0."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.client: ControlClient = daemon.client(timeout=REPLY_TIMEOUT)
        self.sub: Subscriber = daemon.subscriber(replay_timeout=REPLY_TIMEOUT)
        self.mirror = Mirror(block_size=BLOCK_SIZE)
        # The first batch is the run's start-up marker, at the run's seq origin.
        self.last_seq: int = self.client.stats().ranks[0].first_seq - 1
        self._prompts = itertools.count(1)
        self._apply(self.sub.catch_up())

    def close(self) -> None:
        self.client.close()
        self.sub.close()

    def _apply(self, batches: list[Any]) -> list[Any]:
        for received in batches:
            assert received.seq == self.last_seq + 1, "the stream skipped a seq"
            self.last_seq = received.seq
            self.mirror.apply(received.batch.events)
        return batches

    def receive_until(self, done: Any, what: str, timeout: float = 10.0) -> list[Any]:
        """Receive (and mirror) batches until ``done(batches so far)`` holds."""
        seen: list[Any] = []
        deadline = time.monotonic() + timeout
        while not done(seen):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            seen.extend(self._apply(self.sub.receive(0.05)))
        return seen

    def state(self) -> tuple[StatsReply, SnapshotReply]:
        """(stats, snapshot); the snapshot (taken first) publishes what is pending."""
        snapshot = self.client.snapshot()
        return self.client.stats(), snapshot

    def fresh_prompt(self) -> list[int]:
        """One full block of tokens no earlier prompt started with."""
        n = next(self._prompts)
        return [100_000 + n] * BLOCK_SIZE

    def fence_store(self) -> None:
        """A valid store now must be published in the batch right after the last one seen:
        proof that nothing was published in between."""
        last = self.client.stats().ranks[0].seq
        self.receive_until(lambda _: self.last_seq >= last, f"batch {last}")
        assert self.last_seq == last, "a batch was published that stats does not count"
        tokens = self.fresh_prompt()
        hashes = chain_hashes(tokens)
        request_id = f"fence-store-{tokens[0]}"
        self.client.store(request_id, tokens)
        self.client.release(request_id)

        def stored(batches: list[Any]) -> bool:
            return any(
                isinstance(e, BlockStored) and e.block_hashes == hashes
                for b in batches
                for e in b.batch.events
            )

        batches = self.receive_until(stored, "the fence store's batch")
        assert [b.seq for b in batches] == [last + 1], "the fence store is not the next batch"

    def check_against_snapshot(self) -> None:
        """The mirror built from the stream equals the daemon's snapshot at the same seq."""
        snapshot = self.client.snapshot()
        self.receive_until(lambda _: self.last_seq >= snapshot.seq, "the snapshot's seq")
        assert self.last_seq == snapshot.seq
        blocks = {}
        for event in snapshot.events:
            assert isinstance(event, BlockStored)
            (block_hash,) = event.block_hashes
            blocks[block_hash] = event
        assert blocks == self.mirror.blocks


@pytest.fixture(scope="module")
def limited() -> Iterator[Daemon]:
    """One daemon with small control limits, shared by the table-driven cases."""
    daemon = Daemon({"control": LIMITS})
    try:
        yield daemon.start()
    finally:
        daemon.cleanup()


@pytest.fixture(scope="module")
def probe(limited: Daemon) -> Iterator[Probe]:
    probe = Probe(limited)
    yield probe
    probe.close()


@pytest.fixture(scope="module")
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


# -- table of bad requests: (frames after the delimiter, expected codes, id to echo) ----------

GOOD_TOKENS = list(range(1, 2 * BLOCK_SIZE + 1))


def store(**fields: Any) -> dict[str, Any]:
    return {"op": "store", "request_id": "bad-store", "token_ids": GOOD_TOKENS, **fields}


def without(request: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in request.items() if k != key}


BAD_MAPS: dict[str, tuple[dict[Any, Any], set[str]]] = {
    "missing op": ({"request_id": 1}, {"bad_request"}),
    "op nil": ({"op": None}, {"bad_request"}),
    "op int": ({"op": 3}, {"bad_request", "unknown_op"}),
    "op list": ({"op": ["ping"]}, {"bad_request", "unknown_op"}),
    "unknown op": ({"op": "explode"}, {"unknown_op"}),
    "op wrong case": ({"op": "PING"}, {"unknown_op"}),
    "op with space": ({"op": "ping "}, {"unknown_op"}),
    "store token_ids string": (store(token_ids="abc"), {"bad_request"}),
    "store token_ids mixed": (store(token_ids=[1, "x"]), {"bad_request"}),
    "store token_ids float": (store(token_ids=[1.5]), {"bad_request"}),
    "store token_ids bool": (store(token_ids=[True]), {"bad_request"}),
    "store token_ids nested": (store(token_ids=[[1]]), {"bad_request"}),
    "store token_ids map": (store(token_ids={"a": 1}), {"bad_request"}),
    "store token negative": (store(token_ids=[*GOOD_TOKENS, -1]), {"bad_request"}),
    "store token 2**32": (store(token_ids=[*GOOD_TOKENS, 2**32]), {"bad_request"}),
    "store token 2**63": (store(token_ids=[2**63]), {"bad_request"}),
    "store token 2**64-1": (store(token_ids=[2**64 - 1]), {"bad_request"}),
    "store token -2**63": (store(token_ids=[-(2**63)]), {"bad_request"}),
    "store token_ids missing": (without(store(), "token_ids"), {"bad_request"}),
    "store token_ids nil": (store(token_ids=None), {"bad_request"}),
    "store request_id missing": (without(store(), "request_id"), {"bad_request"}),
    "store request_id float": (store(request_id=1.5), {"bad_request"}),
    "store request_id bool": (store(request_id=True), {"bad_request"}),
    "store request_id nil": (store(request_id=None), {"bad_request"}),
    "store request_id list": (store(request_id=[1]), {"bad_request"}),
    "store request_id bytes": (store(request_id=b"r"), {"bad_request"}),
    "store rank -1": (store(rank=-1), {"bad_request"}),
    "store rank 5 of 1": (store(rank=5), {"bad_request"}),
    "store rank string": (store(rank="0"), {"bad_request"}),
    "store rank float": (store(rank=0.0), {"bad_request"}),
    "store lora_id string": (store(lora_id="a"), {"bad_request"}),
    "store lora_name int": (store(lora_name=3), {"bad_request"}),
    "store cache_salt int": (store(cache_salt=3), {"bad_request"}),
    "store extra field": (store(bogus=1), {"bad_request"}),
    "store too many tokens": (
        store(token_ids=list(range(MAX_TOKENS + 1))),
        {"too_large"},
    ),
    "store lora_name 257 chars": (
        {"op": "store", "request_id": "n", "token_ids": [1] * 16, "lora_name": "x" * 257},
        {"bad_request"},
    ),
    "store cache_salt 1025 chars": (
        {"op": "store", "request_id": "n", "token_ids": [1] * 16, "cache_salt": "s" * 1025},
        {"bad_request"},
    ),
    "store request_id 257 chars": (
        {"op": "store", "request_id": "r" * 257, "token_ids": [1] * 16},
        {"bad_request"},
    ),
    "store request_id 2^63": (
        {"op": "store", "request_id": 1 << 63, "token_ids": [1] * 16},
        {"bad_request"},
    ),
    "store lora_id 2^64-1": (
        {"op": "store", "request_id": "n", "token_ids": [1] * 16, "lora_id": (1 << 64) - 1},
        {"bad_request"},
    ),
    "release request_id float": ({"op": "release", "request_id": 1.5}, {"bad_request"}),
    "release request_id nil": ({"op": "release", "request_id": None}, {"bad_request"}),
    "release request_id missing": ({"op": "release"}, {"bad_request"}),
    "release unknown request": ({"op": "release", "request_id": "never"}, {"unknown_request"}),
    "reset force string": ({"op": "reset", "force": "yes"}, {"bad_request"}),
    "reset force int": ({"op": "reset", "force": 1}, {"bad_request"}),
    "reset rank -1": ({"op": "reset", "rank": -1}, {"bad_request"}),
    "reset rank 5 of 1": ({"op": "reset", "rank": 5}, {"bad_request"}),
    "reset rank string": ({"op": "reset", "rank": "all"}, {"bad_request"}),
    "reset extra field": ({"op": "reset", "bogus": 1}, {"bad_request"}),
    "snapshot rank -1": ({"op": "snapshot", "rank": -1}, {"bad_request"}),
    "snapshot rank 5 of 1": ({"op": "snapshot", "rank": 5}, {"bad_request"}),
    "snapshot rank float": ({"op": "snapshot", "rank": 1.0}, {"bad_request"}),
    "pause extra field": ({"op": "pause", "bogus": True}, {"bad_request"}),
    "resume extra field": ({"op": "resume", "now": True}, {"bad_request"}),
    "ping extra field": ({"op": "ping", "bogus": 1}, {"bad_request"}),
    "stats extra field": ({"op": "stats", "bogus": 1}, {"bad_request"}),
}


@pytest.mark.parametrize("request_id", [17, "req-x", {"nested": [1, 2.5, None]}])
@pytest.mark.parametrize("name", list(BAD_MAPS))
def test_bad_map_gets_error_and_changes_nothing(probe: Probe, name: str, request_id: Any) -> None:
    """A map request with a bad op or bad fields is refused with the documented error shape,
    its id echoed, and stats, snapshot and the stream stay exactly as they were."""
    request, codes = BAD_MAPS[name]
    before = probe.state()
    probe.client._send_raw([pack({**request, "id": request_id})])
    error = check_error_reply(probe.client._recv_raw(), request_id)
    assert error["code"] in codes, error
    assert probe.state() == before
    probe.fence_store()


NOT_MAPS: dict[str, list[bytes]] = {
    "random bytes": [b"\xc1\x00\xff\x13 not msgpack at all"],
    "never-used msgpack byte": [b"\xc1"],
    "truncated msgpack": [pack({"op": "ping", "id": 1, "pad": "abcdefgh"})[:-4]],
    "two msgpack objects": [pack({"op": "ping"}) + pack({"op": "ping"})],
    "empty request frame": [b""],
    "no request frame": [],
    "list": [pack(["ping"])],
    "int": [pack(7)],
    "string": [pack("ping")],
    "nil": [pack(None)],
    "binary": [pack(b"\x81\xa2op\xa4ping")],
    "map with bytes keys": [pack({b"op": "ping"})],
    "extra frames": [pack({"op": "ping", "id": 5}), b"more"],
    "extra empty frame": [pack({"op": "ping", "id": 5}), b""],
    "oversized, no id": [pack({"op": "ping", "pad": "x" * MAX_MESSAGE_BYTES})],
}


@pytest.mark.parametrize("name", list(NOT_MAPS))
def test_unusable_request_gets_error_and_changes_nothing(probe: Probe, name: str) -> None:
    """Requests that are not one msgpack map (or come with the wrong number of frames) are
    refused with a well-formed error reply and change nothing."""
    frames = NOT_MAPS[name]
    before = probe.state()
    probe.client._send_raw(frames)
    reply = cast(dict[str, Any], probe.client._recv_raw())
    request_id = reply.get("id") if name.startswith("extra") else None
    assert request_id in (None, 5)
    error = check_error_reply(reply, request_id)
    expected = "too_large" if name.startswith("oversized") else "bad_request"
    assert error["code"] == expected, error
    assert probe.state() == before
    probe.fence_store()


DEEP = 1000  # levels: past what msgspec decodes (it raises RecursionError, not DecodeError)


@pytest.mark.parametrize("where", ["id", "id of a large frame", "id of a large batch"])
def test_a_value_nested_too_deep_is_refused_and_the_socket_keeps_serving(
    start_daemon: DaemonFactory, context: zmq.Context[zmq.Socket[bytes]], where: str
) -> None:
    """A request whose id nests 1000 arrays deep is refused, and the requests behind it on
    the same connection are answered. It escaped the parser as a RecursionError; the reader
    of the (edge-triggered) socket stopped there and no request of anyone's was answered
    until a new connection woke it."""
    deep_id = b"\x91" * DEEP + b"\x01"
    if where == "id":
        frame = b"\x82\xa2op\xa4ping\xa2id" + deep_id
    elif where == "id of a large frame":
        frame = b"\x83\xa2op\xa4ping\xa3pad" + pack("x" * 9000) + b"\xa2id" + deep_id
    else:
        requests = pack([{"op": "ping", "id": 1, "pad": "x" * 9000}])
        frame = b"\x83\xa2op\xa5batch\xa8requests" + requests + b"\xa2id" + deep_id
    sock = dealer(start_daemon(), context)  # the default limits: a large frame is 8 KiB+
    try:
        sock.send_multipart([b"", frame])
        error = check_error_reply(recv_map(sock), None)
        assert error["code"] == "bad_request", error
        assert replies_before_fence(sock) == []  # the next request is answered
    finally:
        sock.close()


def test_map_with_non_string_keys_is_refused_with_its_id(probe: Probe) -> None:
    """A map with a non-string key is a bad request; it is still a map with an id, so the
    error echoes the id (clients match replies by id)."""
    before = probe.state()
    probe.client._send_raw([pack({1: "x", "op": "ping", "id": 31})])
    error = check_error_reply(probe.client._recv_raw(), 31)
    assert error["code"] == "bad_request"
    assert probe.state() == before
    probe.fence_store()


def test_oversized_request_is_too_large_with_its_id(probe: Probe) -> None:
    """A request over control.max_message_bytes gets too_large with its id echoed, so a
    client waiting for that id sees the error rather than a timeout."""
    request = store(id=41, lora_name="x" * MAX_MESSAGE_BYTES)
    assert len(pack(request)) > MAX_MESSAGE_BYTES
    before = probe.state()
    probe.client._send_raw([pack(request)])
    error = check_error_reply(probe.client._recv_raw(), 41)
    assert error["code"] == "too_large"
    assert probe.state() == before
    probe.fence_store()


def test_client_call_with_oversized_request_raises_too_large(probe: Probe) -> None:
    """ControlClient.call with a request over the limit raises ControlError(too_large)."""
    before = probe.state()
    with probe.daemon.client(timeout=2.0) as client, pytest.raises(ControlError) as refused:
        client._call("ping", pad="x" * MAX_MESSAGE_BYTES)
    assert refused.value.code == "too_large"
    assert probe.state() == before
    probe.fence_store()


def test_store_over_token_limit_is_too_large(probe: Probe) -> None:
    """A store with more than control.max_tokens_per_request tokens is too_large; one at the
    limit is accepted."""
    before = probe.state()
    with pytest.raises(ControlError) as refused:
        probe.client.store("too-many", list(range(1, MAX_TOKENS + 2)))
    assert refused.value.code == "too_large"
    assert probe.state() == before
    probe.fence_store()
    reply = probe.client.store("at-limit", [7] * MAX_TOKENS)
    assert len(reply.block_ids) == MAX_TOKENS // BLOCK_SIZE
    probe.client.release("at-limit")


def test_store_over_block_limit_is_too_large(start_daemon: DaemonFactory) -> None:
    """A store covering more than control.max_blocks_per_store full blocks is too_large and
    changes nothing; one at the limit (plus a partial tail) is accepted."""
    daemon = start_daemon(control={"max_blocks_per_store": 2})
    with daemon.client() as client:
        before = client.stats().ranks
        with pytest.raises(ControlError) as refused:
            client.store("three", [5] * (3 * BLOCK_SIZE))
        assert refused.value.code == "too_large"
        assert "max_blocks_per_store" in refused.value.message
        assert client.stats().ranks == before
        reply = client.store("two", [5] * (3 * BLOCK_SIZE - 1))
        assert len(reply.block_ids) == 3  # two full blocks and the tail


NO_REPLY: dict[str, list[bytes]] = {
    "valid request without delimiter": [pack({"op": "ping", "id": "lost"})],
    "bad request without delimiter": [b"\xc1garbage"],
    "non-empty first frame": [b"junk", pack({"op": "ping", "id": "lost"})],
    "valid reset without delimiter": [pack({"op": "reset", "force": True, "id": "lost"})],
}


@pytest.mark.parametrize("name", list(NO_REPLY))
def test_message_without_delimiter_gets_no_reply(
    probe: Probe, context: zmq.Context[zmq.Socket[bytes]], name: str
) -> None:
    """A DEALER message without the empty delimiter is dropped: no reply (the next valid ping
    on the same socket is the first thing answered) and nothing changes."""
    before = probe.state()
    sock = dealer(probe.daemon, context)
    try:
        sock.send_multipart(NO_REPLY[name])
        assert replies_before_fence(sock) == []
    finally:
        sock.close()
    assert probe.state() == before
    probe.fence_store()


def test_frame_over_hard_cap_drops_the_peer_only(
    probe: Probe, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A frame far over the limit (past the socket's hard cap) costs that peer its connection,
    not the daemon: nothing is answered for it, nothing changes, and everyone keeps being
    served, that peer included after it reconnects."""
    before = probe.state()
    sock = dealer(probe.daemon, context)
    try:
        sock.send_multipart([b"", b"\x00" * (4 * MAX_MESSAGE_BYTES + 4096)])
        assert probe.client.ping().version  # another peer is served meanwhile
        # The dropped connection may swallow a ping sent on it; retry until one is answered.
        deadline = time.monotonic() + 10.0
        while True:
            assert time.monotonic() < deadline, "the peer was never served again"
            fence_id = f"retry-{time.monotonic_ns()}"
            sock.send_multipart([b"", pack({"op": "ping", "id": fence_id})])
            if sock.poll(500):
                reply = recv_map(sock)
                assert reply.get("ok") is True, f"the oversized frame was answered: {reply}"
                break
    finally:
        sock.close()
    assert probe.state() == before
    probe.fence_store()


def test_req_socket_is_served(probe: Probe, context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A REQ client (which adds the delimiter itself) gets replies, for good and bad input."""
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(probe.daemon.control_endpoint)
    try:
        sock.send(pack({"op": "ping", "id": "via-req"}))
        assert sock.poll(int(REPLY_TIMEOUT * 1000)), "REQ got no reply"
        reply = unpack(sock.recv())
        assert reply["ok"] is True and reply["id"] == "via-req"
        assert reply["epoch"] == probe.daemon.epoch
        sock.send(pack({"op": "explode", "id": "bad-via-req"}))
        assert sock.poll(int(REPLY_TIMEOUT * 1000)), "REQ got no reply"
        error = check_error_reply(unpack(sock.recv()), "bad-via-req")
        assert error["code"] == "unknown_op"
    finally:
        sock.close()


# -- property: random maps and bytes never hurt the daemon ------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# Mostly plausible field values, so that many requests pass validation and reach the cache.
request_ids = st.integers(0, 50) | st.text(max_size=3) | values
token_lists = (
    st.lists(st.integers(0, 50), max_size=3 * BLOCK_SIZE)
    | st.lists(st.integers(-2, 2**32 + 2), max_size=3 * BLOCK_SIZE)
    | st.lists(st.integers(0, 9) | values, max_size=2 * BLOCK_SIZE)
    | values
)
ranks = st.integers(-1, 2) | values
names = st.none() | st.text(max_size=8) | values
ids = {"id": values}


def op_maps(op: str, required: dict[str, Any], optional: dict[str, Any]) -> Any:
    return st.fixed_dictionaries({"op": st.just(op), **required}, optional={**ids, **optional})


well_typed_maps = st.one_of(
    op_maps(
        "store",
        {"request_id": request_ids, "token_ids": token_lists},
        {
            "rank": ranks,
            "lora_id": st.integers(-2, 2) | values,
            "lora_name": names,
            "cache_salt": names,
        },
    ),
    op_maps("release", {"request_id": request_ids}, {}),
    op_maps("reset", {}, {"rank": ranks, "force": st.booleans() | values}),
    op_maps("snapshot", {}, {"rank": ranks}),
    *(op_maps(op, {}, {}) for op in ("ping", "stats", "pause", "resume")),
)
garbage_maps = st.dictionaries(
    st.sampled_from(["op", "id", "request_id", "token_ids", "rank", "force"]) | st.text(max_size=8),
    values,
    max_size=5,
) | st.dictionaries(
    st.text(max_size=4) | st.integers(-3, 3) | st.binary(max_size=3), values, max_size=3
)
with_unknown_field = st.builds(
    lambda request, extra: {**extra, **request},
    well_typed_maps,
    st.dictionaries(st.text(min_size=1, max_size=6), values, min_size=1, max_size=2),
)
plausible_stores = op_maps(
    "store",
    {"request_id": st.integers(0, 10**6), "token_ids": st.lists(st.integers(0, 9), max_size=60)},
    {"lora_id": st.integers(0, 2), "cache_salt": st.sampled_from(["s", "t"])},
)
random_maps = plausible_stores | well_typed_maps | with_unknown_field | garbage_maps
random_frames = st.lists(st.binary(max_size=48), min_size=1, max_size=4) | st.tuples(
    st.just(b""), st.binary(max_size=64)
).map(list)


def check_reply(reply: Any, request: dict[Any, Any] | None) -> None:
    """Any reply: a map with ok/id; errors carry a known code (never internal) and message;
    the id is echoed for a str-keyed map within the size limit (the dedicated tests above
    cover the other maps)."""
    assert isinstance(reply, dict), reply
    assert isinstance(reply.get("ok"), bool) and "id" in reply, reply
    if (
        request is not None
        and all(isinstance(k, str) for k in request)
        and len(pack(request)) <= MAX_MESSAGE_BYTES
    ):
        assert pack(reply["id"]) == pack(request.get("id")), reply
    if not reply["ok"]:
        check_error_reply(reply, reply["id"])


def test_random_input_never_hurts_the_daemon(start_daemon: DaemonFactory) -> None:
    """Hundreds of random maps and raw frames: every reply is well formed, the daemon stays
    up, and afterwards a reset and a store work and the whole stream keeps its invariants."""
    daemon = start_daemon(control=LIMITS)
    probe = Probe(daemon)
    context = zmq.Context()
    sock = dealer(daemon, context)
    try:

        @settings(
            max_examples=300,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(request=random_maps)
        def random_map(request: dict[Any, Any]) -> None:
            probe.client._send_raw([pack(request)])
            check_reply(probe.client._recv_raw(), request)

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(frames=random_frames)
        def random_bytes(frames: list[bytes]) -> None:
            sock.send_multipart(frames)
            # Frames before the first empty one are an envelope the reply comes back through
            # (a correlating DEALER, a proxy); without an empty frame there is no reply.
            delimiter = frames.index(b"") if b"" in frames else None
            envelope = frames[:delimiter] if delimiter is not None else None
            replies = replies_before_fence(sock, envelope)
            assert len(replies) == (0 if delimiter is None else 1), replies
            for reply in replies:
                request = None
                if delimiter is not None and len(frames) == delimiter + 2:
                    try:
                        decoded = unpack(frames[-1])
                    except Exception:
                        decoded = None
                    request = decoded if isinstance(decoded, dict) else None
                check_reply(reply, request)

        random_map()
        random_bytes()

        assert daemon.alive()
        probe.client.resume()
        markers = probe.client.reset(force=True).markers
        (marker,) = markers
        probe.receive_until(lambda _: probe.last_seq >= seq_of(marker), "the reset marker")
        assert probe.mirror.blocks == {}
        tokens = list(range(1, 3 * BLOCK_SIZE + 5))
        reply = probe.client.store("after-fuzz", tokens)
        assert reply.num_cached_tokens == 0 and len(reply.block_ids) == 4

        def stored(batches: list[Any]) -> bool:
            return chain_hashes(tokens)[-1] in probe.mirror.blocks

        probe.receive_until(stored, "the store after the fuzzing")
        probe.check_against_snapshot()
        stats = probe.client.stats().ranks[0]
        assert stats.seq == probe.last_seq
        assert probe.sub.counters.lost == 0
    finally:
        sock.close()
        context.term()
        probe.close()
