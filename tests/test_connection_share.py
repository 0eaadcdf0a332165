"""How many of a capped listener's connections one peer may hold (conn_cap): a quarter of the
cap, but never fewer than 4 where the cap allows. A rank worker's private control socket, on a
small fd budget, has a small cap, and the service's connections to it (bulk, priority and
reset) come from one process: with a share of 1, the second was hung up each time it
connected."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq

from kvpubd.daemon.conn_cap import ConnectionCap
from kvpubd.daemon.rank_link import Conn
from tests.loop_turns import until


async def test_one_process_keeps_a_links_connections_to_a_listener_of_cap_four(
    tmp_path: Path,
) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    endpoint = f"ipc://{tmp_path}/worker"
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    guard = ConnectionCap.create(router, endpoint, 4, "worker control")
    assert guard is not None
    guard.start(asyncio.get_running_loop())
    got: list[bytes] = []

    def read() -> bool:
        while router.poll(0):
            got.append(router.recv_multipart()[1])
        return len(got) == len(Conn)

    try:
        names = [conn.name.encode() for conn in Conn]
        for name in names:
            dealer = context.socket(zmq.DEALER)
            dealer.connect(endpoint)
            dealer.send(name)
        await until(read, "a message on each connection")
        assert sorted(got) == sorted(names)
        assert guard.shed == 0
    finally:
        guard.close()
        context.destroy(linger=0)
