"""Interop with a real router: NVIDIA Dynamo's standalone KV indexer (``ai-dynamo-runtime``,
the ``interop`` extra) subscribed to a real daemon over loopback tcp, unchanged.

Each rank is registered once over HTTP (``POST /register``); ``POST /query`` gives the prefix
overlap per instance and dp rank (in tokens) and ``GET /dump`` the indexer's whole radix tree,
whose block hashes are ours: the tests compare it with the daemon's snapshot, block for block
and tier by tier (the pool's blocks on its device tier, the host tier's on its host tier).
Skipped when the package is not installed."""

from __future__ import annotations

import importlib.util
import json
import random
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

from kvpubd.client import (
    ControlClient,
    ControlError,
    Mirror,
    Received,
    SnapshotReply,
)
from kvpubd.protocol.control import ResetTier
from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import BlockHash, BlockRemoved, BlockStored
from kvpubd.tools.launcher import free_tcp_port_runs, free_tcp_ports
from tests.daemon import Daemon, wait_for
from tests.hybrid import FULL, WINDOW, hybrid_cache, random_workload
from tests.llmd import LlmdIndex, LlmdSubscriber, Timings, _hash
from tests.mirrors import snapshot_blocks, snapshot_mirror, store_released, unique_prompt
from tests.streams import Tap, chain_hashes, seq_of

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
# The indexer's storage tiers: where it files events of medium GPU (our pool's) and CPU (our
# host tier's, cache.host_medium's default).
DEVICE, HOST = "device", "host_pinned"
HOST_MEDIUM = "CPU"
Tiers = dict[str, set[BlockHash]]  # block hashes per storage tier


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

    def matched(self, tokens: list[int]) -> tuple[int, int]:
        """Our instance's matched prefix in tokens: on the device tier, and on the device tier
        followed by the host tier (Dynamo's ``gpu`` and ``cpu``, the latter cumulative)."""
        reply = self.http("POST", "/query", {"token_ids": tokens, "model_name": MODEL})
        found = reply["instances"].get(str(INSTANCE))
        return (0, 0) if found is None else (found["gpu"], found["cpu"])

    def tiers(self, rank: int) -> Tiers:
        """The block hashes the indexer holds for our instance's ``rank``, per storage tier
        (both named ones always present)."""
        held: Tiers = {DEVICE: set(), HOST: set()}
        for tree in self.http("GET", "/dump").values():
            for item in tree["events"]:
                event = item["event"]
                if item["worker_id"] == INSTANCE and event["dp_rank"] == rank:
                    hashes = (b["block_hash"] for b in event["data"]["stored"]["blocks"])
                    held.setdefault(item["storage_tier"], set()).update(hashes)
        return held

    def blocks(self, rank: int) -> set[BlockHash]:
        """The block hashes the indexer holds for our instance's ``rank``, on any tier."""
        held: set[BlockHash] = set()
        for tier in self.tiers(rank).values():
            held |= tier
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

    def start(
        ranks: int = 1, start_rank: int = 0, cache: dict[str, Any] | None = None, **events: Any
    ) -> Daemon:
        # medium GPU: the indexer's scores count the device tier (CPU lands in its host tier).
        # Heartbeats on, as a router-facing daemon runs: the indexer's SUB connects after
        # /register returns, so it can miss the batches published just then; the next
        # heartbeat shows it the gap and it replays (without it, it waits forever).
        settings = {"medium": "GPU", "heartbeat_ms": 500, **events}
        daemon = Daemon(
            {
                "events": settings,
                "cache": {
                    "data_parallel_size": ranks,
                    "data_parallel_start_rank": start_rank,
                    **(cache or {}),
                },
            },
            transport="tcp",
        )
        started.append(daemon)
        daemon.start()
        return daemon

    yield start
    for daemon in started:
        daemon.cleanup()


def snapshot_tiers(reply: SnapshotReply) -> Tiers:
    """A snapshot's blocks per storage tier they belong on in the indexer."""
    mirror = Mirror(host_medium=HOST_MEDIUM)
    mirror.apply(reply.events)
    return {DEVICE: set(mirror.blocks), HOST: set(mirror.host_blocks)}


def exact(indexer: Indexer, daemon: Daemon, timeout: float = FOLLOW_S) -> list[Tiers]:
    """Poll until the indexer holds exactly each rank's snapshot, tier by tier (fail after
    ``timeout``); returns what it holds, per rank."""
    deadline = time.monotonic() + timeout
    with daemon.client() as client:
        while True:
            wanted = [snapshot_tiers(client.snapshot(r)) for r in daemon.served]
            held = [indexer.tiers(r) for r in daemon.served]
            if held == wanted:
                return held
            if time.monotonic() > deadline:
                sizes = [
                    {tier: (len(h.get(tier, ())), len(w.get(tier, ()))) for tier in h.keys() | w}
                    for h, w in zip(held, wanted, strict=True)
                ]
                raise AssertionError(
                    f"indexer (held, wanted) blocks per rank and tier {sizes} after {timeout} s:\n"
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


# -- the host tier (cache.host_blocks) ----------------------------------------------------------

POOL_BLOCKS = 4  # a pool of two prompts of two blocks: a third evicts the least recent one
PROMPT = 2 * BLOCK


def tiered_cache(host_blocks: int, pool_blocks: int = POOL_BLOCKS) -> dict[str, Any]:
    return {"num_blocks": pool_blocks, "host_blocks": host_blocks}


def wait_matched(indexer: Indexer, tokens: list[int], want: tuple[int, int]) -> None:
    deadline = time.monotonic() + FOLLOW_S
    while (got := indexer.matched(tokens)) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"(gpu, cpu) {got} != {want}:\n{indexer.log()[-3000:]}")
        time.sleep(0.05)


def tap(daemon: Daemon) -> Tap:
    """kvpubd's own subscriber beside the indexer, keeping every batch: it shows when what a
    reset leaves to publish after its marker is out (its strict mirror checks the stream)."""
    sub = daemon.subscriber(control=daemon.control_endpoint, host_medium=HOST_MEDIUM)
    return Tap(sub)


def host_events(batches: list[Received], kind: type[BlockStored | BlockRemoved]) -> set[BlockHash]:
    """The hashes that events of ``kind`` name on the host tier in ``batches``."""
    return {
        block_hash
        for batch in batches
        for event in batch.batch.events
        if isinstance(event, kind) and event.medium == HOST_MEDIUM
        for block_hash in event.block_hashes
    }


def reset_published(client: ControlClient, watch: Tap, tier: ResetTier, force: bool = False) -> int:
    """Reset ``tier`` of rank 0 and receive until the host tier's part after the marker is out:
    the removal of every block the tier held ("all"), or their stores again ("gpu"). Returns
    the marker's seq."""
    host = snapshot_tiers(client.snapshot(0))[HOST]
    marker = seq_of(client.reset(0, force=force, tier=tier).markers[0])
    kind = BlockRemoved if tier == "all" else BlockStored
    watch.until(
        lambda: host <= host_events(watch.after(0, marker), kind),
        timeout=FOLLOW_S,
        what=f"the host tier's {kind.__name__} of {len(host)} blocks after a {tier} reset",
    )
    return marker


def fence(client: ControlClient, indexer: Indexer, daemon: Daemon) -> Tiers:
    """Store and release a fresh one-block prompt, then wait for the indexer to hold exactly
    the snapshot: it has then applied everything published before that store."""
    store_released(client, unique_prompt(1))
    return exact(indexer, daemon)[0]


def test_demoted_blocks_are_on_the_host_tier(indexer: Indexer, tcp_daemon: Any) -> None:
    """The third prompt evicts the first from the pool: the indexer holds its blocks on its host
    tier and the others on the device tier, as the daemon's snapshot has them; a query of the
    first prompt matches nothing on the device and all of it counting the host."""
    daemon = tcp_daemon(cache=tiered_cache(host_blocks=8))
    indexer.register(daemon)
    first, second, third = (unique_prompt(2) for _ in range(3))
    with daemon.client() as client:
        for prompt in (first, second, third):
            store_released(client, prompt)
        assert client.stats().ranks[0].host_blocks_cached == 2
    held = exact(indexer, daemon)[0]
    assert held[HOST] == set(chain_hashes(first))
    assert held[DEVICE] == set(chain_hashes(second) + chain_hashes(third))
    wait_matched(indexer, first, (0, PROMPT))
    assert indexer.matched(third) == (PROMPT, PROMPT)


def test_promoted_blocks_are_on_both_tiers(indexer: Indexer, tcp_daemon: Any) -> None:
    """The evicted first prompt stored again comes back from the host tier (cached, no
    compute): the indexer holds it on the device tier and still on the host tier, beside the
    second prompt, which that store evicted."""
    daemon = tcp_daemon(cache=tiered_cache(host_blocks=8))
    indexer.register(daemon)
    first, second, third = (unique_prompt(2) for _ in range(3))
    with daemon.client() as client:
        for prompt in (first, second, third):
            store_released(client, prompt)
        demoted = exact(indexer, daemon)[0][HOST]
        assert store_released(client, first).num_cached_tokens == PROMPT
    held = exact(indexer, daemon)[0]
    assert demoted == set(chain_hashes(first))
    assert held[DEVICE] == set(chain_hashes(third) + chain_hashes(first))
    assert held[HOST] == set(chain_hashes(first) + chain_hashes(second))
    wait_matched(indexer, first, (PROMPT, PROMPT))
    assert indexer.matched(second) == (0, PROMPT)


def test_host_tier_evictions(indexer: Indexer, tcp_daemon: Any) -> None:
    """A host tier of three blocks below a pool of four, five prompts of two blocks: six blocks
    are demoted, three evicted from the host tier least recently used first (the first prompt,
    then the second one's first block). The indexer drops exactly those."""
    daemon = tcp_daemon(cache=tiered_cache(host_blocks=3))
    indexer.register(daemon)
    prompts = [unique_prompt(2) for _ in range(5)]
    with daemon.client() as client:
        for prompt in prompts:
            store_released(client, prompt)
    held = exact(indexer, daemon)[0]
    assert held[HOST] == {chain_hashes(prompts[1])[1], *chain_hashes(prompts[2])}
    wait_matched(indexer, prompts[2], (0, PROMPT))
    assert [indexer.matched(p) for p in prompts[:2]] == [(0, 0), (0, 0)]


@pytest.mark.parametrize("tier", ["all", "gpu"])
def test_reset_scopes(indexer: Indexer, tcp_daemon: Any, tier: ResetTier) -> None:
    """Two prompts on the pool, two demoted to the host tier, then a reset.

    ``tier="all"``: the indexer holds nothing, and still nothing once the host tier's
    removals that follow the marker are out (they name blocks it already dropped).

    ``tier="gpu"``: the indexer, which drops every tier at the marker, holds the host tier's
    blocks again once the daemon has stored them again: exactly the ones that survived; the
    demoted prompt matches on the host alone, the pool's prompts not at all."""
    daemon = tcp_daemon(cache=tiered_cache(host_blocks=8))
    indexer.register(daemon)
    watch = tap(daemon)
    prompts = [unique_prompt(2) for _ in range(4)]
    try:
        with daemon.client() as client:
            for prompt in prompts:
                store_released(client, prompt)
            before = exact(indexer, daemon)[0]
            assert (len(before[DEVICE]), len(before[HOST])) == (4, 4)
            reset_published(client, watch, tier)
            if tier == "all":
                assert exact(indexer, daemon)[0] == {DEVICE: set(), HOST: set()}
            else:
                assert client.stats().ranks[0].host_blocks_cached == 4
            after = fence(client, indexer, daemon)
    finally:
        watch.sub.close()
    if tier == "all":
        assert (len(after[DEVICE]), after[HOST]) == (1, set())
        assert [indexer.matched(p) for p in prompts] == [(0, 0)] * 4
    else:
        assert after[HOST] == before[HOST] and len(after[DEVICE]) == 1
        wait_matched(indexer, prompts[0], (0, PROMPT))
        assert [indexer.matched(p) for p in prompts[2:]] == [(0, 0)] * 2


def leading(hashes: list[BlockHash], held: set[BlockHash]) -> int:
    """How many of ``hashes``, from the first, are in ``held``."""
    return next((i for i, h in enumerate(hashes) if h not in held), len(hashes))


@pytest.mark.parametrize(
    "seed", [1, *(pytest.param(seed, marks=pytest.mark.slow) for seed in (2, 3))]
)
def test_randomised_run(indexer: Indexer, tcp_daemon: Any, seed: int) -> None:
    """Stores of prompts that share prefixes (some with a partial last block, some left open),
    releases and resets of either scope, forced over open requests, on a pool of 8 blocks over
    a host tier of 6: the indexer ends with the daemon's snapshot, tier by tier, and so does
    kvpubd's strict mirror. The run demoted, promoted and evicted from the host tier."""
    rng = random.Random(seed)
    daemon = tcp_daemon(cache=tiered_cache(host_blocks=6, pool_blocks=8))
    indexer.register(daemon)
    watch = tap(daemon)
    trunks = [unique_prompt(4) for _ in range(5)]
    open_ids: list[str] = []
    seen = {"demoted": 0, "promoted": 0, "host evicted": 0, "all": 0, "gpu": 0}
    try:
        with daemon.client() as client:
            for step in range(80):
                roll = rng.random()
                if step in (30, 60) or roll < 0.05:
                    tier: ResetTier = "all" if step == 30 else "gpu" if step == 60 else "all"
                    if step not in (30, 60) and rng.random() < 0.5:
                        tier = "gpu"
                    reset_published(client, watch, tier, force=True)
                    seen[tier] += 1
                    open_ids.clear()
                elif roll < 0.25 and open_ids:
                    client.release(open_ids.pop(rng.randrange(len(open_ids))))
                else:
                    tokens = rng.choice(trunks)[: rng.randint(1, 4) * BLOCK]
                    if rng.random() < 0.3:
                        tokens += [rng.randint(1, 3)] * BLOCK  # a branch that recurs
                    if rng.random() < 0.3:
                        tokens += [7] * (BLOCK // 2)  # a partial last block
                    request_id = f"run-{step}"
                    before = snapshot_tiers(client.snapshot(0))
                    try:
                        reply = client.store(request_id, tokens)
                    except ControlError as error:
                        assert error.code == "pool_exhausted"
                        continue
                    after = snapshot_tiers(client.snapshot(0))
                    on_pool = leading(chain_hashes(tokens), before[DEVICE])
                    seen["promoted"] += reply.num_cached_tokens > on_pool * BLOCK
                    seen["demoted"] += bool(after[HOST] - before[HOST])
                    seen["host evicted"] += bool(before[HOST] - after[HOST])
                    if rng.random() < 0.3:
                        open_ids.append(request_id)
                    else:
                        client.release(request_id)
            final = fence(client, indexer, daemon)
            watch.settle(client)
            mirror = watch.sub.mirror(0)
            assert mirror is not None
            assert {DEVICE: set(mirror.blocks), HOST: set(mirror.host_blocks)} == final
    finally:
        watch.sub.close()
    assert all(seen.values()), seen


# -- a hybrid model's KV cache groups (cache.groups) ----------------------------------------


def test_a_hybrid_stream_is_scored_by_its_full_attention_group(
    indexer: Indexer, tcp_daemon: Any
) -> None:
    """A full-attention group and a sliding-window one (tests/hybrid.py), which share their
    block hashes. Dynamo indexes main-attention kinds only, learns each group's kind from its
    stores and drops every event of another group, its removals included. After random
    stores, releases, evictions and resets, its tree is exactly the snapshot's full-attention
    group, though the window group let go of blocks that group keeps: the last prompt scores
    all of it while the window group holds none of its first blocks."""
    daemon = tcp_daemon(cache=hybrid_cache())
    indexer.register(daemon)
    with daemon.client() as client:
        tokens = random_workload(client, seed=41, steps=150)
        snapshot = snapshot_mirror(client.snapshot(0))
    full = set(snapshot.group(FULL))
    assert chain_hashes(tokens)[0] not in snapshot.group(WINDOW)
    deadline = time.monotonic() + FOLLOW_S
    while (held := indexer.tiers(0)) != {DEVICE: full, HOST: set()}:
        assert time.monotonic() < deadline, (
            f"indexer holds {len(held[DEVICE])} blocks, the full group {len(full)}, "
            f"{len(held[DEVICE] - full)} of them not:\n{indexer.log()[-3000:]}"
        )
        time.sleep(0.05)
    wait_overlap(indexer, tokens, {0: len(tokens)})
