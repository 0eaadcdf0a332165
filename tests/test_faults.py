"""Faults a subscriber must survive without losing state, against a real daemon subprocess:
a consumer that stalls (the PUB drops its messages), history the replay buffer no longer holds,
kill -9 and restart, SIGTERM under load, and a randomized soak with three subscribers on two
ranks. The oracle is always the daemon itself: each mirror must equal ``snapshot`` at the same
seq, and the batches delivered must be the published ones, each exactly once.

Run with ``-s`` to see what each fault cost (lines starting with ``fault:``)."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpubd.client import ControlClient, ControlError, replay
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockStored, decode_batch
from tests.conftest import DaemonFactory
from tests.daemon import wait_for
from tests.mirrors import (
    FORMS,
    AnySubscriber,
    Loader,
    Record,
    assert_mirror_is_snapshot,
    go_live,
    pump,
    store_released,
    subscriber,
    unique_prompt,
)
from tests.streams import chain_hashes

# A stalled consumer: ~1500 stores of 8 blocks publish several hundred batches (one per 1 ms
# tick), several times what the SUB socket (rcvhwm 2), the PUB (hwm 2) and the kernel buffers
# between them can hold.
STALL_STORES = 1500
STALL_BLOCKS = 8
SMALL_QUEUES = {"hwm": 2, "tick_interval_ms": 1}


def report(fault: str, **numbers: object) -> None:
    print(f"\nfault: {fault}: " + ", ".join(f"{k}={v}" for k, v in numbers.items()))


def stall_then_read(sub: AnySubscriber, client: ControlClient, rank: int = 0) -> None:
    """Store while the subscriber does not read; then read while a few more stores go out, so
    a later live batch reveals whatever the PUB dropped."""
    for _ in range(STALL_STORES):
        store_released(client, unique_prompt(STALL_BLOCKS), rank)
    for _ in range(50):
        store_released(client, unique_prompt(1), rank)
        sub.receive(0.002)


@pytest.mark.parametrize("form", FORMS)
def test_slow_subscriber_repairs_every_gap_by_replay(
    start_daemon: DaemonFactory, form: str
) -> None:
    """With small high-water marks a stalled consumer loses batches at the PUB; the subscriber
    sees the gaps, replays every missing batch, delivers each seq exactly once, and its mirror
    equals the snapshot."""
    daemon = start_daemon(events=SMALL_QUEUES, cache={"num_blocks": 4096})
    record = Record()
    sub = subscriber(form, daemon, record, rcvhwm=2)
    try:
        with daemon.client() as client:
            go_live(sub, client, [0])
            live_before = sum(not b.replayed for b in record.batches[0])
            stall_then_read(sub, client)
            assert_mirror_is_snapshot(sub, client, [0])
        counters = sub.rank_counters(0)
        last = sub.last_seq(0)
    finally:
        sub.close()
    assert counters.gaps >= 1, "the stall lost nothing at the PUB: the test proves nothing"
    assert counters.gaps_repaired == counters.gaps == len(record.gaps)
    assert (counters.resyncs, counters.restarts, counters.lost) == (0, 0, 0)
    assert (counters.violations, counters.malformed) == (0, 0)
    assert record.seqs(0) == record.run_seqs(0, last), "a batch was skipped or delivered twice"
    live = sum(not b.replayed for b in record.batches[0]) - live_before
    report(
        f"slow subscriber ({form})",
        published=len(record.run_seqs(0, last)),
        dropped_at_pub_and_replayed=counters.replayed,
        live=live,
        gaps=counters.gaps,
        lost=counters.lost,
    )


@pytest.mark.parametrize("form", FORMS)
def test_history_gone_resyncs_from_snapshot(start_daemon: DaemonFactory, form: str) -> None:
    """With a replay buffer of 4 batches (and no snapshot batch on replay), a long stall leaves
    a hole replay cannot fill: the subscriber resynchronises from the control snapshot
    (on_resync), never applies a batch twice, and its mirror equals the snapshot."""
    daemon = start_daemon(
        events={**SMALL_QUEUES, "buffer_steps": 4, "replay_snapshot": False},
        cache={"num_blocks": 4096},
    )
    record = Record()
    sub = subscriber(form, daemon, record, rcvhwm=2)
    try:
        with daemon.client() as client:
            go_live(sub, client, [0])
            stall_then_read(sub, client)
            assert_mirror_is_snapshot(sub, client, [0])
        counters = sub.rank_counters(0)
        last = sub.last_seq(0)
    finally:
        sub.close()
    assert counters.resyncs >= 1 and len(record.resyncs) == counters.resyncs
    assert (counters.restarts, counters.lost, counters.violations) == (0, 0, 0)
    seqs = record.seqs(0)
    assert seqs == sorted(set(seqs)), "a batch was delivered twice or out of order"
    assert last is not None
    report(
        f"history gone ({form})",
        published=len(record.run_seqs(0, last)),
        delivered=len(seqs),
        covered_by_snapshot=last + 1 - len(seqs),
        resyncs=counters.resyncs,
        lost_state="none (mirror == snapshot)",
    )


def test_history_gone_without_control_is_lost_until_the_next_reset(
    start_daemon: DaemonFactory,
) -> None:
    """Without a control endpoint a hole replay cannot fill (a daemon that does not answer with
    a snapshot batch) is counted as lost and the mirror is marked unsynced; the next
    AllBlocksCleared makes it exact again."""
    daemon = start_daemon(
        events={**SMALL_QUEUES, "buffer_steps": 4, "replay_snapshot": False},
        cache={"num_blocks": 4096},
    )
    sub = subscriber("sync", daemon, control=None, rcvhwm=2)
    try:
        with daemon.client() as client:
            go_live(sub, client, [0])
            stall_then_read(sub, client)
            pump(sub, lambda: sub.rank_counters(0).lost > 0, what="the hole to be counted")
            assert not sub.synced(0)
            client.reset()
            store_released(client, unique_prompt(3))
            assert_mirror_is_snapshot(sub, client, [0])
        counters = sub.rank_counters(0)
    finally:
        sub.close()
    assert counters.resyncs == 0 and counters.restarts == 0


@pytest.mark.parametrize("control", [False, True])
def test_history_gone_is_rebuilt_by_the_replay_snapshot_batch(
    start_daemon: DaemonFactory, control: bool
) -> None:
    """The daemon answers a replay of history it no longer holds with one batch: the marker
    and the whole cache. With or without a control endpoint the subscriber loses nothing and
    its mirror equals the snapshot."""
    daemon = start_daemon(events={**SMALL_QUEUES, "buffer_steps": 4}, cache={"num_blocks": 4096})
    sub = subscriber("sync", daemon, control=daemon.control_endpoint if control else None, rcvhwm=2)
    try:
        with daemon.client() as client:
            go_live(sub, client, [0])
            stall_then_read(sub, client)
            assert_mirror_is_snapshot(sub, client, [0])
            assert sub.synced(0)
        counters = sub.rank_counters(0)
    finally:
        sub.close()
    assert counters.gaps >= 1  # the stall did lose batches at the PUB
    assert counters.resyncs >= 1  # the mirror was replaced by the replay's snapshot batch
    assert (counters.lost, counters.restarts, counters.violations) == (0, 0, 0)


@pytest.mark.daemon_process
def test_lost_history_replays_finish_under_steady_load(start_daemon: DaemonFactory) -> None:
    """Replays of lost history while stores go on, with a ring of 2 batches: each snapshot
    batch takes many ticks to put together, and the ring keeps what follows it meanwhile, so
    every replay gets one snapshot batch, then every batch after it, then the end marker (with
    a ring that moved on it could never catch up, and a stale snapshot batch would leave a
    gap). The daemon logs no error."""
    daemon = start_daemon(
        events={"buffer_steps": 2, "tick_interval_ms": 1}, cache={"num_blocks": 16384}
    )
    with daemon.client(timeout=20) as client:
        for _ in range(12):
            store_released(client, unique_prompt(1000))
    endpoint = rank_endpoint(daemon.replay_endpoint, 0)
    loader = Loader(daemon.control_endpoint, ranks=[0], blocks=1)
    loader.start()
    try:
        wait_for(lambda: len(loader.acked) > 10, what="load")
        answers = [replay(endpoint, 0, timeout=30) for _ in range(5)]
        answers += concurrent_batches(endpoint, 10)
        assert len(loader.acked) > 20  # the load went on all along
    finally:
        loader.stop()
    for batches in answers:
        seqs = [seq for seq, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        events = [decode_batch(payload).events for _, payload in batches]
        assert events[0][0] == AllBlocksCleared() and len(events[0]) > 12_000
        assert all(AllBlocksCleared() not in later for later in events[1:])
    assert daemon.alive()
    assert "Traceback" not in daemon.log()


def concurrent_batches(endpoint: str, clients: int) -> list[list[tuple[int, bytes]]]:
    """``clients`` replays from seq 0 at once, each in its own thread."""
    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda _: replay(endpoint, 0, timeout=30), range(clients)))


@pytest.mark.daemon_process
@pytest.mark.parametrize("form", FORMS)
def test_kill9_and_restart_under_load(start_daemon: DaemonFactory, form: str) -> None:
    """kill -9 while a load runs on rank 0, then a new daemon on the same endpoints: the
    subscriber detects the restart on both ranks (rank 1 is idle: only the epoch tells), drops
    their state once each, and its mirrors equal the new daemon's snapshots."""
    daemon = start_daemon(
        cache={"data_parallel_size": 2, "num_blocks": 1024}, events={"tick_interval_ms": 2}
    )
    record = Record()
    sub = subscriber(form, daemon, record, replay_timeout=0.5, control_timeout=0.5)
    loader = Loader(daemon.control_endpoint, ranks=[0])
    try:
        with daemon.client() as client:
            go_live(sub, client, [0, 1])
        first_epoch = sub.epoch
        loader.start()
        pump(sub, lambda: len(record.batches[0]) >= 50, what="load before the kill")
        assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
        applied_before = sub.last_seq(0)
        assert applied_before is not None
        with pytest.raises(TimeoutError):  # nobody answers now; the next call asks again
            sub.catch_up()
        daemon.start()  # same config, same endpoints: a new run
        timeouts = pump(
            sub,
            lambda: (
                all(sub.rank_counters(r).restarts for r in (0, 1)) and (sub.last_seq(0) or 0) >= 20
            ),
            what="the restart to be detected on both ranks",
        )
        loader.stop()
        with daemon.client() as client:
            assert_mirror_is_snapshot(sub, client, [0, 1])
        counters = [sub.rank_counters(r) for r in (0, 1)]
    finally:
        loader.stop()
        sub.close()
    assert sub.epoch == daemon.epoch != first_epoch
    for rank, c in enumerate(counters):
        assert c.restarts == 1, f"rank {rank}: {record.restarts}"
        assert (c.lost, c.violations) == (0, 0)
    assert sorted(r for r, _ in record.restarts) == [0, 1]
    report(
        f"kill -9 and restart ({form})",
        old_run_batches_applied=applied_before + 1,
        stores_acked=len(loader.acked),
        store_failures_while_down=loader.failures,
        subscriber_timeouts_while_down=timeouts,
        restarts=[c.restarts for c in counters],
        lost_state="none (mirror == new snapshot)",
    )


@pytest.mark.daemon_process
@pytest.mark.parametrize("origin", ["clock", "zero"])
def test_kill9_and_restart_detected_without_control(
    start_daemon: DaemonFactory, origin: str
) -> None:
    """Without a control endpoint the restart shows in the seqs alone. With the clock origin
    the new run's seqs jump forward and the repair lands on its start-up marker, from which the
    mirror is rebuilt; with the zero origin its live seqs start again below the last live seq
    of the old run. Either way the mirror follows the new run."""
    daemon = start_daemon(
        events={"tick_interval_ms": 2, "seq_origin": origin}, cache={"num_blocks": 1024}
    )
    record = Record()
    sub = subscriber("sync", daemon, record, control=None, replay_timeout=0.5)
    loader = Loader(daemon.control_endpoint, ranks=[0])
    try:
        with daemon.client() as client:
            go_live(sub, client, [0])
        loader.start()
        # Far more batches than the new run can publish before the SUB reconnects to it.
        pump(sub, lambda: len(record.batches[0]) >= 300, what="load before the kill")
        daemon.stop(signal.SIGKILL)
        daemon.start()
        pump(
            sub,
            lambda: sub.rank_counters(0).restarts + sub.rank_counters(0).resyncs >= 1,
            what="the restart to be detected",
        )
        applied = len(record.batches[0])
        pump(sub, lambda: len(record.batches[0]) >= applied + 20, what="the new run's load")
        loader.stop()
        with daemon.client() as client:
            assert_mirror_is_snapshot(sub, client, [0])
        counters = sub.rank_counters(0)
    finally:
        loader.stop()
        sub.close()
    assert (counters.lost, counters.violations) == (0, 0)
    if origin == "zero":
        assert counters.restarts == 1 and "went back" in record.restarts[0][1]
    else:
        assert (counters.restarts, counters.resyncs) == (0, 1)


@pytest.mark.daemon_process
def test_sigterm_under_load_delivers_everything_captured(start_daemon: DaemonFactory) -> None:
    """SIGTERM while a load runs: the daemon exits 0 and every store it acknowledged (so
    captured before it stopped taking requests) reaches the subscriber, on gap-free seqs."""
    daemon = start_daemon(events={"tick_interval_ms": 2}, cache={"num_blocks": 4096})
    record = Record()
    sub = subscriber("sync", daemon, record)
    loader = Loader(daemon.control_endpoint, ranks=[0])
    loader.stop_when_failing = True
    try:
        with daemon.client() as client:
            go_live(sub, client, [0])
        loader.start()
        pump(sub, lambda: len(record.batches[0]) >= 200, what="load before the signal")
        proc = daemon.proc
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
        pump(sub, lambda: proc.poll() is not None, what="the daemon to exit")
        loader.stop()
        wanted = {chain_hashes(tokens)[0] for _, tokens in loader.acked}

        def stored() -> set[BlockHash]:
            return {
                e.block_hashes[0]
                for b in record.batches[0]
                for e in b.batch.events
                if isinstance(e, BlockStored)
            }

        # Whatever is still on its way arrives now; nothing can be replayed any more.
        deadline = time.monotonic() + 5.0
        while not wanted <= stored() and time.monotonic() < deadline:
            sub.receive(0.05)
        counters = sub.rank_counters(0)
    finally:
        loader.stop()
        sub.close()
    assert daemon.stop() == 0
    missing = wanted - stored()
    assert not missing, f"{len(missing)} of {len(wanted)} acknowledged stores never arrived"
    assert record.seqs(0) == record.run_seqs(0)
    assert (counters.lost, counters.violations) == (0, 0)
    report(
        "SIGTERM under load",
        stores_acked=len(wanted),
        received=len(wanted & stored()),
        lost=len(missing),
        batches=counters.batches,
    )


# -- soak ------------------------------------------------------------------------------------

FAMILIES = [[family * 1000 + i for i in range(8 * 16)] for family in range(4)]


def soak(start_daemon: DaemonFactory, seconds: float, seed: int) -> None:
    """Random stores (shared prefixes, LoRA ids), releases and resets on two ranks, with three
    subscribers: one following both ranks and reading after every operation, one following
    rank 1 and reading rarely through tiny queues (so the PUB drops its batches and replay
    repairs them), and one asyncio subscriber without control. At the end every mirror equals
    the snapshot and every subscriber delivered exactly the published batches."""
    daemon = start_daemon(
        cache={"data_parallel_size": 2, "num_blocks": 256},
        events={"hwm": 20, "tick_interval_ms": 2},
    )
    rng = random.Random(seed)
    records = [Record(), Record(), Record()]
    followed = [[0, 1], [1], [0, 1]]
    # The second stalls for ~1000 operations (about half a second), then reads for a while,
    # as a router that was busy elsewhere would.
    read_every = [1, 1000, 5]
    read_calls = [1, 20, 1]
    subs = [
        subscriber("sync", daemon, records[0]),
        subscriber("sync", daemon, records[1], ranks=[1], rcvhwm=2),
        subscriber("async", daemon, records[2], control=None),
    ]
    open_requests: dict[str, int] = {}
    operations = {"store": 0, "release": 0, "reset": 0, "refused": 0}
    try:
        with daemon.client() as client:
            for sub, ranks in zip(subs, followed, strict=True):
                go_live(sub, client, ranks)
            deadline = time.monotonic() + seconds
            n = 0
            while time.monotonic() < deadline:
                n += 1
                roll = rng.random()
                if roll < 0.6:
                    rank = rng.randrange(2)
                    family = rng.choice(FAMILIES)
                    tokens = family[: 16 * rng.randint(1, 8)] + [
                        rng.randrange(1, 50) for _ in range(rng.randint(0, 40))
                    ]
                    request_id = f"soak-{n}"
                    try:
                        client.store(
                            request_id, tokens, rank=rank, lora_id=rng.choice([None, None, 7])
                        )
                        open_requests[request_id] = rank
                        operations["store"] += 1
                    except ControlError as exc:
                        assert exc.code == "pool_exhausted", exc
                        operations["refused"] += 1
                elif roll < 0.93 and open_requests:
                    request_id = rng.choice(list(open_requests))
                    client.release(request_id)
                    del open_requests[request_id]
                    operations["release"] += 1
                elif roll >= 0.93:
                    reset_rank = rng.choice([0, 1, None])
                    client.reset(reset_rank, force=True)  # force drops the open requests it pins
                    for request_id, r in list(open_requests.items()):
                        if reset_rank is None or r == reset_rank:
                            del open_requests[request_id]
                    operations["reset"] += 1
                for sub, every, calls in zip(subs, read_every, read_calls, strict=True):
                    if n % every == 0:
                        for _ in range(calls):
                            sub.receive(0.005 if calls > 1 else 0)
            for request_id in open_requests:
                client.release(request_id)
            for sub, ranks in zip(subs, followed, strict=True):
                assert_mirror_is_snapshot(sub, client, ranks)
            stats = {r.rank: r for r in client.stats().ranks}
        for i, (sub, record, ranks) in enumerate(zip(subs, records, followed, strict=True)):
            for rank in ranks:
                c = sub.rank_counters(rank)
                published = stats[rank]
                every_seq = range(published.first_seq, published.seq + 1)
                assert record.seqs(rank) == list(every_seq), (
                    f"subscriber {i} rank {rank}: a batch was lost or delivered twice"
                )
                assert c.events == published.events_published
                assert (c.lost, c.violations, c.resyncs, c.restarts) == (0, 0, 0, 0)
        slow = subs[1].counters
        assert slow.gaps_repaired == slow.gaps >= 1, "the stalled subscriber lost nothing"
        report(
            f"soak {seconds:.0f} s",
            **operations,
            batches={r: stats[r].batches_published for r in (0, 1)},
            gaps_repaired=[s.counters.gaps_repaired for s in subs],
            duplicates=[s.counters.duplicates for s in subs],
            gaps=[s.counters.gaps for s in subs],
            replayed=[s.counters.replayed for s in subs],
            lost=[s.counters.lost for s in subs],
        )
    finally:
        for sub in subs:
            sub.close()


@pytest.mark.slow
def test_soak_ci(start_daemon: DaemonFactory) -> None:
    """The soak, CI-sized (about 12 s of load)."""
    soak(start_daemon, seconds=12.0, seed=4)


LONG_SOAK_SECONDS = float(os.environ.get("KVPUBD_SOAK_SECONDS", "300"))


@pytest.mark.long
@pytest.mark.timeout(LONG_SOAK_SECONDS + 120)
def test_soak_long(start_daemon: DaemonFactory) -> None:
    """The soak for minutes (KVPUBD_SOAK_SECONDS, default 300)."""
    soak(start_daemon, seconds=LONG_SOAK_SECONDS, seed=5)
