"""The per-tick capture cap is per periodic tick: out-of-tick flushes don't refill it."""

from kvpubd.client import Mirror
from kvpubd.protocol.wire import BlockStored
from tests.conftest import DaemonFactory
from tests.streams import BLOCK_SIZE, Tap, prompt


def test_snapshot_flush_does_not_refill_the_tick_budget(start_daemon: DaemonFactory) -> None:
    """While paused (one tick that never ends), snapshots publish what is pending but the cap
    still bounds everything stored in that tick."""
    daemon = start_daemon(events={"max_events_per_tick": 4})
    with daemon.client() as client, daemon.subscriber() as sub:
        tap = Tap(sub)
        tap.go_live(client)
        client.pause()
        stats = client.stats().ranks[0]
        before, paused_at = stats.dropped_stores, stats.seq
        for i in range(3):
            client.store(f"r{i}", prompt(i, 3))  # 3 blocks each: 9 in one tick
            client.snapshot()
        snapshot = client.snapshot()
        tap.through({0: snapshot.seq})
        published = [
            e for b in tap.after(0, paused_at) for e in b.batch.events if isinstance(e, BlockStored)
        ]
        assert sum(len(e.block_hashes) for e in published) == 4
        assert client.stats().ranks[0].dropped_stores - before == 5
        mirror = Mirror(BLOCK_SIZE)
        for received in tap.history:
            mirror.apply(received.batch.events)
        assert len(mirror.blocks) == len(snapshot.events)
