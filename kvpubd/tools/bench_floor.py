"""The floor of the reset path (``kvpubd bench reset``'s last row): a bare pyzmq loop that
only publishes a pre-encoded marker and replies, timed exactly like the daemon."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq
from rich.progress import Progress

from kvpubd.interrupts import ctrl_c_kept_from_children
from kvpubd.tools.bench_probe import ResetProbe
from kvpubd.tools.bench_report import summary


def _bare_marker_server(control: str, events: str) -> None:
    """The floor of the reset path: a plain loop that answers each request by publishing a
    pre-encoded marker batch on a PUB and replying, nothing else (run in its own process, until
    it is terminated)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(control)
    pub = ctx.socket(zmq.PUB)
    pub.bind(events)
    payload = msgpack.packb([0.0, [{"type": "AllBlocksCleared"}], 0])
    seq = 0
    while True:
        frames = router.recv_multipart()
        request = msgpack.unpackb(frames[-1])
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        reply = {"ok": True, "id": request.get("id"), "markers": [{"rank": 0, "seq": seq}]}
        router.send_multipart([frames[0], b"", msgpack.packb(reply)])
        seq += 1


class BareMarkerServer:
    """``_bare_marker_server`` in a child process, with the endpoints ResetProbe expects."""

    def __init__(self) -> None:
        import multiprocessing

        from kvpubd.tools.launcher import free_tcp_ports, tied

        control, events = free_tcp_ports(2)
        self.control_endpoint = f"tcp://127.0.0.1:{control}"
        self.events_endpoint = f"tcp://127.0.0.1:{events}"
        self._process = multiprocessing.get_context("spawn").Process(
            **tied(_bare_marker_server, (self.control_endpoint, self.events_endpoint))
        )

    def client(self, timeout: float = 5.0) -> Any:
        from kvpubd.client import ControlClient

        return ControlClient(self.control_endpoint, timeout=timeout)

    def __enter__(self) -> BareMarkerServer:
        with ctrl_c_kept_from_children():  # Ctrl-C is this process's to handle: it stops the server
            self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()
        self._process.join(10)


def measure_floor(resets: int, idle_ms: float, progress: Progress) -> dict[str, Any]:
    """Reset latency of the bare marker server, measured exactly like the daemon's."""
    with BareMarkerServer() as server:
        probe = ResetProbe(server)  # type: ignore[arg-type]
        try:
            probe.wait_connected()
            task = progress.add_task("floor (bare pyzmq loop)", total=resets)
            markers, replies = [], []
            for _ in range(resets):
                probe.drain_sub(idle_ms / 1000)
                marker, reply = probe.time_reset()
                markers.append(marker)
                replies.append(reply)
                progress.advance(task)
        finally:
            probe.close()
    return {**summary(markers), "reply": summary(replies)}
