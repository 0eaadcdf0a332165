"""When the daemon builds a snapshot for its snapshot endpoint, seen from a REQ client: a
build is shared while the published state stays the same (heartbeats publish seqs, not
changes), and made anew once it changed."""

from __future__ import annotations

import msgspec
import zmq

from kvpubd.protocol.endpoints import rank_endpoint
from tests.conftest import DaemonFactory
from tests.daemon import Daemon, wait_for
from tests.mirrors import store_released, unique_prompt

Reply = tuple[int, list[bytes]]


def ask(context: zmq.Context[zmq.Socket[bytes]], daemon: Daemon) -> Reply:
    with context.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(rank_endpoint(daemon.snapshot_endpoint, 0))
        sock.send(b"snapshot")
        assert sock.poll(10_000), "no snapshot reply"
        seq, _, *chunks = sock.recv_multipart()
    return int.from_bytes(seq, "big", signed=True), chunks


def test_heartbeats_reuse_the_build_and_a_change_makes_a_new_one(
    start_daemon: DaemonFactory,
) -> None:
    daemon = start_daemon(events={"snapshot_endpoint": True, "heartbeat_ms": 20})
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with daemon.client() as client:
            store_released(client, unique_prompt(3))
            seq, chunks = ask(context, daemon)
            wait_for(lambda: client.stats().ranks[0].seq > seq, what="a heartbeat")
            later_seq, later_chunks = ask(context, daemon)
            # The same build (each chunk carries the time its build began), at the later seq.
            assert later_seq > seq and later_chunks == chunks

            store_released(client, unique_prompt(1))
            changed_seq, changed_chunks = ask(context, daemon)
        events = [e for c in changed_chunks for e in msgspec.msgpack.decode(c)[1]]
        assert changed_seq > later_seq and len(events) == 4 and changed_chunks != chunks
    finally:
        context.destroy(linger=0)


def test_a_build_no_request_can_use_is_let_go(start_daemon: DaemonFactory) -> None:
    """Once events went out after a build, no request can be answered from it: the daemon
    lets go of its chunks at the next tick instead of keeping them until the next build."""
    daemon = start_daemon(events={"snapshot_endpoint": True})
    service = daemon.service  # type: ignore[attr-defined]
    pipeline = service.pipelines[0]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with daemon.client() as client:
            store_released(client, unique_prompt(3))
            ask(context, daemon)
            assert pipeline._snapshot is not None  # kept: the next request may share it
            store_released(client, unique_prompt(1))
        wait_for(lambda: pipeline._snapshot is None, what="the stale build let go")
    finally:
        context.destroy(linger=0)


def test_a_snapshot_let_go_is_freed_a_slice_per_turn(start_daemon: DaemonFactory) -> None:
    """A million blocks' chunks freed in one go took 15-19 ms of the loop on the dev VM: a
    build let go is handed to the reaper, which frees about FREE_STEP_BYTES per turn."""
    daemon = start_daemon(events={"snapshot_endpoint": True})
    pipeline = daemon.service.pipelines[0]  # type: ignore[attr-defined]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with daemon.client() as client:
            store_released(client, unique_prompt(3))
            ask(context, daemon)
            built = pipeline._snapshot.result.result()
            assert built.chunks
            store_released(client, unique_prompt(1))
        wait_for(lambda: not built.chunks, what="the reaper emptying the chunks")
        assert not built.bodies
    finally:
        context.destroy(linger=0)
