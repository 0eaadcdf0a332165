"""Seq origin, restarts and heartbeats, against a real daemon.

A run's seqs start at its origin (the wall clock in microseconds by default), so a restarted
daemon's seqs jump forward. A subscriber, with or without a control endpoint, must end with
the new run's exact state after kill -9 or SIGTERM and a new start, also when it was cut off
until the new run's seqs passed the old run's last (zero origin: only the overlap compared on
every repair shows it). An idle rank publishes empty batches, so a missed batch shows within
one heartbeat interval. The cut-off is a relay between the daemon's PUB and the subscriber
that the test can stop forwarding, as a network partition would."""

from __future__ import annotations

import copy
import signal
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from kvpubd.client import Subscriber
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import unpack_seq
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.mirrors import Record, pump, snapshot_blocks, store_released, unique_prompt
from tests.streams import seq_of

# Restarts by kill -9 and SIGTERM: processes.
pytestmark = pytest.mark.daemon_process

HEARTBEAT_MS = 200


class Relay(threading.Thread):
    """Forwards rank 0's live messages from the daemon to ``endpoint`` while ``open`` is set;
    drops them otherwise (what a subscriber cut off from the daemon misses)."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(daemon=True)
        self.endpoint = f"ipc://{daemon.dir}/relay"
        self.open = threading.Event()
        self.open.set()
        self.seen = -1  # the last seq that reached the relay (forwarded or dropped)
        self._halt = threading.Event()
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(rank_endpoint(daemon.events_endpoint, 0))
        self._pub = self._context.socket(zmq.PUB)
        self._pub.bind(rank_endpoint(self.endpoint, 0))

    def run(self) -> None:
        while not self._halt.is_set():
            if self._sub.poll(20):
                frames = self._sub.recv_multipart()
                self.seen = unpack_seq(frames[1])
                if self.open.is_set():
                    self._pub.send_multipart(frames)

    def close(self) -> None:
        self._halt.set()
        self.join()
        self._sub.close(linger=0)
        self._pub.close(linger=0)
        self._context.term()


@pytest.fixture
def relayed(start_daemon: DaemonFactory) -> Iterator[tuple[Daemon, Relay]]:
    daemon = start_daemon(events={"seq_origin": "zero", "heartbeat_ms": HEARTBEAT_MS})
    relay = Relay(daemon)
    relay.start()
    yield daemon, relay
    relay.close()


def follows(sub: Subscriber, daemon: Daemon) -> bool:
    """The subscriber holds exactly the daemon's current state, at its seq, by itself (only
    ``receive``: no catch-up asked by the test)."""
    with daemon.client() as client:
        snap = client.snapshot()
    mirror = sub.mirror(0)
    return (
        sub.last_seq(0) == snap.seq
        and sub.synced(0)
        and mirror is not None
        and mirror.blocks == snapshot_blocks(snap)
    )


def go_live_quietly(sub: Subscriber, daemon: Daemon) -> None:
    """Catch up, then receive until a heartbeat arrives live (the SUB is connected)."""
    sub.catch_up()
    before = sub.rank_counters(0).batches
    pump(sub, lambda: sub.rank_counters(0).batches > before, what="a live heartbeat")
    assert follows(sub, daemon)


# -- seq origin -------------------------------------------------------------------------------


def test_clock_origin_starts_each_run_above_the_last(start_daemon: DaemonFactory) -> None:
    """The first seq is the wall clock in microseconds at start; a restarted daemon's first
    seq lies above everything the last run published."""
    before = time.time_ns() // 1000
    daemon = start_daemon(events={"seq_origin": "clock"})
    after = time.time_ns() // 1000
    first = daemon.first_seq()
    assert before <= first <= after
    with daemon.client() as client:
        for _ in range(5):
            store_released(client, unique_prompt(1))
        last = client.snapshot().seq
    assert last > first
    daemon.stop(signal.SIGKILL)
    daemon.start()
    assert daemon.first_seq() > last


@pytest.mark.parametrize("how", ["kill9", "sigterm"])
def test_continue_origin_carries_the_seqs_across_restarts(
    start_daemon: DaemonFactory, how: str
) -> None:
    """The default: a first run starts at 0, and each later run's first batch (its start-up
    marker) is the last run's last seq + 1, after kill -9 as after SIGTERM."""
    daemon = start_daemon(events={"seq_origin": "continue"})
    assert daemon.first_seq() == 0
    for _ in range(2):
        with daemon.client() as client:
            for _ in range(3):
                store_released(client, unique_prompt(1))
            last = client.snapshot().seq
        daemon.stop(signal.SIGKILL if how == "kill9" else signal.SIGTERM)
        daemon.start()
        assert daemon.first_seq() == last + 1
    with Subscriber(daemon.events_endpoint, daemon.replay_endpoint) as sub:
        marker = sub.catch_up()[-1]
    assert marker.seq == last + 1


def raw_replay(daemon: Daemon, start: int) -> list[tuple[int, list[object]]]:
    """(seq, events) of every batch a plain DEALER's replay from ``start`` returns."""
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rank_endpoint(daemon.replay_endpoint, 0))
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: list[tuple[int, list[object]]] = []
    try:
        while dealer.poll(10_000):
            _, _, seq, payload = dealer.recv_multipart()
            if not payload:
                return got
            got.append((unpack_seq(seq), msgpack.unpackb(payload)[1]))
    finally:
        dealer.close()
    raise AssertionError("no end marker")


def test_a_continued_run_replays_the_empty_batches_below_its_first_seq(
    start_daemon: DaemonFactory,
) -> None:
    """buffer_steps 4: after a restart, a replay from 0 (history of no run the ring holds)
    gets what the ring holds, the empty batches the new run keeps below its first seq (3 of
    them: the ring's 4th slot holds its start-up marker), not a snapshot batch."""
    daemon = start_daemon(events={"seq_origin": "continue", "buffer_steps": 4})
    with daemon.client() as client:
        for _ in range(6):
            store_released(client, unique_prompt(1))
            client.snapshot()  # each store its own batch
    daemon.stop(signal.SIGKILL)
    daemon.start()
    first = daemon.first_seq()
    replayed = raw_replay(daemon, 0)
    assert [seq for seq, _ in replayed] == list(range(first - 3, first + 1))
    assert [events for _, events in replayed[:3]] == [[]] * 3
    assert len(replayed[-1][1]) == 1  # the start-up marker: AllBlocksCleared alone


def test_zero_origin_starts_each_run_at_zero(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(events={"seq_origin": "zero"})
    assert daemon.first_seq() == 0
    with Subscriber(daemon.events_endpoint, daemon.replay_endpoint) as sub:
        assert [b.seq for b in sub.catch_up()] == [0]


# -- restarts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("control", [True, False], ids=["control", "no-control"])
@pytest.mark.parametrize("how", ["kill9", "sigterm"])
def test_subscriber_follows_a_restart(start_daemon: DaemonFactory, how: str, control: bool) -> None:
    """kill -9 (or SIGTERM) and a new start on the same endpoints, nothing stored since: the
    subscriber, reading only, drops the old run's blocks (the heartbeat reveals the new run)
    and then follows the new run's stores."""
    daemon = start_daemon(events={"heartbeat_ms": HEARTBEAT_MS})
    record = Record()
    with daemon.subscriber(
        control=daemon.control_endpoint if control else None,
        replay_timeout=0.5,
        control_timeout=0.5,
        **record.callbacks(),
    ) as sub:
        with daemon.client() as client:
            store_released(client, unique_prompt(3))
        go_live_quietly(sub, daemon)
        assert len(sub.mirror(0).blocks) == 3  # type: ignore[union-attr]
        daemon.stop(signal.SIGKILL if how == "kill9" else signal.SIGTERM)
        daemon.start()
        pump(sub, lambda: follows(sub, daemon), what="the new run's (empty) state")
        with daemon.client() as client:
            store_released(client, unique_prompt(2))
        pump(sub, lambda: follows(sub, daemon), what="the new run's store")
        counters = sub.rank_counters(0)
    assert (counters.lost, counters.violations) == (0, 0)
    # With control the epoch names the restart; without it the repair's replay from the last
    # seq applied finds another payload there (the new run keeps empty batches below its first
    # seq, its seqs continuing the old run's). Either way the mirror was rebuilt once.
    assert counters.restarts == 1
    assert counters.resyncs == len(record.resyncs) == 1


def test_restart_hidden_by_a_cut_off_is_found_by_the_overlap(
    relayed: tuple[Daemon, Relay],
) -> None:
    """Issue 10 row 10: without control and with the zero origin, the subscriber is cut off
    while the daemon restarts and until the new run's seqs pass the old run's last. The repair
    replays from ``last``: the new run's batch there is not the one applied, so the restart is
    found, and the mirror ends as the new run's state (not the old blocks plus the new)."""
    daemon, relay = relayed
    record = Record()
    with Subscriber(relay.endpoint, daemon.replay_endpoint, **record.callbacks()) as sub:
        with daemon.client() as client:
            for _ in range(3):
                store_released(client, unique_prompt(2))
        go_live_quietly(sub, daemon)
        old_last = sub.last_seq(0)
        assert old_last is not None
        relay.open.clear()
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with daemon.client() as client:
            while (seq := client.snapshot().seq) <= old_last + 3:  # one batch each
                store_released(client, unique_prompt(1))
        wait_for(lambda: relay.seen >= seq, what="the relay to drop the new run's batches")
        relay.open.set()
        pump(sub, lambda: follows(sub, daemon), what="the new run's state")
        counters = sub.rank_counters(0)
    assert counters.restarts == 1, record.restarts
    assert "another payload" in record.restarts[0][1]
    assert (counters.lost, counters.violations) == (0, 0)


# -- heartbeats -------------------------------------------------------------------------------


def test_a_subscriber_joining_an_idle_daemon_hears_a_heartbeat(
    start_daemon: DaemonFactory,
) -> None:
    """Nothing is published after start-up; a SUB socket that connects still receives a batch:
    ``[ts, [], rank]`` with the next seq, kept for replay and counted as a batch."""
    daemon = start_daemon(events={"heartbeat_ms": HEARTBEAT_MS})
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(rank_endpoint(daemon.events_endpoint, 0))
    try:
        assert sock.poll(10_000), "no heartbeat"
        topic, seq_frame, payload = sock.recv_multipart()
    finally:
        sock.close()
    seq = unpack_seq(seq_frame)
    ts, events, rank = msgpack.unpackb(payload)
    assert (topic, events, rank) == (b"", [], 0) and isinstance(ts, float)
    assert seq > daemon.first_seq()
    with daemon.client() as client:
        stats = client.stats().ranks[0]
    assert stats.batches_published == stats.seq - stats.first_seq + 1 >= 2
    with Subscriber(daemon.events_endpoint, daemon.replay_endpoint) as sub:
        replayed = {b.seq: b.payload for b in sub.catch_up()}
    assert replayed[seq] == payload


def test_a_heartbeat_reveals_a_missed_reset_marker(relayed: tuple[Daemon, Relay]) -> None:
    """The reset marker is dropped on its way to the subscriber and nothing else is published:
    the next heartbeat shows the gap, and the repair empties the mirror, with no catch-up or
    idle check asked for."""
    daemon, relay = relayed
    with Subscriber(relay.endpoint, daemon.replay_endpoint) as sub:
        with daemon.client() as client:
            store_released(client, unique_prompt(2))
            go_live_quietly(sub, daemon)
            # (A heartbeat sent before the SUB was connected may already have made a gap.)
            before = copy.copy(sub.rank_counters(0))
            relay.open.clear()
            marker = seq_of(client.reset().markers[0])
            wait_for(lambda: relay.seen >= marker, what="the relay to drop the marker")
            relay.open.set()
        pump(sub, lambda: (sub.last_seq(0) or 0) > marker, what="the heartbeat after the reset")
        assert sub.mirror(0).blocks == {}  # type: ignore[union-attr]
        assert follows(sub, daemon)
        counters = sub.rank_counters(0)
    assert counters.gaps - before.gaps == counters.gaps_repaired - before.gaps_repaired == 1
