"""The snapshot endpoint (``events.snapshot_endpoint``) against a consumer written from the
protocol text alone (tests/snapshot_consumer.py: pyzmq and msgpack, nothing of kvpubd).

The truth the consumer's index is compared with is what the daemon published, read without the
snapshot code: a replay from the run's first seq (its start-up marker; the ring is large
enough to hold the whole run) applied to a ``Mirror``. The control client only drives the
daemon (stores, releases, resets) and flushes what is captured.
"""

from __future__ import annotations

import itertools
import signal
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from kvpubd.client import ControlClient, Mirror, replay
from kvpubd.daemon.seq_state import MAGIC
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import BlockRemoved, BlockStored, decode_batch
from kvpubd.tools.launcher import free_tcp_port_runs
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.mirrors import store_released, unique_prompt
from tests.snapshot_consumer import (
    Block,
    BlockHash,
    Index,
    SnapshotConsumer,
    decode_payload,
)
from tests.test_seq_state import state_file

HEARTBEAT_MS = 100
SILENCE_S = 2.0  # the consumer's: 20 heartbeat intervals
RING = 1_000_000  # buffer_steps: every test's whole run stays replayable


def snapshot_events(**events: Any) -> dict[str, Any]:
    """Snapshots served on a private endpoint (picked as the daemon's others are)."""
    return {
        "snapshot_endpoint": True,
        "heartbeat_ms": HEARTBEAT_MS,
        "buffer_steps": RING,
        **events,
    }


def consumer_of(daemon: Daemon, rank: int = 0, **kwargs: Any) -> SnapshotConsumer:
    """A consumer of ``rank`` on the endpoints the daemon reports bound (ping)."""
    with daemon.client() as client:
        endpoints = client.ping().endpoints[rank]
    assert endpoints.snapshot, "ping reports no snapshot endpoint"
    kwargs.setdefault("silence_s", SILENCE_S)
    return SnapshotConsumer(endpoints.events, endpoints.snapshot, **kwargs)


# The in-process daemon by default; the real one too (uvloop, its own process) under slow.
HOSTS = ["thread", pytest.param("process", marks=[pytest.mark.daemon_process, pytest.mark.slow])]

# A block as both sides are compared: every field of its one-block store but the hashes.
View = tuple[Any, ...]


def frozen(value: Any) -> Any:
    """Lists (msgpack) and tuples (msgspec) alike, nested."""
    if isinstance(value, (list, tuple)):
        return tuple(frozen(item) for item in value)
    return value


def view_of_block(block: Block) -> View:
    return (
        block.parent,
        block.token_ids,
        block.block_size,
        block.lora_id,
        block.medium,
        block.lora_name,
        frozen(block.extra_keys),
        block.cache_salt,
    )


def view_of_stored(event: BlockStored) -> View:
    """A Mirror's block: a one-block store (its extra keys a list of one entry, or None)."""
    return (
        event.parent_block_hash,
        tuple(event.token_ids),
        event.block_size,
        event.lora_id,
        event.medium,
        event.lora_name,
        None if event.extra_keys is None else frozen(event.extra_keys[0]),
        event.cache_salt,
    )


def consumer_view(consumer: SnapshotConsumer) -> dict[BlockHash, View]:
    return {block_hash: view_of_block(block) for block_hash, block in consumer.index.items()}


@dataclass
class Published:
    """A rank's run as its replay from the start-up marker gives it."""

    first_seq: int
    batches: list[tuple[int, bytes]]
    publisher_id: bytes
    states: dict[int, dict[BlockHash, View]] = field(default_factory=dict)
    removed: int = 0  # blocks removed (evicted) in the run

    @property
    def last_seq(self) -> int:
        return self.batches[-1][0]

    @property
    def state(self) -> dict[BlockHash, View]:
        return self.states[self.last_seq]


def published(daemon: Daemon, rank: int = 0, at: set[int] | None = None) -> Published:
    """Flush what is captured, then replay the rank's run from its first seq into a Mirror:
    its state after the last batch (and after each seq of ``at``)."""
    with daemon.client() as client:
        client.snapshot(rank)  # publishes what is still captured
        stats = client.stats().ranks[rank]
    first = stats.first_seq
    batches = replay(rank_endpoint(daemon.replay_endpoint, rank), first, timeout=20)
    seqs = [seq for seq, _ in batches]
    assert seqs == list(range(first, first + len(seqs))), "the ring lost part of the run"
    mirror = Mirror()
    ids: set[bytes] = set()
    run = Published(first, batches, b"")
    for seq, payload in batches:
        events = decode_batch(payload).events
        mirror.apply(events)
        run.removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        _, _, publisher_id = decode_payload(payload)
        assert publisher_id is not None, f"seq {seq} replayed without a publisher_id"
        ids.add(publisher_id)
        if at is not None and seq in at:
            run.states[seq] = mirror_view(mirror)
    run.states[run.last_seq] = mirror_view(mirror)
    (run.publisher_id,) = ids
    return run


def mirror_view(mirror: Mirror) -> dict[BlockHash, View]:
    return {block_hash: view_of_stored(event) for block_hash, event in mirror.blocks.items()}


def ready_of(consumer: SnapshotConsumer) -> Callable[[], bool]:
    return lambda: consumer.ready


def caught_up(consumer: SnapshotConsumer, seq: int) -> Callable[[], bool]:
    def check() -> bool:
        last = consumer.last_applied_seq
        return last is not None and last >= seq

    return check


def assert_follows(consumer: SnapshotConsumer, daemon: Daemon) -> Published:
    """Once the consumer applied the daemon's last published seq, its index is exactly the
    published state (nothing may change the cache meanwhile)."""
    run = published(daemon)
    consumer.run_until(caught_up(consumer, run.last_seq), what=f"seq {run.last_seq}")
    assert consumer.publisher_id == run.publisher_id
    index = consumer_view(consumer)
    expected = run.state
    assert index == expected, (
        f"{len(index)} blocks, published {len(expected)}: missing "
        f"{len(expected.keys() - index.keys())}, extra {len(index.keys() - expected.keys())}"
    )
    assert consumer.violations == []
    return run


def variant(n: int) -> dict[str, Any]:
    """Some stores under a LoRA adapter, some salted: extra keys in the events."""
    fields: dict[str, Any] = {}
    if n % 5 == 1:
        fields.update(lora_id=3, lora_name="adapter")
    if n % 7 == 2:
        fields["cache_salt"] = f"salt-{n % 2}"
    return fields


class Driver(threading.Thread):
    """Stores (released or, every third, left pinned until a later op), and every
    ``reset_every``-th op a reset, through its own control client until stopped."""

    def __init__(self, daemon: Daemon, reset_every: int = 60) -> None:
        super().__init__(daemon=True)
        self.control_endpoint = daemon.control_endpoint
        self.reset_every = reset_every
        self.ops = 0
        self.resets = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            with ControlClient(self.control_endpoint, timeout=10) as client:
                pinned: list[str] = []
                for n in itertools.count():
                    if self._halt.is_set():
                        break
                    if n % self.reset_every == self.reset_every - 1:
                        while pinned:  # a reset refuses to drop pinned blocks
                            client.release(pinned.pop())
                        client.reset()
                        self.resets += 1
                    else:
                        request_id = f"drive-{n}"
                        client.store(request_id, unique_prompt(1 + n % 8), **variant(n))
                        if n % 3:
                            client.release(request_id)
                        else:
                            pinned.append(request_id)
                        if len(pinned) > 3:
                            client.release(pinned.pop(0))
                    self.ops += 1
                for request_id in pinned:
                    client.release(request_id)
        except BaseException as error:  # reported by stop()
            self.error = error

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        assert not self.is_alive(), "the driver did not stop"
        if self.error is not None:
            raise self.error


# -- a. late join under load ----------------------------------------------------------------


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_late_join_under_stores_releases_and_resets(
    start_daemon: DaemonFactory, wire_format: str, host: str
) -> None:
    """The consumer bootstraps while a driver stores, releases and resets without pause, then
    follows; once the driver stopped and the consumer applied the last seq, its index is
    exactly the published state. Both event forms."""
    daemon = start_daemon(events=snapshot_events(wire_format=wire_format))
    with daemon.client() as client:
        for _ in range(20):
            store_released(client, unique_prompt(3))
    driver = Driver(daemon)
    driver.start()
    try:
        wait_for(lambda: driver.ops >= 20 or driver.error, what="the driver under way")
        with consumer_of(daemon) as consumer:
            ops_at_join = driver.ops
            consumer.run_until(lambda: consumer.ready, what="the bootstrap")
            # Follow through resets while the driver goes on.
            resets = driver.resets
            consumer.run_until(
                lambda: driver.resets >= resets + 2 and consumer.counters.applied_batches > 20,
                what="two resets followed",
            )
            driver.stop()
            assert driver.ops > ops_at_join
            run = assert_follows(consumer, daemon)
            assert run.removed > 0  # the cache was full: evictions too
            counters = consumer.counters
            # The PUB's high-water mark is far above this test's batches: nothing is lost, so
            # one bootstrap and no resync.
            assert (counters.bootstraps, dict(counters.resyncs)) == (1, {}), counters
            assert dict(counters.bootstrap_failures) == {}
    finally:
        driver.stop()


# -- b. idle -------------------------------------------------------------------------------


def test_an_idle_daemon_keeps_the_consumer_ready_with_heartbeats(
    start_daemon: DaemonFactory,
) -> None:
    """Nothing happens for longer than the consumer's silence limit: heartbeats (empty
    batches carrying the publisher_id, each its own seq) keep it following, with no resync."""
    daemon = start_daemon(events=snapshot_events())
    with daemon.client() as client:
        store_released(client, unique_prompt(2))
    silence_s = 0.5  # 5 heartbeat intervals
    with consumer_of(daemon, silence_s=silence_s) as consumer:
        consumer.run_until(lambda: consumer.ready, what="the bootstrap")
        started = consumer.counters.applied_batches
        first = consumer.next_seq
        assert first is not None
        idle_until = time.monotonic() + 3 * silence_s
        consumer.run_until(lambda: time.monotonic() > idle_until, what="the idle time")
        assert consumer.ready
        counters = consumer.counters
        assert (counters.bootstraps, dict(counters.resyncs)) == (1, {})
        heartbeats = counters.applied_batches - started
        assert heartbeats >= 3  # at least one per silence interval
        assert counters.applied_heartbeats == counters.applied_batches
        assert consumer.next_seq == first + heartbeats  # each one a seq of its own
        with daemon.client() as client:
            assert consumer.publisher_id == client.ping().endpoints[0].publisher_id
        assert_follows(consumer, daemon)


def test_an_idle_rank_heartbeats_even_with_heartbeat_ms_off(start_daemon: DaemonFactory) -> None:
    """events.heartbeat_ms = 0 (the tests' default) while snapshots are served: an idle rank
    still heartbeats, so a consumer bootstraps on a daemon where nothing happens and follows
    it with the protocol's own silence limit (5 s), without a resync."""
    daemon = start_daemon(events={"snapshot_endpoint": True})
    assert daemon.settings["events"]["heartbeat_ms"] == 0
    with consumer_of(daemon, silence_s=5.0) as consumer:
        consumer.run_until(lambda: consumer.ready, what="a bootstrap on an idle daemon")
        consumer.run_until(
            lambda: consumer.counters.applied_heartbeats >= 2, what="two more heartbeats"
        )
        assert dict(consumer.counters.resyncs) == {}
        assert consumer.counters.applied_heartbeats == consumer.counters.applied_batches


# -- c. restarts -----------------------------------------------------------------------------


@pytest.mark.daemon_process
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill9", "sigterm"])
def test_a_restart_changes_the_publisher_id_and_the_consumer_rebootstraps(
    start_daemon: DaemonFactory, how: signal.Signals
) -> None:
    """kill -9 or SIGTERM and a new start on the same endpoints: the new run has another
    publisher_id; the consumer, reading only, drops the old index, bootstraps on the new run
    and ends with exactly its state (none of the old run's blocks)."""
    daemon = start_daemon(events=snapshot_events())
    with daemon.client() as client:
        for _ in range(5):
            store_released(client, unique_prompt(2))
    with consumer_of(daemon) as consumer:
        consumer.run_until(lambda: consumer.ready, what="the bootstrap")
        old = assert_follows(consumer, daemon)
        assert consumer.index
        daemon.stop(how)
        daemon.start()
        with daemon.client() as client:
            new_id = client.ping().endpoints[0].publisher_id
            for _ in range(3):
                store_released(client, unique_prompt(1))
        assert len(new_id) == 16 and new_id != old.publisher_id
        consumer.run_until(
            lambda: consumer.ready and consumer.publisher_id == new_id, what="the new run"
        )
        new = assert_follows(consumer, daemon)
        assert new.publisher_id == new_id
        assert not consumer.index.keys() & old.state.keys()
        counters = consumer.counters
        assert counters.bootstraps >= 2
        # The new id shows on the first message of the new run, unless the restart took
        # longer than the silence limit.
        assert counters.resyncs["identity"] + counters.resyncs["silence"] >= 1, counters
        assert consumer.violations == []


# -- d. a snapshot of many chunks -------------------------------------------------------------


def test_a_snapshot_bigger_than_one_chunk(start_daemon: DaemonFactory) -> None:
    """4000 blocks: the reply has several chunk frames, each a whole batch, and the consumer
    rebuilds them all in order."""
    daemon = start_daemon(events=snapshot_events(), cache={"num_blocks": 8192})
    with daemon.client() as client:
        for _ in range(40):
            store_released(client, unique_prompt(100))
    reply = raw_snapshot(snapshot_endpoint_of(daemon))
    assert len(reply) > 3, f"one chunk only ({len(reply) - 2} chunk frames)"
    with consumer_of(daemon) as consumer:
        consumer.run_until(lambda: consumer.ready, what="the bootstrap")
        assert consumer.counters.last_snapshot_chunks > 1
        assert len(consumer.index) == 4000
        assert_follows(consumer, daemon)


def snapshot_endpoint_of(daemon: Daemon, rank: int = 0) -> str:
    with daemon.client() as client:
        return str(client.ping().endpoints[rank].snapshot)


def raw_snapshot(endpoint: str, timeout_s: float = 10.0) -> list[bytes]:
    """One reply to ``b"snapshot"`` on a fresh REQ socket (asked again on a fresh one while the
    reply says unavailable)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    while True:
        req = context.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(endpoint)
            req.send(b"snapshot")
            if req.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                frames: list[bytes] = req.recv_multipart()
                if int.from_bytes(frames[0], "big", signed=True) >= -1:
                    return frames
        finally:
            req.close()
        assert time.monotonic() < deadline, "no snapshot reply"


# -- e. concurrent snapshot clients and resets --------------------------------------------------

SNAPSHOT_CLIENTS = 8
MIN_REPLIES_EACH = 3
# Enough blocks between resets that a snapshot takes several loop turns to build.
STORES_BETWEEN_RESETS, STORE_BLOCKS = 8, 64
HANG_S = 30.0  # only a hang takes this long


class SnapshotAsker(threading.Thread):
    """Asks for snapshots on fresh REQ sockets in a loop until stopped (and until it has
    ``MIN_REPLIES_EACH``), as a consumer does: each request after the live batches that
    arrived before it were read. Keeps every reply with the last live seq seen before it."""

    def __init__(self, daemon: Daemon, endpoint: str, halt: threading.Event) -> None:
        super().__init__(daemon=True)
        self.events_endpoint = rank_endpoint(daemon.events_endpoint, 0)
        self.endpoint = endpoint
        self.halt = halt
        self.replies: list[tuple[int, list[bytes]]] = []  # (last live seq seen, reply)
        self.failure: str | None = None

    def run(self) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.events_endpoint)
        try:
            if not sub.poll(int(HANG_S * 1000)):
                self.failure = "no live batch"
                return
            seen = -1
            while not self.halt.is_set() or len(self.replies) < MIN_REPLIES_EACH:
                while sub.poll(0):
                    seen = int.from_bytes(sub.recv_multipart()[1], "big")
                reply = self._ask(context)
                if reply is None:
                    self.failure = "a snapshot request got no reply"
                    return
                self.replies.append((seen, reply))
        finally:
            sub.close()

    def _ask(self, context: zmq.Context[zmq.Socket[bytes]]) -> list[bytes] | None:
        req = context.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self.endpoint)
            req.send(b"snapshot")
            if not req.poll(int(HANG_S * 1000)):
                return None
            return req.recv_multipart()
        finally:
            req.close()


def block_of(view: View) -> Block:
    parent, tokens, size, lora_id, medium, lora_name, extra, salt = view
    return Block(parent, tokens, size, lora_id, extra, medium, lora_name, salt)


def index_of_chunks(chunks: list[bytes]) -> tuple[dict[BlockHash, View], list[str]]:
    violations: list[str] = []
    index = Index(violations)
    for number, chunk in enumerate(chunks):
        _, events, publisher_id = decode_payload(chunk, lengths=(3,))
        assert publisher_id is None
        index.apply(events, f"chunk {number}")
    return {h: view_of_block(b) for h, b in index.blocks.items()}, violations


@pytest.mark.parametrize("host", HOSTS)
def test_concurrent_snapshot_clients_while_resets_are_issued(
    start_daemon: DaemonFactory, host: str
) -> None:
    """Eight clients ask for snapshots without pause while stores and resets go on: every
    reset is answered, and every snapshot reply is consistent: it reaches the last live seq
    its client saw before asking, its chunks are the published state at its seq, and with
    the batches published after it they make the final state."""
    # Fewer blocks than a round stores: evictions (removals) while snapshots are built.
    daemon = start_daemon(events=snapshot_events(), cache={"num_blocks": 256})
    endpoint = snapshot_endpoint_of(daemon)
    halt = threading.Event()
    askers = [SnapshotAsker(daemon, endpoint, halt) for _ in range(SNAPSHOT_CLIENTS)]
    markers: list[int] = []
    for asker in askers:
        asker.start()
    try:
        with daemon.client(timeout=HANG_S) as client:
            for _ in range(12):
                for _ in range(STORES_BETWEEN_RESETS):
                    store_released(client, unique_prompt(STORE_BLOCKS))
                (marker,) = client.reset().markers
                assert marker.seq is not None
                markers.append(marker.seq)
            store_released(client, unique_prompt(STORE_BLOCKS))
    finally:
        halt.set()
        for asker in askers:
            asker.join(HANG_S)
    assert [asker.failure for asker in askers] == [None] * SNAPSHOT_CLIENTS
    seen = [seen for asker in askers for seen, _ in asker.replies]
    replies = [reply for asker in askers for _, reply in asker.replies]
    seqs = [int.from_bytes(reply[0], "big", signed=True) for reply in replies]
    run = published(daemon, at={seq for seq in seqs if seq >= 0})
    assert markers == sorted(markers) and markers[-1] < run.last_seq
    assert run.removed > 0
    served: set[tuple[int, tuple[bytes, ...]]] = set()  # replies of one build are alike
    for reply, seq, last_seen in zip(replies, seqs, seen, strict=True):
        assert len(reply[0]) == 8 and reply[1] == run.publisher_id
        if seq == -2:  # unavailable: no chunks, the client asks again later
            assert reply[2:] == []
            continue
        assert last_seen <= seq <= run.last_seq, "older than a batch its client had seen"
        served.add((seq, tuple(reply[2:])))
    indexes: dict[int, dict[BlockHash, View]] = {}
    for seq, chunks in served:
        index, violations = index_of_chunks(list(chunks))
        assert violations == [], (seq, violations[:3])
        assert index == run.states[seq], f"the snapshot at seq {seq} is not the state there"
        indexes[seq] = index
    # The oldest and the newest snapshot, with the live batches after their seq (read by the
    # consumer's decoder): the final state.
    for seq in {min(indexes), max(indexes)}:
        rest = Index(violations)
        rest.blocks = {h: block_of(view) for h, view in indexes[seq].items()}
        for later, payload in run.batches:
            if later > seq:
                rest.apply(decode_payload(payload)[1], f"seq {later}")
        assert {h: view_of_block(b) for h, b in rest.blocks.items()} == run.state
        assert violations == []
    assert sum(seq >= 0 for seq in seqs) >= SNAPSHOT_CLIENTS * MIN_REPLIES_EACH


# -- f. malformed requests ---------------------------------------------------------------------

BAD_REQUESTS = {
    "other bytes": [b"", b"snapshots"],
    "empty body": [b"", b""],
    "upper case": [b"", b"SNAPSHOT"],
    "extra frame": [b"", b"snapshot", b"please"],
    "no delimiter": [b"snapshot"],
    "two delimiters": [b"", b"", b"snapshot"],
    "no body": [b""],
    "many frames": [b"", b"snapshot", *[b"x"] * 5000],
}
HUGE_FRAME = 64 << 20
STRAY_WAIT_MS = 200  # a stray reply would come right before the proper one: a short look


def assert_proper_reply(frames: list[bytes], publisher_id: bytes) -> None:
    assert len(frames) >= 2 and len(frames[0]) == 8, frames[:2]
    assert int.from_bytes(frames[0], "big", signed=True) >= 0
    assert frames[1] == publisher_id


def test_malformed_requests_get_no_reply_and_the_socket_serves_on(
    start_daemon: DaemonFactory,
) -> None:
    """Each malformed request goes on a DEALER followed by a proper one: the daemon reads one
    peer's messages in order, so a reply to the bad one would be the first to come back. The
    only reply is the proper one's; a huge frame gets none either; a REQ is served after."""
    daemon = start_daemon(events=snapshot_events())
    with daemon.client() as client:
        store_released(client, unique_prompt(2))
        publisher_id = client.ping().endpoints[0].publisher_id
    endpoint = snapshot_endpoint_of(daemon)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    for name, frames in BAD_REQUESTS.items():
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(endpoint)
            dealer.send_multipart(frames)
            dealer.send_multipart([b"", b"snapshot"])
            assert dealer.poll(int(HANG_S * 1000)), f"{name}: the proper request got no reply"
            delimiter, *reply = dealer.recv_multipart()
            assert delimiter == b"", f"{name}: a reply without the delimiter: {reply[:2]}"
            assert_proper_reply(reply, publisher_id)
            assert not dealer.poll(STRAY_WAIT_MS), f"{name}: two replies for one request"
        finally:
            dealer.close()
    huge = context.socket(zmq.DEALER)
    huge.setsockopt(zmq.LINGER, 0)
    try:
        huge.connect(endpoint)
        huge.send_multipart([b"", b"s" * HUGE_FRAME])
        assert_proper_reply(raw_snapshot(endpoint), publisher_id)
        assert not huge.poll(STRAY_WAIT_MS), "a reply to a huge frame"
    finally:
        huge.close()
    assert_proper_reply(raw_snapshot(endpoint), publisher_id)
    with daemon.client() as client:
        assert client.ping().endpoints[0].publisher_id == publisher_id
        stats = client.stats().ranks[0]
    # Only the proper requests count (a -2 answer, which raw_snapshot asks again after,
    # would count as one more).
    proper = len(BAD_REQUESTS) + 2
    assert stats.snapshot_requests == proper + stats.snapshots_unavailable


# -- g. the payload's 4th element ------------------------------------------------------------


class StrictBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """vLLM's KVEventBatch as a decoder that refuses anything after the rank."""

    ts: float
    events: list[Any]
    data_parallel_rank: int


class BatchWithId(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int
    publisher_id: msgspec.Raw


def live_payloads(daemon: Daemon, count: int) -> list[bytes]:
    """``count`` live payloads of rank 0 after storing a prompt (heartbeats and the store)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(rank_endpoint(daemon.events_endpoint, 0))
    payloads: list[bytes] = []
    try:
        assert sub.poll(int(HANG_S * 1000)), "no heartbeat"
        with daemon.client() as client:
            store_released(client, unique_prompt(2))
            client.snapshot()  # publishes the store
        while len(payloads) < count:
            assert sub.poll(int(HANG_S * 1000)), "the stream stopped"
            _, _, payload = sub.recv_multipart()
            payloads.append(payload)
    finally:
        sub.close()
    return payloads


def replayed_payloads(daemon: Daemon) -> list[bytes]:
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    return [payload for _, payload in replay(endpoint, daemon.first_seq(), timeout=20)]


def test_without_the_endpoint_payloads_stay_three_elements(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(events={"heartbeat_ms": HEARTBEAT_MS})
    payloads = live_payloads(daemon, 3) + replayed_payloads(daemon)
    assert any(msgpack.unpackb(payload)[1] for payload in payloads)  # the store is there
    for payload in payloads:
        msgspec.msgpack.decode(payload, type=StrictBatch)
    with daemon.client() as client:
        endpoints = client.ping().endpoints[0]
        stats = client.stats().ranks[0]
    assert (endpoints.snapshot, endpoints.publisher_id) == ("", b"")
    assert (stats.snapshot_endpoint, stats.publisher_id) == ("", b"")


def test_with_the_endpoint_live_and_replayed_payloads_carry_the_publisher_id(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon(events=snapshot_events())
    payloads = live_payloads(daemon, 3) + replayed_payloads(daemon)
    with daemon.client() as client:
        endpoints = client.ping().endpoints[0]
        stats = client.stats().ranks[0]
    publisher_id = endpoints.publisher_id
    assert len(publisher_id) == 16
    assert stats.publisher_id == publisher_id
    assert endpoints.snapshot == stats.snapshot_endpoint == f"{daemon.snapshot_endpoint}_dp0"
    assert any(msgpack.unpackb(payload)[1] for payload in payloads)
    for payload in payloads:
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(payload, type=StrictBatch)
        batch = msgspec.msgpack.decode(payload, type=BatchWithId)
        assert bytes(batch.publisher_id) == b"\xc4\x10" + publisher_id  # bin8 of 16 bytes
        assert batch.data_parallel_rank == 0


# -- one endpoint per rank -----------------------------------------------------------------


def test_each_rank_serves_its_own_snapshot_on_port_plus_rank(start_daemon: DaemonFactory) -> None:
    """Two ranks, a tcp snapshot endpoint: rank r's is the base port + r, each rank its own
    publisher_id and its own state."""
    (base,) = free_tcp_port_runs([2])
    daemon = start_daemon(
        events={
            "snapshot_endpoint": f"tcp://127.0.0.1:{base}",
            "heartbeat_ms": HEARTBEAT_MS,
            "buffer_steps": RING,
        },
        cache={"data_parallel_size": 2},
    )
    with daemon.client() as client:
        endpoints = client.ping().endpoints
        store_released(client, unique_prompt(2), rank=0)
        store_released(client, unique_prompt(3), rank=1)
    assert [e.snapshot for e in endpoints] == [
        f"tcp://127.0.0.1:{base}",
        f"tcp://127.0.0.1:{base + 1}",
    ]
    assert len({e.publisher_id for e in endpoints}) == 2
    for rank, blocks in ((0, 2), (1, 3)):
        with consumer_of(daemon, rank) as consumer:
            consumer.run_until(ready_of(consumer), what=f"rank {rank} ready")
            assert consumer.rank == rank
            assert consumer.publisher_id == endpoints[rank].publisher_id
            run = published(daemon, rank)
            consumer.run_until(caught_up(consumer, run.last_seq), what=f"rank {rank} caught up")
            assert consumer_view(consumer) == run.state
            assert len(consumer.index) == blocks


def test_a_replay_of_lost_history_starts_with_a_snapshot_batch_carrying_the_id(
    start_daemon: DaemonFactory,
) -> None:
    """The ring keeps 4 batches: a replay from the run's first seq starts with the batch that
    rebuilds the state (AllBlocksCleared, then the blocks), and it too carries the id."""
    daemon = start_daemon(events=snapshot_events(buffer_steps=4))
    with daemon.client() as client:
        for _ in range(12):
            store_released(client, unique_prompt(2))
            client.snapshot()  # each store a batch of its own
        publisher_id = client.ping().endpoints[0].publisher_id
    payloads = replayed_payloads(daemon)
    first = msgspec.msgpack.decode(payloads[0], type=BatchWithId)
    assert first.events[0] == {"type": "AllBlocksCleared"}
    assert len(first.events) > 1
    for payload in payloads:
        batch = msgspec.msgpack.decode(payload, type=BatchWithId)
        assert bytes(batch.publisher_id) == b"\xc4\x10" + publisher_id


def test_an_empty_cache_is_a_reply_without_chunks(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(events=snapshot_events())
    with daemon.client() as client:
        published_before = client.stats().ranks[0].seq
        publisher_id = client.ping().endpoints[0].publisher_id
    reply = raw_snapshot(snapshot_endpoint_of(daemon))
    assert len(reply) == 2, f"{len(reply) - 2} chunks for an empty cache"
    assert reply[1] == publisher_id
    assert int.from_bytes(reply[0], "big", signed=True) >= published_before >= 0


# -- seqs past the signed range --------------------------------------------------------------


def test_a_rank_whose_seqs_passed_the_signed_range_still_serves_snapshots(
    start_daemon: DaemonFactory,
) -> None:
    """The live seq is unsigned, the snapshot reply's signed: a run that would continue a seq
    beyond 2^63 - 1 must still let a consumer bootstrap (whatever seq it publishes then: it
    may as well start again at 0, as at the end of the unsigned space)."""
    daemon = start_daemon(events=snapshot_events())
    daemon.stop()
    last = (1 << 63) - 1
    state_file(daemon).write_bytes(MAGIC + struct.pack(">QQ", last, last ^ ((1 << 64) - 1)))
    daemon.start()
    with consumer_of(daemon, request_timeout_s=1.0) as consumer:
        consumer.run_until(lambda: consumer.ready, timeout_s=3.0, what="the bootstrap")


def test_a_req_with_a_long_routing_id_is_served(start_daemon: DaemonFactory) -> None:
    """A REQ sending one frame b"snapshot" is a proper request whatever routing id it set
    (ZeroMQ allows up to 255 bytes)."""
    daemon = start_daemon(events=snapshot_events())
    endpoint = snapshot_endpoint_of(daemon)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    req = context.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.ROUTING_ID, b"r" * 255)
    try:
        req.connect(endpoint)
        req.send(b"snapshot")
        # Served in milliseconds; a connection the daemon drops is retried for ever.
        assert req.poll(ROUTING_ID_WAIT_MS), "no reply to a REQ with a 255-byte routing id"
        assert_proper_reply(req.recv_multipart(), snapshot_publisher_id(daemon))
    finally:
        req.close()


ROUTING_ID_WAIT_MS = 3000


def snapshot_publisher_id(daemon: Daemon, rank: int = 0) -> bytes:
    with daemon.client() as client:
        return bytes(client.ping().endpoints[rank].publisher_id)


def test_late_join_to_a_full_large_cache_under_evictions(start_daemon: DaemonFactory) -> None:
    """A cache of 16k blocks, full, while a driver keeps storing (each store evicts): the
    consumer's snapshot takes many loop turns to build, blocks are removed meanwhile, and the
    index still ends exactly as published."""
    blocks = 16384
    daemon = start_daemon(events=snapshot_events(), cache={"num_blocks": blocks})
    with daemon.client(timeout=30) as client:
        for _ in range(blocks // 64):
            store_released(client, unique_prompt(64))
    driver = Driver(daemon, reset_every=1_000_000)
    driver.start()
    try:
        wait_for(lambda: driver.ops >= 10 or driver.error, what="the driver under way")
        with consumer_of(daemon) as consumer:
            consumer.run_until(lambda: consumer.ready, timeout_s=30, what="the bootstrap")
            assert consumer.counters.last_snapshot_chunks > 1
            applied = consumer.counters.applied_batches
            consumer.run_until(
                lambda: consumer.counters.applied_batches > applied + 20, what="following"
            )
            driver.stop()
            run = assert_follows(consumer, daemon)
            assert run.removed > 0
            assert (consumer.counters.bootstraps, dict(consumer.counters.resyncs)) == (1, {})
    finally:
        driver.stop()
