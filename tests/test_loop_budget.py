"""No input holds the daemon's loop: under a replay flood, a large snapshot or a maximal store a
reset is still answered and published, oversized strings are refused, and any start seq gets a
replay end marker (issue 10 rows 1-4 and 13). Outcomes only: how fast is `kvpubd bench reset
--under`'s business. Client timeouts here are generous bounds against a hang, not thresholds."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvpubd.client import ControlError, Marker, Mirror, ResetReply, SnapshotReply, replay
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import END_SEQ, AllBlocksCleared
from kvpubd.tools.bench_load import Load, LoadSpec
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.mirrors import snapshot_blocks
from tests.streams import BLOCK_SIZE, Tap, concurrent_replays, prompt, seq_key, seq_of

# Blocks as small as the pool allows: these tests are about the loop, not memory.
TINY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"}
BOUND_S = 20.0  # a bound against hanging, far above anything a healthy daemon needs


def assert_marker_published(tap: Tap, marker: Marker) -> None:
    tap.through({marker.rank: seq_of(marker)}, timeout=BOUND_S)
    batch = tap.batch(marker.rank, seq_of(marker))
    assert any(isinstance(e, AllBlocksCleared) for e in batch.batch.events)


def fill(daemon: Daemon, blocks: int, prefix: str = "fill") -> None:
    """Cache ``blocks`` full blocks (unpinned) through one DEALER, pipelined."""
    per_store = 4096 // BLOCK_SIZE
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.control_endpoint)
    rng = np.random.default_rng(blocks)
    try:
        stores = -(-blocks // per_store)
        for i in range(stores):
            count = min(per_store, blocks - i * per_store) * BLOCK_SIZE
            tokens = rng.integers(0, 1 << 31, size=count, dtype=np.uint32)
            for op in ("store", "release"):
                request: dict[str, Any] = {"op": op, "id": i, "request_id": f"{prefix}-{i}"}
                if op == "store":
                    request["token_ids"] = tokens.astype("<u4").tobytes()
                sock.send_multipart([b"", msgpack.packb(request, use_bin_type=True)])
        for _ in range(2 * stores):
            assert sock.poll(int(BOUND_S * 1000)), "the daemon stopped answering fill stores"
            reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
            assert reply["ok"], reply
    finally:
        sock.close()
        ctx.term()


def test_replay_flood_never_read_holds_back_no_reset(start_daemon: DaemonFactory) -> None:
    """Four processes flood the replay port with requests from seq 0 and never read: a reset
    is answered and its marker published, a store is answered, SIGTERM exits 0."""
    daemon = start_daemon(cache={**TINY, "num_blocks": 4096})
    with daemon.client(timeout=BOUND_S) as client, daemon.subscriber() as sub:
        tap = Tap(sub)
        tap.go_live(client)
        fill(daemon, 2048)  # history for every replay to stream
        spec = LoadSpec(
            "replay-flood",
            control_endpoint=daemon.control_endpoint,
            replay_endpoint=rank_endpoint(daemon.replay_endpoint, 0),
            events_endpoint=rank_endpoint(daemon.events_endpoint, 0),
            metrics_port=0,
            flood_processes=4,
        )
        with Load(spec) as load:
            assert load.wait_ready(BOUND_S)
            load.run()
            assert load.wait_active(0, BOUND_S)
            wait_for(
                lambda: client.stats().ranks[0].replay_requests > 0,
                BOUND_S,
                "the flood to reach the daemon",
            )
            (marker,) = client.reset(force=True).markers
            assert_marker_published(tap, marker)
            reply = client.store("after-flood", prompt(7, 2))
            assert len(reply.block_ids) == 2
            assert daemon.stop(timeout=BOUND_S) == 0


def test_reset_goes_ahead_of_a_large_snapshot(start_daemon: DaemonFactory) -> None:
    """A reset sent right behind the snapshot of a large cache is answered before the
    snapshot is complete and its marker arrives; the snapshot still completes and is the
    published state at its seq (a build the reset overtook starts again on the new state:
    then it is empty, at or after the marker's seq)."""
    blocks = 50_000
    daemon = start_daemon(cache={**TINY, "num_blocks": blocks + 1024})
    with daemon.client(timeout=BOUND_S) as client, daemon.subscriber() as sub:
        tap = Tap(sub)
        tap.go_live(client)
        fill(daemon, blocks)
        tap.settle(client, timeout=BOUND_S)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.control_endpoint)
        try:
            # One DEALER: the daemon receives the snapshot request first, then the reset.
            # (Written for a snapshot answered in one reply; one sent as several replies
            # is complete at its last.)
            for request in ({"op": "snapshot", "id": "snap"}, {"op": "reset", "id": "reset"}):
                sock.send_multipart([b"", msgpack.packb(request, use_bin_type=True)])
            replies: list[dict[str, Any]] = []
            while not any(r.get("id") == "snap" for r in replies) or len(replies) < 2:
                assert sock.poll(int(BOUND_S * 1000)), f"replies so far: {len(replies)}"
                replies.append(msgpack.unpackb(sock.recv_multipart()[-1], raw=False))
        finally:
            sock.close()
            ctx.term()
        order = [r["id"] for r in replies]
        assert order.index("reset") < order.index("snap"), order
        reset, snap = (next(r for r in replies if r["id"] == i) for i in ("reset", "snap"))
        assert reset["ok"] and snap["ok"]
        (marker,) = ResetReply.parse(reset).markers
        assert_marker_published(tap, marker)
        # The snapshot is the mirror of everything published up to its seq.
        snapshot = SnapshotReply.parse(snap)
        mirror = Mirror(BLOCK_SIZE)
        for received in sorted(tap.history, key=seq_key):
            if received.seq <= snapshot.seq:
                mirror.apply(received.batch.events)
        assert mirror.blocks == snapshot_blocks(snapshot)
        if snapshot.seq < seq_of(marker):
            assert len(mirror.blocks) >= blocks
        else:
            assert mirror.blocks == {}


@pytest.mark.parametrize("field", ["lora_name", "cache_salt", "request_id"])
def test_huge_strings_are_refused_and_change_nothing(daemon: Daemon, field: str) -> None:
    """A 1 MiB lora_name (or cache_salt, or request_id) fits in a request but is refused with
    one clear line naming the field; the cache, the stream and open requests stay as they
    were."""
    with daemon.client() as client:
        before = client.stats().ranks[0]
        fields: dict[str, Any] = {"request_id": "huge"}
        fields[field] = "x" * (1 << 20)
        request_id = fields.pop("request_id")
        with pytest.raises(ControlError) as refused:
            client.store(request_id, prompt(3, 64), **fields)
        assert refused.value.code in {"too_large", "bad_request"}
        assert field in refused.value.message and "\n" not in refused.value.message
        assert len(refused.value.message) < 300
        after = client.stats().ranks[0]
        for key in ("seq", "blocks_cached", "blocks_used", "requests_open", "events_pending"):
            assert getattr(after, key) == getattr(before, key), key
        with pytest.raises(ControlError) as unknown:
            client.release("huge")
        assert unknown.value.code == "unknown_request"


@pytest.mark.parametrize("form", ["list", "bytes"])
def test_store_over_the_token_limit_is_refused(start_daemon: DaemonFactory, form: str) -> None:
    daemon = start_daemon(control={"max_tokens_per_request": 4096})
    tokens: Any = list(range(4097))
    if form == "bytes":
        tokens = np.arange(4097, dtype="<u4")
    with daemon.client() as client:
        before = client.stats().ranks[0]
        with pytest.raises(ControlError) as refused:
            client.store("over", tokens)
        assert refused.value.code == "too_large" and "4096" in refused.value.message
        after = client.stats().ranks[0]
        for key in ("seq", "blocks_cached", "requests_open"):
            assert getattr(after, key) == getattr(before, key), key


def test_maximal_store_and_a_concurrent_reset_are_both_answered(
    start_daemon: DaemonFactory,
) -> None:
    """The largest store the daemon allows (1M tokens), with a reset right behind it: both
    answered and the marker published."""
    limit = 1_000_000
    daemon = start_daemon(
        cache={**TINY, "num_blocks": limit // BLOCK_SIZE + 1024},
        control={"max_tokens_per_request": limit, "max_blocks_per_store": limit // BLOCK_SIZE},
    )
    tokens = np.random.default_rng(0).integers(0, 1 << 31, size=limit, dtype=np.uint32)
    with daemon.client(timeout=BOUND_S) as client, daemon.subscriber() as sub:
        tap = Tap(sub)
        tap.go_live(client)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(daemon.control_endpoint)
        try:
            store = {"op": "store", "id": "big", "request_id": "big", "token_ids": tokens.tobytes()}
            for request in (store, {"op": "reset", "id": "reset", "force": True}):
                sock.send_multipart([b"", msgpack.packb(request, use_bin_type=True)])
            replies: dict[str, dict[str, Any]] = {}
            while len(replies) < 2:
                assert sock.poll(int(BOUND_S * 1000)), f"answered: {sorted(replies)}"
                reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
                replies[reply["id"]] = reply
        finally:
            sock.close()
            ctx.term()
        assert replies["big"]["ok"] and replies["reset"]["ok"], replies
        (marker,) = ResetReply.parse(replies["reset"]).markers
        assert_marker_published(tap, marker)


@pytest.mark.parametrize("start_seq", [2**64 - 2, 2**63])
def test_any_start_seq_gets_an_end_marker(start_daemon: DaemonFactory, start_seq: int) -> None:
    """A replay from a start seq far past the last gets its end marker (and nothing else);
    replays asked for beside it, and after many such requests, still finish."""
    # All from this process: one address, which may hold a quarter of max_replays.
    daemon = start_daemon(events={"max_replays": 4 * 64})
    with daemon.client() as client:
        for i in range(5):
            client.store(f"r{i}", prompt(i, 2))
            client.release(f"r{i}")
        last = client.snapshot().seq
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    everything = list(range(replay(endpoint, 0, timeout=BOUND_S)[0][0], last + 1))
    assert replay(endpoint, start_seq, timeout=BOUND_S) == []
    ctx = zmq.Context()
    try:
        senders = []
        for _ in range(40):  # with the 8 below, within this address's share: none refused
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(endpoint)
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            senders.append(dealer)
        for got in concurrent_replays(endpoint, 8, timeout=BOUND_S):
            assert got == everything
        for dealer in senders:
            assert dealer.poll(int(BOUND_S * 1000)), "no end marker"
            assert dealer.recv_multipart()[-2] == END_SEQ
            dealer.close()
    finally:
        ctx.destroy(linger=0)
    assert [seq for seq, _ in replay(endpoint, 0, timeout=BOUND_S)] == everything


def test_a_client_gets_one_snapshot_of_a_rank_at_a_time(start_daemon: DaemonFactory) -> None:
    """Snapshots pipelined by one client: the first is answered, the others while it is being
    put together are refused ``busy`` (each reply is a copy of the published state: a client
    that pipelined them without reading queued a copy per request). Another client's request
    meanwhile shares the build and is answered; once the reply went out, the first client
    gets the next one."""
    blocks = 50_000
    daemon = start_daemon(cache={**TINY, "num_blocks": blocks + 1024})
    fill(daemon, blocks)
    ctx = zmq.Context()
    pipelining, other = (ctx.socket(zmq.DEALER) for _ in range(2))
    try:
        for sock in (pipelining, other):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(daemon.control_endpoint)

        def send(sock: zmq.Socket[bytes], *ids: int) -> None:
            for request_id in ids:
                request = {"op": "snapshot", "id": request_id}
                sock.send_multipart([b"", msgpack.packb(request, use_bin_type=True)])

        def replies(sock: zmq.Socket[bytes], count: int) -> list[dict[str, Any]]:
            got: list[dict[str, Any]] = []
            while len(got) < count:
                assert sock.poll(int(BOUND_S * 1000)), f"replies so far: {len(got)}"
                got.append(msgpack.unpackb(sock.recv_multipart()[-1], raw=False))
            return sorted(got, key=lambda reply: reply["id"])

        send(pipelining, 1, 2, 3, 4)
        send(other, 5)  # while the first is being put together
        pipelined = replies(pipelining, 4)
        assert [r.get("error", {}).get("code") for r in pipelined] == [None, "busy", "busy", "busy"]
        assert len(pipelined[0]["events"]) == blocks
        (shared,) = replies(other, 1)
        assert shared["ok"] and shared["seq"] == pipelined[0]["seq"]
        send(pipelining, 6)
        (again,) = replies(pipelining, 1)
        assert again["ok"] and len(again["events"]) == blocks
    finally:
        pipelining.close()
        other.close()
        ctx.term()
