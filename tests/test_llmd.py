"""Interop with llm-d-router v0.10's KV-event consumer, as tests/llmd.py follows its rules,
against a real daemon with the default ``seq_origin`` ("continue"): configured as
docs/routers.md says (topic ``kv@<pod>@<model>``, v026 replay framing, the replay port), it
holds exactly each rank's state: live stores, evictions, reset, idle join, salted prompts,
kill -9 and SIGTERM restarts (a new run that out-numbers the old one before the consumer
redials included), two ranks served by two daemons."""

from __future__ import annotations

import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpubd.daemon.seq_state import state_path
from kvpubd.protocol.endpoints import rank_endpoint
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.llmd import LlmdIndex, LlmdSubscriber, Timings, _hash
from tests.mirrors import snapshot_blocks, store_released, unique_prompt

# Restarts by kill -9 and SIGTERM: processes.
pytestmark = pytest.mark.daemon_process

MODEL = "m"
# llm-d's timings, shrunk: 5 s redial, 30 s cooldown, 2 s replay idle timeout.
FAST = Timings(retry_interval=0.2, replay_cooldown=60.0, replay_idle_timeout=1.0)


def topic(rank: int) -> str:
    return f"kv@pod-{rank}@{MODEL}"


def start(start_daemon: DaemonFactory, rank: int = 0, **events: Any) -> Daemon:
    """A daemon serving ``rank`` with llm-d's topic for it (one daemon per rank: llm-d keys
    its index by the pod in the topic, and kvpubd has one topic per daemon)."""
    return start_daemon(
        events={"topic": topic(rank), "heartbeat_ms": 200, **events},
        cache={"data_parallel_start_rank": rank},
    )


@pytest.fixture
def consumers() -> Iterator[Any]:
    started: list[LlmdSubscriber] = []

    def subscribe(daemon: Daemon, index: LlmdIndex | None = None) -> LlmdSubscriber:
        rank = daemon.served[0]
        sub = LlmdSubscriber(
            index or LlmdIndex(),
            rank_endpoint(daemon.events_endpoint, rank),
            rank_endpoint(daemon.replay_endpoint, rank),
            topic(rank),
            FAST,
        )
        started.append(sub)
        sub.start()
        return sub

    yield subscribe
    for sub in started:
        sub.close()


def exact(sub: LlmdSubscriber, daemon: Daemon) -> set[int]:
    """Poll until the consumer holds exactly the rank's published blocks; returns them."""
    rank = daemon.served[0]
    wanted: set[int] = set()

    def holds() -> bool:
        nonlocal wanted
        with daemon.client() as client:
            wanted = {_hash(h) for h in snapshot_blocks(client.snapshot(rank))}
        return sub.index.blocks(f"pod-{rank}") == wanted

    wait_for(holds, what=f"llm-d to hold rank {rank}'s state; its log: {sub.log}")
    assert "replay incomplete" not in " ".join(sub.log), sub.log
    return wanted


def test_follows_stores_evictions_and_reset(start_daemon: DaemonFactory, consumers: Any) -> None:
    """Joined at start (its replay from 0 finds seq 0): stores, then stores that evict (300
    blocks through a pool of 256), then a reset, each held exactly."""
    daemon = start(start_daemon)
    sub = consumers(daemon)
    with daemon.client() as client:
        store_released(client, unique_prompt(3))
        assert len(exact(sub, daemon)) == 3
        for _ in range(100):  # 300 blocks through a pool of 256: evictions
            store_released(client, unique_prompt(3))
        assert len(exact(sub, daemon)) > 3
        client.reset()
    assert exact(sub, daemon) == set()


def test_joins_an_idle_daemon_with_history(start_daemon: DaemonFactory, consumers: Any) -> None:
    """Connected after the daemon published: its replay from 0 finds the whole run."""
    daemon = start(start_daemon)
    with daemon.client() as client:
        for _ in range(3):
            store_released(client, unique_prompt(2))
        client.store("salted", unique_prompt(2), cache_salt="s1")
        client.release("salted")
    sub = consumers(daemon)
    assert len(exact(sub, daemon)) == 8


@pytest.mark.parametrize(
    "how,outnumber",
    [("kill9", False), ("kill9", True), ("sigterm", True)],
    ids=["kill9", "kill9-outnumbered", "sigterm-outnumbered"],
)
def test_follows_a_restart(
    start_daemon: DaemonFactory, consumers: Any, how: str, outnumber: bool
) -> None:
    """The daemon dies and starts again on the same endpoints; with ``outnumber``, the new run
    publishes more batches than the whole old run before the consumer redials. The new run's
    seqs continue the old run's, so its first batch (AllBlocksCleared) is the next one the
    consumer applies: it drops the old run's blocks and holds the new run's."""
    daemon = start(start_daemon)
    sub = consumers(daemon)
    redial = sub.hold_redial()
    with daemon.client() as client:
        store_released(client, unique_prompt(3))
        old_last = client.snapshot().seq
    exact(sub, daemon)
    daemon.stop(signal.SIGKILL if how == "kill9" else signal.SIGTERM)
    wait_for(lambda: "lost the publisher" in sub.log, what="llm-d to lose the publisher")
    daemon.start()
    with daemon.client() as client:
        store_released(client, unique_prompt(2))
        if outnumber:
            while client.snapshot().seq <= 2 * old_last + 2:
                store_released(client, unique_prompt(1))
    redial.set()
    exact(sub, daemon)
    with daemon.client() as client:
        store_released(client, unique_prompt(2))
    exact(sub, daemon)


def test_a_batch_recorded_but_never_sent(start_daemon: DaemonFactory, consumers: Any) -> None:
    """kill -9 between keeping a seq and sending its batch (the file is written first): the
    new run starts after a seq the consumer never saw, and its replay from there finds it (an
    empty batch the new run keeps below its first seq) instead of a hole."""
    daemon = start(start_daemon)
    sub = consumers(daemon)
    redial = sub.hold_redial()
    with daemon.client() as client:
        store_released(client, unique_prompt(3))
        last = client.snapshot().seq
    exact(sub, daemon)
    daemon.stop(signal.SIGKILL)
    wait_for(lambda: "lost the publisher" in sub.log, what="llm-d to lose the publisher")
    path = state_path(daemon.dir, 0, rank_endpoint(daemon.events_endpoint, 0))
    never_sent = last + 1
    data = bytearray(path.read_bytes())
    data[8:24] = struct.pack(">QQ", never_sent, never_sent ^ ((1 << 64) - 1))
    Path(path).write_bytes(bytes(data))
    daemon.start()
    assert daemon.first_seq() == never_sent + 1
    redial.set()
    assert exact(sub, daemon) == set()


def test_two_ranks_one_daemon_each(start_daemon: DaemonFactory, consumers: Any) -> None:
    """Ranks 0 and 1 served by two daemons (one topic each), both followed; a kill -9 of rank
    1's daemon leaves rank 0 as it was and rank 1 as its new run."""
    daemons = [start(start_daemon, rank) for rank in (0, 1)]
    subs = [consumers(daemon) for daemon in daemons]
    for daemon in daemons:
        with daemon.client() as client:
            store_released(client, unique_prompt(2))
    held = [exact(sub, daemon) for sub, daemon in zip(subs, daemons, strict=True)]
    daemons[1].stop(signal.SIGKILL)
    daemons[1].start()
    with daemons[1].client() as client:
        store_released(client, unique_prompt(1))
    assert exact(subs[0], daemons[0]) == held[0]
    assert len(exact(subs[1], daemons[1])) == 1
