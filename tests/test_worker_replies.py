"""A rank worker answers every request its service forwards, however slowly the service
reads the replies. The service bounds what it has in flight to a worker (rank_front), so the
worker's control socket must never drop a reply for a full queue, as a daemon's drops those
of a client that stops reading: a dropped reply left a request unanswered for good (seen as
``test_a_client_that_never_reads_cannot_queue_without_bound`` failing under load)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import zmq

from kvpubd.daemon.service import Service, WorkerRole
from kvpubd.daemon.settings import Settings
from tests.loop_turns import turns_until

PINGS = 20_000  # far more small replies than a ROUTER's queue (1000) and a socket buffer hold


async def test_a_worker_drops_no_reply_its_service_reads_late(tmp_path: Path) -> None:
    settings = Settings(
        events={
            "endpoint": f"ipc://{tmp_path}/ev",
            "replay_endpoint": "",
            "tick_interval_ms": 60_000,
        },
        control={"endpoint": f"ipc://{tmp_path}/unused"},
        service={"linger_ms": 0},
    )
    worker = Service(settings, worker=WorkerRole(f"ipc://{tmp_path}/worker", epoch=7))
    await worker.startup()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        # A reader that takes (almost) nothing until it is asked to: the replies queue up in
        # the worker.
        service_side = context.socket(zmq.DEALER)
        service_side.setsockopt(zmq.SNDHWM, 0)
        service_side.setsockopt(zmq.RCVHWM, 1)
        service_side.setsockopt(zmq.RCVBUF, 4096)
        service_side.setsockopt(zmq.LINGER, 0)
        service_side.connect(f"ipc://{tmp_path}/worker")
        for n in range(PINGS):
            service_side.send_multipart([b"", msgpack.packb({"op": "ping", "id": n})])
        service_side.send_multipart([b"", msgpack.packb({"op": "reset", "id": PINGS})])
        # One connection's requests are handled in order: once the reset is, every ping is.
        await turns_until(lambda: worker.pipelines[0].resets == 1, limit=1_000_000)
        ids = []
        while service_side.poll(2000):
            reply = msgpack.unpackb(service_side.recv_multipart()[-1])
            assert reply["ok"], reply
            ids.append(reply["id"])
            await asyncio.sleep(0)  # the worker's loop moves what is queued on
        assert ids == list(range(PINGS + 1))
    finally:
        context.destroy(linger=0)
        await worker.shutdown()
