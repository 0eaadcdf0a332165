"""One daemon per engine rank: ``cache.data_parallel_start_rank`` names the ranks a daemon
serves, so several single-rank daemons share one set of base endpoints the way vLLM's engine
ranks do, and a subscriber follows all of them as one multi-rank stream."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpubd.client import ControlError, Subscriber
from kvpubd.client.replies import Marker
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import AllBlocksCleared, BlockStored
from tests.daemon import Daemon, wait_for
from tests.streams import chain_hashes, prompt

# Daemons per rank, started as an operator would: processes.
pytestmark = pytest.mark.process


@pytest.fixture
def rank_daemons() -> Iterator[list[Daemon]]:
    """Daemons serving rank 0 and rank 1, on the same base events and replay endpoints."""
    base = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
    events = {"endpoint": f"ipc://{base}/events", "replay_endpoint": f"ipc://{base}/replay"}
    daemons = [
        Daemon({"events": events, "cache": {"data_parallel_start_rank": rank}}) for rank in range(2)
    ]
    try:
        for daemon in daemons:
            daemon.start()
        yield daemons
    finally:
        for daemon in daemons:
            daemon.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def published(daemon: Daemon) -> int:
    """The seq of the daemon's last batch, once nothing is waiting to be published."""
    with daemon.client() as client:
        rank = client.stats().ranks[0]
        return rank.seq if rank.events_pending == 0 else -1


def test_single_rank_daemons_publish_their_own_rank_on_shared_endpoints(
    rank_daemons: list[Daemon],
) -> None:
    first, second = rank_daemons
    with second.client() as client:
        ping = client.ping()
        assert ping.ranks == 1 and [e.rank for e in ping.endpoints] == [1]
        assert ping.endpoints[0].events == rank_endpoint(second.events_endpoint, 1)
    p, q = prompt(1, 2), prompt(2, 3)
    with first.client() as a, second.client() as b:
        # No rank named: the daemon's own (first) rank.
        assert a.store("p", p).rank == 0
        assert b.store("q", q).rank == 1
        assert b.store("q-again", q, rank=1).num_cached_tokens == len(q)
    for daemon in rank_daemons:

        def flushed(daemon: Daemon = daemon) -> bool:
            return published(daemon) >= 0

        wait_for(flushed, what="the stores published")
    with Subscriber(first.events_endpoint, first.replay_endpoint, ranks=[0, 1]) as sub:
        batches = sub.catch_up()
    stored = {
        rank: [
            (b.batch.data_parallel_rank, e.block_hashes)
            for b in batches
            if b.rank == rank
            for e in b.batch.events
            if isinstance(e, BlockStored)
        ]
        for rank in (0, 1)
    }
    assert stored == {0: [(0, chain_hashes(p))], 1: [(1, chain_hashes(q))]}


def test_a_rank_the_daemon_does_not_serve_is_refused_and_changes_nothing(
    rank_daemons: list[Daemon],
) -> None:
    second = rank_daemons[1]
    with second.client() as client:
        before = client.stats().ranks[0]
        for call in (
            lambda: client.store("x", prompt(3, 2), rank=0),
            lambda: client.snapshot(rank=0),
            lambda: client.reset(rank=2),
            lambda: client.pool_info(rank=0),
        ):
            with pytest.raises(ControlError) as refused:
                call()
            assert refused.value.code == "bad_request"
            assert "is not served (ranks: 1)" in str(refused.value)
        after = client.stats().ranks[0]
        assert after == before
        # A reset of every rank is a reset of the one it serves.
        seq = published(second)
        assert client.reset().markers == [Marker(1, seq + 1)]
    with Subscriber(second.events_endpoint, second.replay_endpoint, ranks=[1]) as sub:
        last = sub.catch_up()[-1]
    assert (last.rank, last.seq, last.batch.events) == (1, seq + 1, [AllBlocksCleared()])
    assert last.batch.data_parallel_rank == 1
