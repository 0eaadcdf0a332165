"""The host tier against a real daemon: what a subscriber sees of both tiers over the real
sockets (and what the snapshot says), reset scopes over the control protocol and the CLI's
client, the host tier's shared memory, the bytes a promotion copies back, and a service of
rank processes passing a reset's tier on to its workers."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpubd.client import ControlClient, ControlError, map_host_tier, map_pool
from kvpubd.daemon.settings import ConfigError, load_settings
from kvpubd.protocol.wire import BlockHash, BlockStored
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.test_pool_sharing import DEVICES, host_copy, write_pattern

BS = 16
HOST_BLOCKS = 24
TIERED = {"cache": {"num_blocks": 16, "host_blocks": HOST_BLOCKS}}


def prompt(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def snapshot_tiers(client: ControlClient) -> tuple[int, dict[str, set[BlockHash]]]:
    snap = client.snapshot()
    tiers: dict[str, set[BlockHash]] = {"GPU": set(), "CPU": set()}
    for event in snap.events:
        assert isinstance(event, BlockStored) and event.medium is not None
        tiers[event.medium].update(event.block_hashes)
    return snap.seq, tiers


class Follower:
    """A subscriber keeping a Mirror of both tiers, checked against the daemon's snapshot."""

    def __init__(self, daemon: Daemon) -> None:
        self.client = daemon.client()
        self.sub = daemon.subscriber(host_medium="CPU")

    def close(self) -> None:
        self.sub.close()
        self.client.close()

    def check(self) -> dict[str, set[BlockHash]]:
        """Wait until the reset backlog is out, then compare the mirror with the snapshot."""

        def settled() -> tuple[int, dict[str, set[BlockHash]]] | None:
            seq, tiers = snapshot_tiers(self.client)
            host = self.client.stats().ranks[0]
            # The snapshot is the state; the stream reaches it once the backlog is out.
            deadline = time.monotonic() + 2
            while (last := self.sub.last_seq()) is None or last < seq:
                if time.monotonic() > deadline:
                    return None
                self.sub.receive(0.02) or self.sub.catch_up()
            mirror = self.sub.mirror(0)
            assert mirror is not None
            same = set(mirror.blocks) == tiers["GPU"] and set(mirror.host_blocks) == tiers["CPU"]
            return (seq, tiers) if same and len(tiers["CPU"]) == host.host_blocks_cached else None

        _, tiers = wait_for(settled, timeout=20, what="the mirror to equal the snapshot")
        assert self.sub.counters.lost == 0
        return tiers


@pytest.fixture
def tiered(start_daemon: DaemonFactory) -> Iterator[Follower]:
    follower = Follower(start_daemon(**TIERED))
    yield follower
    follower.close()


def test_a_subscriber_follows_both_tiers_through_evictions_and_resets(tiered: Follower) -> None:
    client = tiered.client
    rng = random.Random(7)
    opened: list[str] = []
    for step in range(120):
        roll = rng.random()
        if roll < 0.6:
            request_id = f"s{step}"
            try:
                client.store(request_id, prompt(rng.randrange(8) * 1000, rng.randrange(1, 6)))
            except ControlError as exc:
                assert exc.code == "pool_exhausted", exc
            else:
                opened.append(request_id)
        elif roll < 0.92 and opened:
            client.release(opened.pop(rng.randrange(len(opened))))
        else:
            client.reset(force=True, tier=rng.choice(["all", "gpu"]))
            opened.clear()
        if step % 30 == 29:
            tiered.check()
    for request_id in opened:
        client.release(request_id)
    tiers = tiered.check()
    assert tiers["CPU"], "nothing reached the host tier"


def test_a_reset_of_the_pool_alone_keeps_the_host_tier(tiered: Follower) -> None:
    client = tiered.client
    for start in range(0, 5000, 1000):
        client.store(f"p{start}", prompt(start, 4))
        client.release(f"p{start}")
    before = tiered.check()
    assert len(before["CPU"]) >= 4
    client.reset(tier="gpu")
    after = tiered.check()
    assert after == {"GPU": set(), "CPU": before["CPU"]}
    # The first prompt was evicted to the host: storing it again copies it back.
    reply = client.store("again", prompt(0, 4))
    assert reply.num_cached_tokens == 4 * BS
    client.release("again")
    client.reset()
    assert tiered.check() == {"GPU": set(), "CPU": set()}
    assert client.stats().ranks[0].host_blocks_cached == 0


@pytest.mark.parametrize("device", DEVICES)
def test_promoted_blocks_hold_the_bytes_the_engine_wrote(
    start_daemon: DaemonFactory, device: str
) -> None:
    """Through the real copies (NumPy, or the GPU's stream and page-locked shared memory):
    the engine's bytes go to the host tier with the evicted blocks and come back with them."""
    daemon = start_daemon(cache={**TIERED["cache"], "device": device})
    with daemon.client() as client, map_pool(client) as pool, map_host_tier(client) as host:
        assert host.array.shape == (HOST_BLOCKS, pool.array.shape[1])
        first = client.store("first", prompt(0, 4))
        written = write_pattern(pool.array, first.block_ids, seed=3)
        client.release("first")
        for start in range(1000, 5000, 1000):  # evict it to the host tier
            reply = client.store(f"p{start}", prompt(start, 4))
            # Blocks handed out again are zeroed first, after their copy to the host tier.
            assert not host_copy(pool.array[reply.block_ids]).any()
            client.release(f"p{start}")
        assert client.stats().ranks[0].host_blocks_cached >= 4
        on_host = {bytes(row) for row in np.asarray(host.array)}
        assert all(bytes(row) in on_host for row in written), "not on the host tier"
        again = client.store("again", prompt(0, 4))
        assert again.num_cached_tokens == 4 * BS
        assert np.array_equal(host_copy(pool.array[again.block_ids]), written)


def test_the_tiers_need_two_media() -> None:
    with pytest.raises(ConfigError, match="host_medium"):
        load_settings(overrides={"cache": {"host_blocks": 8}, "events": {"medium": "CPU"}})
    settings = load_settings(overrides={"cache": {"host_blocks": 8}})
    assert (settings.medium, settings.cache.host_medium) == ("GPU", "CPU")


def test_a_reset_names_a_known_tier(start_daemon: DaemonFactory) -> None:
    daemon = start_daemon(**TIERED)
    with daemon.client() as client:
        with pytest.raises(ControlError) as info:
            client.reset(tier="disk")  # type: ignore[arg-type]
        assert info.value.code == "bad_request" and "tier" in str(info.value)


@pytest.mark.daemon_process
def test_rank_processes_pass_the_reset_tier_on() -> None:
    daemon = Daemon(
        {
            "cache": {"data_parallel_size": 2, **TIERED["cache"]},
            "service": {"rank_processes": "on"},
        }
    ).start(timeout=60)
    try:
        with daemon.client() as client:
            for rank in (0, 1):
                for start in range(0, 5000, 1000):
                    client.store(f"r{rank}-{start}", prompt(start, 4), rank=rank)
                    client.release(f"r{rank}-{start}")
            cached = [r.host_blocks_cached for r in client.stats().ranks]
            assert all(cached)
            client.reset(tier="gpu")
            stats = client.stats().ranks
            assert [r.host_blocks_cached for r in stats] == cached
            assert [r.blocks_cached for r in stats] == [0, 0]
            client.reset()
            assert [r.host_blocks_cached for r in client.stats().ranks] == [0, 0]
    finally:
        if daemon.alive():
            daemon.stop()
        daemon.cleanup()
