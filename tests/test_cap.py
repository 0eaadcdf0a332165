"""The per-tick capture cap is per periodic tick: out-of-tick flushes don't refill it."""

from kvpubd.client import Mirror
from kvpubd.daemon.pipeline import FLUSH_BLOCKS
from kvpubd.protocol.wire import BlockStored
from tests.conftest import DaemonFactory
from tests.mirrors import snapshot_blocks
from tests.streams import BLOCK_SIZE, Tap, chain_hashes, packed_prompt, prompt


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


def test_a_large_capture_goes_out_at_once_and_still_counts_against_the_tick(
    start_daemon: DaemonFactory,
) -> None:
    """Once FLUSH_BLOCKS blocks are captured they are published without waiting for the tick
    (here one tick lasts the whole test), so a reset never has more than that to publish
    ahead of its marker; that flush does not refill the tick's budget, and while the drain
    is paused nothing goes out early. (A large store is captured a slice at a time: its
    first FLUSH_BLOCKS blocks go out at once, the rest waits for the tick.)"""
    blocks = FLUSH_BLOCKS + 76
    budget = FLUSH_BLOCKS + 476
    daemon = start_daemon(
        events={"tick_interval_ms": 60_000, "max_events_per_tick": budget},
        cache={"num_blocks": 8 * FLUSH_BLOCKS},
    )
    with daemon.client() as client:
        start = client.stats().ranks[0]
        client.store("a", packed_prompt(blocks, 1))
        after_a = client.stats().ranks[0]
        assert after_a.seq == start.seq + 1
        assert after_a.blocks_published == blocks  # the record counts what is captured
        assert after_a.events_pending >= 1  # the last 76 blocks, until the tick
        # The budget has budget - blocks left: that much of b is captured, and kept pending.
        client.store("b", packed_prompt(blocks, 2))
        after_b = client.stats().ranks[0]
        assert after_b.seq == after_a.seq
        assert after_b.dropped_stored_blocks - start.dropped_stored_blocks == 2 * blocks - budget
        assert after_b.blocks_published == budget

        client.reset(force=True)  # publishes what is pending, then a fresh budget
        after_reset = client.stats().ranks[0]
        assert after_reset.events_pending == 0
        client.pause()
        paused = client.stats().ranks[0]
        client.store("c", packed_prompt(blocks, 3))
        after_c = client.stats().ranks[0]
        assert after_c.events_pending >= 1 and after_c.seq == paused.seq
