"""A service of rank processes (``service.rank_processes``), against the real daemon: one
parent owning the control socket, one worker process per rank. Clients see one daemon; a
worker that dies or hangs is started again (its seqs go on, its first batch is
AllBlocksCleared) or stops the service by the restart policy; SIGTERM publishes every rank's
captured events; nothing is left behind (socket files, shared memory, the private directory),
however the service ends."""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvpubd.client import ControlClient, ControlError
from kvpubd.daemon.pool import pool_segment_name
from kvpubd.protocol.endpoints import default_runtime_dir, rank_endpoint
from kvpubd.protocol.wire import unpack_seq
from kvpubd.tools.launcher import free_tcp_ports
from tests.daemon import Daemon, wait_for
from tests.streams import packed_prompt, prompt
from tests.test_metrics import samples, scrape, value

pytestmark = pytest.mark.daemon_process

RANKS = 2
Batch = tuple[int, list[Any]]  # (seq, events as decoded maps)


def service(tmp_overrides: dict[str, dict[str, Any]] | None = None) -> Daemon:
    overrides: dict[str, dict[str, Any]] = {
        "cache": {"data_parallel_size": RANKS},
        "service": {"rank_processes": "on"},
    }
    for section, values in (tmp_overrides or {}).items():
        overrides.setdefault(section, {}).update(values)
    return Daemon(overrides)


@pytest.fixture
def started() -> Iterator[Daemon]:
    daemon = service().start(timeout=60)
    try:
        yield daemon
    finally:
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()


class RankStream:
    """One rank's live batches, from a SUB socket joined before anything the test checks."""

    def __init__(self, daemon: Daemon, rank: int, context: zmq.Context[zmq.Socket[bytes]]):
        self.rank = rank
        self.sock = context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(rank_endpoint(daemon.events_endpoint, rank))
        self.batches: list[Batch] = []

    def join(self, client: ControlClient) -> None:
        """Reset the rank until a marker arrives: from then on nothing is missed."""

        def marker_seen() -> bool:
            client.reset(rank=self.rank, force=True)
            return self.sock.poll(50) != 0

        wait_for(marker_seen, timeout=20, what=f"rank {self.rank}'s first batch")
        self.batches.clear()
        self.drain()

    def drain(self, wait_ms: int = 0) -> list[Batch]:
        got: list[Batch] = []
        while self.sock.poll(wait_ms):
            _, seq, payload = self.sock.recv_multipart()
            got.append((unpack_seq(seq), msgpack.unpackb(payload)[1]))
            wait_ms = 0
        self.batches += got
        return got

    def until(self, predicate: Callable[[list[Batch]], bool], what: str) -> list[Batch]:
        def seen() -> bool:
            self.drain(20)
            return predicate(self.batches)

        wait_for(seen, timeout=20, what=f"rank {self.rank}: {what}")
        return self.batches


def replay(
    daemon: Daemon, rank: int, start: int, context: zmq.Context[zmq.Socket[bytes]]
) -> list[Batch]:
    """The batches the rank's replay socket holds from ``start`` on."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rank_endpoint(daemon.replay_endpoint, rank))
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    batches: list[Batch] = []
    while True:
        assert sock.poll(10_000), "no replay reply"
        _, _, seq, payload = sock.recv_multipart()
        if not payload:
            sock.close()
            return batches
        batches.append((unpack_seq(seq), msgpack.unpackb(payload)[1]))


def kinds(batches: list[Batch]) -> list[str]:
    return [event["type"] for _, events in batches for event in events]


def workers(daemon: Daemon) -> dict[int, int]:
    """Rank -> pid of its worker, from the service's log (the last start of each)."""
    pids: dict[int, int] = {}
    for line in daemon.log().splitlines():
        if ": worker pid " in line:
            head, _, tail = line.partition(": worker pid ")
            rank = int(head.rpartition("rank ")[2])
            pids[rank] = int(tail.partition(";")[0])
    return pids


def shm_segments(daemon: Daemon) -> set[str]:
    """The daemon's pool segments that exist now."""
    shm = Path("/dev/shm")
    names = {pool_segment_name(daemon.control_endpoint, rank) for rank in range(RANKS)}
    return {name for name in names if (shm / name).exists()}


def test_one_service_answers_for_every_rank(started: Daemon) -> None:
    daemon = started
    with daemon.client() as client:
        ping = client.ping()
        assert ping.ranks == RANKS
        assert [e.rank for e in ping.endpoints] == [0, 1]
        assert [e.events for e in ping.endpoints] == [
            rank_endpoint(daemon.events_endpoint, r) for r in range(RANKS)
        ]
        pids = workers(daemon)
        assert sorted(pids) == [0, 1] and len(set(pids.values())) == 2
        assert daemon.proc is not None and daemon.proc.pid not in pids.values()

        tokens = prompt(1, 3)
        first = client.store("a", tokens, rank=1)
        assert first.rank == 1 and len(first.block_ids) == 3
        # Request ids are unique across ranks, though each rank lives in its own process.
        with pytest.raises(ControlError) as duplicate:
            client.store("a", tokens, rank=0)
        assert duplicate.value.code == "duplicate_request"
        # A reset of every rank is refused for the open request of one, and resets none.
        before = [r.resets for r in client.stats().ranks]
        with pytest.raises(ControlError) as busy:
            client.reset()
        assert busy.value.code == "busy" and "rank(s) 1" in busy.value.message
        assert [r.resets for r in client.stats().ranks] == before
        assert client.release("a").released == 3
        with pytest.raises(ControlError) as unknown:
            client.release("a")
        assert unknown.value.code == "unknown_request"
        stats = client.stats()
        assert [r.rank for r in stats.ranks] == [0, 1]
        assert stats.ranks[1].blocks_cached == 3 and stats.ranks[0].blocks_cached == 0
        assert stats.epoch == ping.epoch
        snapshot = client.snapshot(rank=1)
        assert len(snapshot.events) == 3
        with pytest.raises(ControlError) as unserved:
            client.store("b", tokens, rank=RANKS)
        assert unserved.value.code == "bad_request"
        assert client.pause().paused and client.stats().paused
        assert not client.resume().paused


def test_a_reset_of_every_rank_is_on_each_ranks_wire_before_it_returns(started: Daemon) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with started.client() as client:
            streams = [RankStream(started, r, context) for r in range(RANKS)]
            for stream in streams:
                stream.join(client)
            client.pause()  # nothing goes out by the periodic drain: only the reset sends
            for rank in range(RANKS):
                client.store(f"r{rank}", prompt(10 + rank, 2), rank=rank)
                client.release(f"r{rank}")
            markers = client.reset().markers
            assert [m.rank for m in markers] == [0, 1]
            for stream, marker in zip(streams, markers, strict=True):
                # Already there: the reply came after each worker handed its marker to ZeroMQ.
                got = stream.drain(wait_ms=2000)
                assert got, f"rank {stream.rank}: nothing published"
                assert got[-1][0] == marker.seq
                assert kinds(got)[-2:] == ["BlockStored", "AllBlocksCleared"]
    finally:
        context.destroy(linger=0)


def test_a_killed_worker_is_started_again_and_its_seqs_go_on(started: Daemon) -> None:
    daemon = started
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with daemon.client() as client:
            streams = [RankStream(daemon, r, context) for r in range(RANKS)]
            for stream in streams:
                stream.join(client)
            client.store("kept", prompt(20, 2), rank=0)
            client.store("lost", prompt(21, 2), rank=1)
            last = [
                s.until(lambda b: "BlockStored" in kinds(b), "the store")[-1][0] for s in streams
            ]
            old = workers(daemon)
            os.kill(old[1], signal.SIGKILL)

            wait_for(lambda: workers(daemon).get(1) not in (None, old[1]), 30, "a new worker")
            # seq_origin "continue": the new run's first batch is the next seq, no gap, no
            # reuse; its marker may have gone out before the SUB reconnected: replay has it.
            first = wait_for(lambda: client.stats().ranks[1].first_seq, 10, "rank 1's stats")
            assert first == last[1] + 1
            replayed = replay(daemon, 1, first, context)
            assert replayed[0][0] == first and kinds(replayed[:1]) == ["AllBlocksCleared"]

            # The dead worker's open request died with it; the other rank kept everything.
            with pytest.raises(ControlError) as gone:
                client.release("lost")
            assert gone.value.code == "unknown_request"
            assert client.release("kept").released == 2
            stats = client.stats()
            assert stats.ranks[0].blocks_cached == 2 and stats.ranks[1].blocks_cached == 0
            assert workers(daemon)[0] == old[0]
            assert client.ping().epoch == daemon.epoch  # one service: its epoch stays
            stored = client.store("again", prompt(21, 2), rank=1)
            assert stored.num_cached_tokens == 0
            client.release("again")
    finally:
        context.destroy(linger=0)


def test_a_batch_across_ranks_keeps_what_a_living_rank_stored_when_another_dies(
    started: Daemon,
) -> None:
    """A batch storing on rank 0 and rank 1; rank 1's worker dies before it answers. The
    whole batch was answered ``unavailable`` and the service forgot rank 0's store too, which
    its worker had carried out: pinned, with no request to release it (``unknown_request``),
    until a reset. Now rank 1's entry alone is ``unavailable``, and rank 0's is answered."""
    daemon = started
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with daemon.client() as client:
            stream = RankStream(daemon, 0, context)
            stream.join(client)
            old = workers(daemon)
            os.kill(old[1], signal.SIGSTOP)  # it takes the batch's part and never answers
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(daemon.control_endpoint)
            entries = [
                {"op": "store", "request_id": "A", "token_ids": prompt(30, 2), "rank": 0},
                {"op": "store", "request_id": "B", "token_ids": prompt(31, 2), "rank": 1},
            ]
            dealer.send_multipart(
                [b"", msgpack.packb({"op": "batch", "id": 1, "requests": entries})]
            )
            stream.until(lambda b: "BlockStored" in kinds(b), "rank 0's store")
            os.kill(old[1], signal.SIGKILL)
            assert dealer.poll(20_000), "the batch was never answered"
            reply = msgpack.unpackb(dealer.recv_multipart()[-1])
            assert reply["ok"], reply
            stored, lost = reply["replies"]
            assert stored["ok"] and len(stored["block_ids"]) == 2
            assert lost["error"]["code"] == "unavailable"
            wait_for(lambda: workers(daemon).get(1) not in (None, old[1]), 30, "a new worker")
            assert client.release("A").released == 2
            with pytest.raises(ControlError) as gone:
                client.release("B")
            assert gone.value.code == "unknown_request"
            assert client.stats().ranks[0].blocks_pinned == 0
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("in_batch", [False, True], ids=["release", "batch"])
def test_a_release_from_another_connection_waits_for_its_store(
    started: Daemon, in_batch: bool
) -> None:
    """One client, two connections (a thread that stores, one that releases). A's store waits
    in the service behind A's stats to a slow worker; B's release of it, sent at once, reached
    the worker first (unknown_request) and the store then pinned its blocks for good: the
    service had forgotten the request. The release now goes once the store is answered."""
    daemon = started
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        a, b = (context.socket(zmq.DEALER) for _ in range(2))
        for sock in (a, b):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(daemon.control_endpoint)

        def call(sock: zmq.Socket[bytes], number: int, **request: Any) -> None:
            sock.send_multipart([b"", msgpack.packb({"id": number, **request})])

        def reply(sock: zmq.Socket[bytes]) -> dict[str, Any]:
            assert sock.poll(20_000), "no reply"
            answer: dict[str, Any] = msgpack.unpackb(sock.recv_multipart()[-1])
            return answer

        old = workers(daemon)
        os.kill(old[1], signal.SIGSTOP)  # slow: it answers once continued
        try:
            call(a, 1, op="stats")
            call(a, 2, op="store", request_id="X", token_ids=prompt(40, 2), rank=1)
            call(a, 3, op="ping")  # answered by the service: it has read the store
            assert reply(a)["id"] == 3
            if in_batch:
                call(b, 4, op="batch", requests=[{"op": "release", "request_id": "X"}])
            else:
                call(b, 4, op="release", request_id="X")
        finally:
            os.kill(old[1], signal.SIGCONT)
        answers = {r["id"]: r for r in (reply(a), reply(a), reply(b))}
        assert answers[2]["ok"], answers[2]
        released = answers[4]["replies"][0] if in_batch else answers[4]
        assert released["ok"] and released["released"] == 2, answers[4]
        with daemon.client() as client:
            rank = client.stats().ranks[1]
            assert (rank.requests_open, rank.blocks_pinned) == (0, 0)
    finally:
        context.destroy(linger=0)


def test_a_hung_worker_is_killed_and_started_again() -> None:
    daemon = service({"service": {"rank_hang_timeout_s": 1.0}}).start(timeout=60)
    try:
        old = workers(daemon)
        os.kill(old[0], signal.SIGSTOP)  # alive, but its loop never turns
        wait_for(lambda: workers(daemon).get(0) not in (None, old[0]), 30, "a new worker")
        assert "answered no ping" in daemon.log()
        with daemon.client() as client:
            assert client.reset(rank=0).markers[0].rank == 0
        with pytest.raises(ProcessLookupError):
            os.kill(old[0], 0)
    finally:
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()


def test_a_reset_caught_by_a_worker_hang_says_which_ranks_it_reset() -> None:
    """A reset of every rank sent as a worker hangs, before it has missed the pings that make
    such a reset refused at once: the other ranks reset, and the reply, once the watchdog has
    killed the hung worker, was ``unavailable`` naming only the lost worker. It names the
    ranks reset, with their markers' seqs, as their streams have them."""
    daemon = service({"service": {"rank_hang_timeout_s": 1.0}}).start(timeout=60)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with daemon.client() as client:
            stream = RankStream(daemon, 0, context)
            stream.join(client)
            old = workers(daemon)
            os.kill(old[1], signal.SIGSTOP)
            with pytest.raises(ControlError) as refused:
                client.reset(force=True)
            assert refused.value.code == "unavailable"
            message = refused.value.message
            assert "not reset; reset: rank 0 (marker seq " in message, message
            seq = int(message.rpartition("marker seq ")[2].rstrip(")"))
            batches = stream.until(lambda b: any(s == seq for s, _ in b), "the marker")
            assert [kinds([b]) for b in batches if b[0] == seq] == [["AllBlocksCleared"]]
    finally:
        context.destroy(linger=0)
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()


def test_past_the_restart_policy_the_service_stops_with_an_error() -> None:
    daemon = service({"service": {"rank_restarts": 0}}).start(timeout=60)
    try:
        pids = workers(daemon)
        os.kill(pids[1], signal.SIGKILL)
        assert daemon.proc is not None
        status = daemon.proc.wait(30)
        assert status != 0
        assert "rank 1's worker died 1 time(s)" in daemon.log()
        # The other worker stopped too, and nothing is left of either.
        with pytest.raises(ProcessLookupError):
            os.kill(pids[0], 0)
        assert not shm_segments(daemon)
        assert not [p for p in daemon.dir.iterdir() if p.name.startswith(("events", "replay"))]
    finally:
        daemon.cleanup()


def test_sigterm_publishes_what_every_rank_captured_and_leaves_nothing() -> None:
    daemon = service({"events": {"tick_interval_ms": 60_000}}).start(timeout=60)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with daemon.client() as client:
            streams = [RankStream(daemon, r, context) for r in range(RANKS)]
            for stream in streams:
                stream.join(client)
            pids = workers(daemon)
            for rank in range(RANKS):
                client.store(f"t{rank}", prompt(30 + rank, 3), rank=rank)
                client.release(f"t{rank}")
        assert len(shm_segments(daemon)) == RANKS  # the pools exist while it runs
        assert daemon.stop() == 0
        for stream in streams:
            got = stream.drain(wait_ms=2000)
            assert "BlockStored" in kinds(got), f"rank {stream.rank}: the last batch was lost"
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert not shm_segments(daemon)
        assert not [p for p in daemon.dir.iterdir() if p.name.startswith(("events", "replay"))]
        assert "published the last batch" in daemon.log()
    finally:
        context.destroy(linger=0)
        daemon.cleanup()


def test_workers_stop_when_the_service_is_killed() -> None:
    daemon = service().start(timeout=60)
    try:
        pids = workers(daemon)
        assert daemon.proc is not None
        (private,) = default_runtime_dir().glob(f"kvpubd-ranks-{daemon.proc.pid}-*")
        assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL

        def gone() -> bool:
            for pid in pids.values():
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                return False
            return True

        wait_for(gone, 30, "the workers to stop")
        assert not shm_segments(daemon)
        assert not [p for p in daemon.dir.iterdir() if p.name.startswith(("events", "replay"))]
        # A new service starts on the same endpoints at once: nothing holds them.
        daemon.start(timeout=60)
        with daemon.client() as client:
            assert client.ping().ranks == RANKS
        # It removed what the killed one left in the runtime directory (it stayed for good).
        assert not private.exists()
    finally:
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()


def test_a_worker_killed_as_the_service_stops_leaves_nothing_and_fails_the_exit() -> None:
    """A worker dies (SIGKILL) and the service is stopped before it restarts it: its socket
    files were left behind and the service exited 0, as if every rank's last events had gone
    out."""
    daemon = service({"service": {"rank_restarts": 5}}).start(timeout=60)
    try:
        pids = workers(daemon)
        os.kill(pids[1], signal.SIGKILL)
        assert daemon.stop() != 0, daemon.log()  # SIGTERM at once: no time to restart it
        assert not [p for p in daemon.dir.iterdir() if p.name.startswith(("events", "replay"))]
    finally:
        daemon.cleanup()


def test_a_service_started_again_right_after_a_kill_takes_its_endpoints() -> None:
    """The service is killed (SIGKILL) while a subscriber that never reads holds queued
    events, and started again at once, as systemd's Restart= does. Its workers, left with
    their linger (30 s here) to flush those events, held the rank endpoints' locks: the new
    service exited 1 (endpoint in use by a running daemon) until they let go."""
    daemon = service({"service": {"linger_ms": 30_000}}).start(timeout=60)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        stuck = context.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.subscribe(b"")
        stuck.connect(rank_endpoint(daemon.events_endpoint, 0))
        with daemon.client() as client:
            RankStream(daemon, 0, context).join(client)  # connected and subscribed
            for n in range(40):  # ~1 MB of events queued towards the subscriber
                client.store(f"q{n}", packed_prompt(200, n), rank=0)
                client.release(f"q{n}")
        assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
        daemon.start(timeout=60)  # at once
        with daemon.client() as client:
            assert client.ping().ranks == RANKS
    finally:
        context.destroy(linger=0)
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()


def test_sighup_reaches_every_worker(started: Daemon) -> None:
    config = started.config_path.read_text().replace('log_level = "debug"', 'log_level = "info"')
    started.config_path.write_text(config)
    assert started.proc is not None
    started.proc.send_signal(signal.SIGHUP)
    for rank in range(RANKS):
        line = f"kvpubd rank {rank}: SIGHUP: log level info"
        wait_for(lambda line=line: line in started.log(), 10, f"rank {rank}'s reload")  # type: ignore[misc]


def test_a_worker_started_again_logs_at_the_level_sighup_set(started: Daemon) -> None:
    """A worker started again after a crash took the log level the service started with, not
    the one SIGHUP had set since (the other workers kept that one)."""
    config = started.config_path.read_text()
    started.config_path.write_text(config.replace('log_level = "debug"', 'log_level = "info"'))
    assert started.proc is not None
    started.proc.send_signal(signal.SIGHUP)
    reloaded = "kvpubd rank 0: SIGHUP: log level info"
    wait_for(lambda: reloaded in started.log(), 10, "rank 0's reload")
    old = workers(started)
    os.kill(old[0], signal.SIGKILL)
    wait_for(lambda: workers(started).get(0) not in (None, old[0]), 30, "a new worker")
    with started.client() as client:
        wait_for(lambda: client.stats() is not None, 10, "stats of both ranks")
        for _ in range(5):
            client.stats()  # each a debug line of the worker's control socket, at debug
    started.config_path.write_text(config)  # debug again: a line of its own after those
    started.proc.send_signal(signal.SIGHUP)
    back = "kvpubd rank 0: SIGHUP: log level debug"
    wait_for(lambda: started.log().count(back) == 1, 10, "rank 0's second reload")
    log = started.log()
    since_restart = log[log.rindex(f"worker pid {workers(started)[0]}") : log.index(back)]
    debug = [line for line in since_restart.splitlines() if "DEBUG kvpubd rank 0" in line]
    assert not debug, debug


def test_one_scrape_counts_every_rank() -> None:
    port = free_tcp_ports(1)[0]
    daemon = service({"metrics": {"port": port}}).start(timeout=60)
    try:
        with daemon.client() as client:
            for rank in range(RANKS):
                client.store(f"m{rank}", prompt(40 + rank, rank + 1), rank=rank)
            client.reset(force=True)
            url = f"http://127.0.0.1:{port}/metrics"
            found = samples(scrape(url)[1])
            for rank in range(RANKS):
                labels = {"rank": str(rank)}
                assert value(found, "kvpubd_resets_total", **labels) == 1
                assert (
                    value(found, "kvpubd_events_published_total", type="BlockStored", **labels) == 1
                )
                assert value(found, "kvpubd_blocks_cached", **labels) == 0
            assert value(found, "kvpubd_control_requests_total", op="reset") == 1
            assert value(found, "kvpubd_reset_duration_seconds_count") == 1
            health = scrape(f"http://127.0.0.1:{port}/healthz")[1]
            assert health == "ok\n"
    finally:
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()


def health(url: str) -> tuple[int, str]:
    """/healthz's status and body ((0, "") while nothing listens there yet)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except urllib.error.URLError:
        return 0, ""


@contextlib.contextmanager
def rank_1_hung() -> Iterator[tuple[Daemon, str, Callable[[], None]]]:
    """A service with metrics whose rank 1 worker is stopped (SIGSTOP) long before the
    watchdog would kill it, once /healthz says so: (the service, its /healthz url, what
    lets the worker run again)."""
    port = free_tcp_ports(1)[0]
    daemon = service({"metrics": {"port": port}, "service": {"rank_hang_timeout_s": 120}})
    daemon.start(timeout=60)
    url = f"http://127.0.0.1:{port}/healthz"
    pid = workers(daemon)[1]

    def resume() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    try:
        # The metrics endpoint may come up after the control socket the start waited for.
        wait_for(lambda: health(url) == (200, "ok\n"), 60, "the metrics endpoint")
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: health(url)[0] == 503, 60, "a 503")
        yield daemon, url, resume
    finally:
        resume()
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()


def test_healthz_names_a_worker_that_answers_no_ping() -> None:
    """/healthz names a worker that has missed its pings, and says ok again once it answers.
    It said ok throughout, after reading every worker's stats for a scrape first
    (STATS_TIMEOUT_S per silent worker, one after another)."""
    with rank_1_hung() as (_, url, resume):
        assert "rank 1's worker answered no ping for" in health(url)[1]
        resume()
        wait_for(lambda: health(url) == (200, "ok\n"), 60, "ok again")


def test_a_reset_with_a_hung_worker_resets_no_rank() -> None:
    """Once a hung worker has missed its pings, a reset of every rank is refused unavailable
    at once and resets no rank. It reset rank 0, then waited until the watchdog killed rank 1
    and answered unavailable: a client never learnt rank 0's marker."""
    with rank_1_hung() as (daemon, _, resume), daemon.client() as client:
        with pytest.raises(ControlError) as refused:
            client.reset(force=True)
        assert refused.value.code == "unavailable", refused.value
        assert "nothing was reset" in str(refused.value)
        resume()
        assert client.stats().ranks[0].resets == 0


def test_a_client_that_never_reads_cannot_queue_without_bound() -> None:
    """What the service has in flight to one worker is capped: past the cap a request is
    refused ``busy`` at once (resets excepted), and everything in flight is answered once the
    worker runs again."""
    from kvpubd.daemon.rank_front import MAX_IN_FLIGHT

    daemon = service({"service": {"rank_hang_timeout_s": 3600}}).start(timeout=60)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pid = workers(daemon)[1]
    try:
        os.kill(pid, signal.SIGSTOP)  # rank 1 answers nothing for now
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Its replies all queue here: past the daemon's send high-water mark (1000) and this
        # socket's default (1000), a reader slower than the worker's burst of 4096 answers
        # loses some (CI: 4069 of 4096), which is the daemon's bound on a client's replies.
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(daemon.control_endpoint)
        for n in range(MAX_IN_FLIGHT + 1):
            request = {"op": "store", "id": n, "request_id": n, "rank": 1, "token_ids": []}
            sock.send_multipart([b"", msgpack.packb(request)])
        assert sock.poll(20_000), "the request past the cap was not refused"
        refused = msgpack.unpackb(sock.recv_multipart()[-1])
        assert refused["id"] == MAX_IN_FLIGHT and refused["error"]["code"] == "busy"
        with daemon.client() as client:  # other ranks, and the service, still answer
            assert client.reset(rank=0).markers[0].rank == 0
        os.kill(pid, signal.SIGCONT)
        answered = 0
        while answered < MAX_IN_FLIGHT:
            assert sock.poll(20_000), f"{answered} of {MAX_IN_FLIGHT} answered"
            assert msgpack.unpackb(sock.recv_multipart()[-1])["ok"]
            answered += 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        context.destroy(linger=0)
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()


def test_a_batch_gets_the_same_replies_from_worker_processes() -> None:
    """Split over the ranks' workers (or whole to one), a batch's replies are those of the
    same batch in one process."""
    from tests.test_batch import requests

    replies = []
    for mode in ("off", "on"):
        daemon = service({"service": {"rank_processes": mode}}).start(timeout=60)
        try:
            with daemon.client() as client:
                mixed = client._call("batch", requests=requests())
                one_rank = client._call(
                    "batch", rank=1, requests=[{"op": "release", "request_id": "b"}]
                )
                replies.append((mixed["replies"], one_rank["replies"], client.stats().ranks))
        finally:
            if daemon.alive():
                daemon.stop()
            daemon.cleanup()
    (mixed_off, one_off, stats_off), (mixed_on, one_on, stats_on) = replies
    assert mixed_on == mixed_off and one_on == one_off
    assert one_on[0]["ok"] and one_on[0]["rank"] == 1
    assert [s.blocks_cached for s in stats_on] == [s.blocks_cached for s in stats_off]


@pytest.mark.parametrize("lead", [None, "stats"])
def test_a_reset_is_not_held_behind_other_clients_stores(lead: str | None) -> None:
    """A client's reset is read by the rank's worker next, as a daemon in one process reads
    it, not after every store the service forwarded for other clients: stores still queued
    behind it are applied after it (their blocks are cached once all are answered). Held
    behind them, the reset would clear every one of them. With ``lead``, the other client's
    stores follow an op of its own still unanswered (stats): they once followed it onto the
    priority connection, and the reset waited behind all of them."""
    # Enough work behind the first reply (about 256k blocks, each store released behind it so
    # that the pool never runs out) that a loaded machine does not finish every store before
    # the reset is sent: CI once saw all 32 stores of 512 blocks done, and twice all 128
    # (its client connected only after the first reply; now before).
    stores = 512
    daemon = service({"cache": {"num_blocks": 80_000}}).start(timeout=60)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        storer = context.socket(zmq.DEALER)
        storer.setsockopt(zmq.LINGER, 0)
        storer.connect(daemon.control_endpoint)
        client = daemon.client()
        client.ping()  # connected before the stores go
        if lead is not None:
            storer.send_multipart([b"", msgpack.packb({"op": lead, "id": -1})])
        for n in range(stores):
            request = {
                "op": "store",
                "id": n,
                "request_id": n,
                "rank": 1,
                "token_ids": np.asarray(prompt(100 + n, 512), dtype="<u4").tobytes(),
            }
            storer.send_multipart([b"", msgpack.packb(request)])
            release = {"op": "release", "id": f"r{n}", "request_id": n}
            storer.send_multipart([b"", msgpack.packb(release)])
        assert storer.poll(30_000)  # the worker has started on them
        with client:
            client.reset(rank=1, force=True)
            for _ in range(2 * stores + (lead is not None)):
                assert storer.poll(60_000)
                storer.recv_multipart()
            assert client.stats().ranks[1].blocks_cached > 0
    finally:
        context.destroy(linger=0)
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()
