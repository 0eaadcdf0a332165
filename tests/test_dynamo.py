"""Interop with a real router: NVIDIA Dynamo's standalone KV indexer (``ai-dynamo-runtime``,
the ``interop`` extra) subscribed to a real daemon over loopback tcp, unchanged.

Each rank is registered once over HTTP (``POST /register``); ``POST /query`` gives the prefix
overlap per instance and dp rank (in tokens) and ``GET /dump`` the indexer's whole radix tree,
whose block hashes are ours: the tests compare it with the daemon's snapshot, block for block.
Skipped when the package is not installed."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.tools.launcher import free_tcp_port_runs, free_tcp_ports
from tests.daemon import Daemon, wait_for
from tests.llmd import LlmdIndex, LlmdSubscriber, Timings, _hash
from tests.mirrors import snapshot_blocks, store_released, unique_prompt

pytestmark = [
    pytest.mark.dynamo,
    pytest.mark.process,  # the daemons Dynamo's indexer follows are processes
    pytest.mark.skipif(
        importlib.util.find_spec("dynamo") is None,
        reason="Dynamo's indexer is not installed (pip install 'kvpubd[interop]')",
    ),
]

BLOCK = 16
MODEL = "m"
INSTANCE = 1
FOLLOW_S = 5.0  # issue 11: a registered indexer holds the exact state within 5 s


class Indexer:
    """``python -m dynamo.indexer`` on a free port, spoken to over HTTP."""

    def __init__(self, log: Path) -> None:
        self.port = free_tcp_ports(1)[0]
        self._log = open(log, "wb")  # noqa: SIM115 - lives as long as the process
        self.log_path = log
        command = ["-m", "dynamo.indexer", "--block-size", str(BLOCK), "--threads", "1"]
        self.proc = subprocess.Popen(
            [sys.executable, *command, "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                self.http("GET", "/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"indexer did not start:\n{self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as reply:
            text = reply.read().decode()
        return json.loads(text) if text else None

    def register(self, daemon: Daemon) -> None:
        for rank in daemon.served:
            self.http(
                "POST",
                "/register",
                {
                    "instance_id": INSTANCE,
                    "endpoint": rank_endpoint(daemon.events_endpoint, rank),
                    "replay_endpoint": rank_endpoint(daemon.replay_endpoint, rank),
                    "dp_rank": rank,
                    "model_name": MODEL,
                    "block_size": BLOCK,
                },
            )

    def overlap(self, tokens: list[int], **keys: str) -> dict[int, int]:
        """Matched prefix per dp rank of our instance, in tokens (absent: nothing matched)."""
        reply = self.http("POST", "/query", {"token_ids": tokens, "model_name": MODEL, **keys})
        return {int(r): n for r, n in reply["scores"].get(str(INSTANCE), {}).items() if n}

    def blocks(self, rank: int) -> set[int]:
        """The block hashes the indexer holds for our instance's ``rank``."""
        held: set[int] = set()
        for tree in self.http("GET", "/dump").values():
            for item in tree["events"]:
                event = item["event"]
                if item["worker_id"] == INSTANCE and event["dp_rank"] == rank:
                    held.update(b["block_hash"] for b in event["data"]["stored"]["blocks"])
        return held

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
    started = Indexer(tmp_path / "indexer.log")
    yield started
    started.close()


@pytest.fixture
def tcp_daemon() -> Iterator[Any]:
    started: list[Daemon] = []

    def start(ranks: int = 1, start_rank: int = 0, **events: Any) -> Daemon:
        # medium GPU: the indexer's scores count the device tier (CPU lands in its host tier).
        # Heartbeats on, as a router-facing daemon runs: the indexer's SUB connects after
        # /register returns, so it can miss the batches published just then; the next
        # heartbeat shows it the gap and it replays (without it, it waits forever).
        settings = {"medium": "GPU", "heartbeat_ms": 500, **events}
        daemon = Daemon(
            {
                "events": settings,
                "cache": {"data_parallel_size": ranks, "data_parallel_start_rank": start_rank},
            },
            transport="tcp",
        )
        started.append(daemon)
        daemon.start()
        return daemon

    yield start
    for daemon in started:
        daemon.cleanup()


def exact(indexer: Indexer, daemon: Daemon, timeout: float = FOLLOW_S) -> None:
    """Poll until the indexer holds exactly each rank's snapshot (fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    with daemon.client() as client:
        while True:
            wanted = [set(snapshot_blocks(client.snapshot(r))) for r in daemon.served]
            held = [indexer.blocks(r) for r in daemon.served]
            if held == wanted:
                return
            if time.monotonic() > deadline:
                sizes = [(len(h), len(w)) for h, w in zip(held, wanted, strict=True)]
                raise AssertionError(
                    f"indexer (held, wanted) blocks per rank {sizes} after {timeout} s:\n"
                    + indexer.log()[-3000:]
                )
            time.sleep(0.05)


def wait_overlap(indexer: Indexer, tokens: list[int], want: dict[int, int], **keys: str) -> None:
    deadline = time.monotonic() + FOLLOW_S
    while (got := indexer.overlap(tokens, **keys)) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"overlap {got} != {want}:\n{indexer.log()[-3000:]}")
        time.sleep(0.05)


def test_overlap_across_two_ranks(indexer: Indexer, tcp_daemon: Any) -> None:
    """A prompt cached whole on rank 0 and by half on rank 1 scores 64 and 32 tokens."""
    daemon = tcp_daemon(ranks=2)
    indexer.register(daemon)
    prompt = unique_prompt(4)
    with daemon.client() as client:
        store_released(client, prompt, rank=0)
        store_released(client, prompt[: 2 * BLOCK] + unique_prompt(2), rank=1)
    wait_overlap(indexer, prompt, {0: 4 * BLOCK, 1: 2 * BLOCK})
    exact(indexer, daemon)


def test_one_daemon_per_rank(indexer: Indexer, tcp_daemon: Any) -> None:
    """Two single-rank daemons on one pair of base ports (cache.data_parallel_start_rank 0
    and 1), registered as one instance's dp ranks 0 and 1, as vLLM's engine ranks would be:
    each rank is scored from its own daemon, and a reset of one daemon empties its rank only."""
    events, replay = free_tcp_port_runs([2, 2])
    base = {"endpoint": f"tcp://127.0.0.1:{events}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    daemons = [tcp_daemon(start_rank=rank, **base) for rank in (0, 1)]
    for daemon in daemons:
        indexer.register(daemon)
    prompt = unique_prompt(4)
    with daemons[0].client() as first, daemons[1].client() as second:
        store_released(first, prompt)
        store_released(second, prompt[: 2 * BLOCK] + unique_prompt(2))
        wait_overlap(indexer, prompt, {0: 4 * BLOCK, 1: 2 * BLOCK})
        for daemon in daemons:
            exact(indexer, daemon)
        second.reset()
    wait_overlap(indexer, prompt, {0: 4 * BLOCK})
    assert indexer.blocks(1) == set()
    exact(indexer, daemons[0])


def test_reset_empties_the_index(indexer: Indexer, tcp_daemon: Any) -> None:
    """A reset on an idle daemon reaches the indexer at once: nothing matches any more."""
    daemon = tcp_daemon()
    indexer.register(daemon)
    prompt = unique_prompt(3)
    with daemon.client() as client:
        store_released(client, prompt)
        wait_overlap(indexer, prompt, {0: 3 * BLOCK})
        client.reset()
    wait_overlap(indexer, prompt, {})
    assert indexer.blocks(0) == set()


def test_salt_and_lora_stay_apart(indexer: Indexer, tcp_daemon: Any) -> None:
    """The same tokens plain (rank 0), salted (rank 1) and under a LoRA adapter (rank 2): each
    query matches only its own rank."""
    daemon = tcp_daemon(ranks=3)
    indexer.register(daemon)
    prompt = unique_prompt(2)
    with daemon.client() as client:
        store_released(client, prompt, rank=0)
        for rank, fields in ((1, {"cache_salt": "s1"}), (2, {"lora_id": 1, "lora_name": "a"})):
            client.store(f"variant-{rank}", prompt, rank=rank, **fields)
            client.release(f"variant-{rank}")
    exact(indexer, daemon)
    assert indexer.overlap(prompt) == {0: 2 * BLOCK}
    assert indexer.overlap(prompt, cache_salt="s1") == {1: 2 * BLOCK}
    assert indexer.overlap(prompt, lora_name="a") == {2: 2 * BLOCK}


@pytest.mark.parametrize(
    "how,outnumber",
    [("kill9", False), ("sigterm", False), ("kill9", True)],
    ids=["kill9", "sigterm", "kill9-outnumbered"],
)
def test_follows_a_restart(indexer: Indexer, tcp_daemon: Any, how: str, outnumber: bool) -> None:
    """Registered once: after kill -9 (or SIGTERM) and a new run on the same endpoints, the
    indexer drops the old run's blocks on its own (the new run's seqs continue the old run's:
    its first batch, AllBlocksCleared, is the next seq; the heartbeat reveals it on an idle
    daemon) and follows the new run's stores, also when the new run has published more
    batches than the whole old run by then (``outnumber``)."""
    daemon = tcp_daemon()
    indexer.register(daemon)
    old = unique_prompt(3)
    with daemon.client() as client:
        store_released(client, old)
        old_last = client.snapshot().seq
    wait_overlap(indexer, old, {0: 3 * BLOCK})
    daemon.stop(signal.SIGKILL if how == "kill9" else signal.SIGTERM)
    daemon.start()
    if outnumber:
        with daemon.client() as client:
            while client.snapshot().seq <= 2 * old_last + 2:
                store_released(client, unique_prompt(1))
    exact(indexer, daemon)  # the old run's blocks are gone
    assert indexer.overlap(old) == {}
    new = unique_prompt(2)
    with daemon.client() as client:
        store_released(client, new)
    wait_overlap(indexer, new, {0: 2 * BLOCK})
    exact(indexer, daemon)


def test_llmd_beside_it_after_a_kill9(indexer: Indexer, tcp_daemon: Any) -> None:
    """One daemon with the default seq origin, followed by the indexer and by a consumer
    that follows llm-d-router v0.10's rules (tests/llmd.py, its timings shrunk) at once: after
    kill -9 and a new run that out-numbers the old one, both hold exactly the new run's
    state."""
    pod_topic = f"kv@pod-0@{MODEL}"
    daemon = tcp_daemon(topic=pod_topic)
    indexer.register(daemon)
    llmd = LlmdSubscriber(
        LlmdIndex(),
        rank_endpoint(daemon.events_endpoint, 0),
        rank_endpoint(daemon.replay_endpoint, 0),
        pod_topic,
        Timings(retry_interval=0.2, replay_idle_timeout=1.0),
    )
    llmd.start()
    try:

        def both_exact() -> bool:
            with daemon.client() as client:
                wanted = set(snapshot_blocks(client.snapshot(0)))
            held = llmd.index.blocks("pod-0")
            return indexer.blocks(0) == wanted and held == {_hash(h) for h in wanted}

        with daemon.client() as client:
            store_released(client, unique_prompt(3))
            old_last = client.snapshot().seq
        wait_for(both_exact, what="both consumers to hold the old run")
        daemon.stop(signal.SIGKILL)
        daemon.start()
        with daemon.client() as client:
            while client.snapshot().seq <= 2 * old_last + 2:
                store_released(client, unique_prompt(1))
        wait_for(both_exact, what=f"both consumers to hold the new run; llm-d: {llmd.log}")
        assert "replay incomplete" not in " ".join(llmd.log)
    finally:
        llmd.close()


def test_late_join_after_history_left_the_ring(indexer: Indexer, tcp_daemon: Any) -> None:
    """Registered after 10 x buffer_steps batches on a now idle daemon: the indexer holds the
    exact state within 5 s (its replay asks for history the ring no longer holds)."""
    daemon = tcp_daemon(buffer_steps=4)
    with daemon.client() as client:
        for _ in range(10 * 4):
            store_released(client, unique_prompt(1))
            client.snapshot()  # publishes each store as its own batch
        assert client.stats().ranks[0].batches_published > 40
    indexer.register(daemon)
    exact(indexer, daemon)
    assert indexer.blocks(0)


def test_joins_an_idle_daemon(indexer: Indexer, tcp_daemon: Any) -> None:
    """Registered to a daemon that publishes nothing after its history: the heartbeat makes
    the indexer replay, and it holds the exact state."""
    daemon = tcp_daemon()
    with daemon.client() as client:
        for _ in range(3):
            store_released(client, unique_prompt(2))
    indexer.register(daemon)
    exact(indexer, daemon)
    assert len(indexer.blocks(0)) == 6


def test_rejects_the_batches_of_a_daemon_serving_snapshots(
    indexer: Indexer, tcp_daemon: Any
) -> None:
    """What docs/routers.md says of Dynamo and the snapshot protocol: with
    events.snapshot_endpoint set, every batch carries the publisher id as a 4th element, which
    Dynamo's indexer (ai-dynamo-runtime 1.6.1) refuses to decode; it holds nothing. Should a
    release accept them, this fails and the docs change with it."""
    daemon = tcp_daemon(snapshot_endpoint=True)
    indexer.register(daemon)
    with daemon.client() as client:
        assert len(client.stats().ranks[0].publisher_id) == 16
        store_released(client, unique_prompt(4))
    wait_for(
        lambda: "array had incorrect length, expected 3" in indexer.log(),
        timeout=FOLLOW_S,
        what="the indexer refusing a batch of four elements",
    )
    assert indexer.blocks(0) == set()
