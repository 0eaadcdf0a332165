"""The per-tick capture cap is per periodic tick: out-of-tick flushes don't refill it."""

from kvpubd.client import Mirror
from kvpubd.protocol.wire import BlockStored
from tests.conftest import DaemonFactory
from tests.mirrors import snapshot_blocks
from tests.streams import BLOCK_SIZE, Tap, chain_hashes, prompt


def test_snapshot_flush_does_not_refill_the_tick_budget(start_daemon: DaemonFactory) -> None:
    """While paused (one tick that never ends), snapshots publish what is pending but the cap
    still bounds everything stored in that tick: the first four blocks in store order are
    published, exactly, and the rest are dropped."""
    daemon = start_daemon(events={"max_events_per_tick": 4})
    prompts = [prompt(i, 3) for i in range(3)]  # 3 blocks each: 9 in one tick
    with daemon.client() as client, daemon.subscriber() as sub:
        tap = Tap(sub)
        tap.go_live(client)
        client.pause()
        stats = client.stats().ranks[0]
        before, paused_at = stats.dropped_stored_blocks, stats.seq
        for i, tokens in enumerate(prompts):
            client.store(f"r{i}", tokens)
            client.snapshot()
        snapshot = client.snapshot()
        tap.through({0: snapshot.seq})
        published = [
            e for b in tap.after(0, paused_at) for e in b.batch.events if isinstance(e, BlockStored)
        ]
        # All of r0 (budget 4 -> 1), the first block of r1 (-> 0), nothing of r2.
        assert published == [
            BlockStored(chain_hashes(prompts[0]), None, prompts[0], BLOCK_SIZE, None, "CPU", None),
            BlockStored(
                chain_hashes(prompts[1])[:1],
                None,
                prompts[1][:BLOCK_SIZE],
                BLOCK_SIZE,
                None,
                "CPU",
                None,
            ),
        ]
        assert client.stats().ranks[0].dropped_stored_blocks - before == 5
        mirror = Mirror(BLOCK_SIZE)
        for received in tap.history:
            mirror.apply(received.batch.events)
        expected = snapshot_blocks(snapshot)
        assert mirror.blocks == expected
        # The snapshot holds the published blocks only: none of the dropped ones.
        dropped = chain_hashes(prompts[1])[1:] + chain_hashes(prompts[2])
        assert set(chain_hashes(prompts[0]) + chain_hashes(prompts[1])[:1]) <= expected.keys()
        assert not expected.keys() & set(dropped)
