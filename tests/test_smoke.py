"""The daemon starts, answers ping, publishes its startup marker, and stops cleanly."""

from kvpubd.protocol.wire import AllBlocksCleared
from tests.daemon import Daemon


def test_start_marker_ping_and_clean_stop(daemon: Daemon) -> None:
    with daemon.client() as client, daemon.subscriber() as sub:
        reply = client.ping()
        assert reply.ranks == 1 and reply.epoch == daemon.epoch
        first = sub.catch_up()
        assert first[0].seq == 0
        assert [type(e) for e in first[0].batch.events] == [AllBlocksCleared]
    assert daemon.stop() == 0
