"""Reset latency while the store pipeline runs at a fraction of its measured capacity
(``kvpubd bench throughput --load-fraction F``)."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import msgpack
import zmq

from kvpubd.interrupts import ctrl_c_kept_from_children
from kvpubd.tools.bench_probe import TINY_BLOCKS, ResetProbe
from kvpubd.tools.bench_prompts import make_prompts
from kvpubd.tools.bench_report import summary
from kvpubd.tools.launcher import DaemonProcess, tied

LOAD_WINDOW = 64  # requests in flight at most: a paced client, not a flood


def _paced_load(control_endpoint: str, rate: float, seconds: float, stop: Any) -> None:
    """Send store + release pairs at ``rate`` stores/s until ``seconds`` pass or ``stop``
    says so; refusals (a forced reset drops open requests) are simply counted. "started" goes
    on ``stop`` once the first pair is sent."""
    prompts = make_prompts(500, seed=7)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control_endpoint)
    start = time.monotonic()
    sent = in_flight = refused = 0
    while time.monotonic() - start < seconds and not stop.poll(0):
        due = start + sent / rate
        now = time.monotonic()
        if now >= due and in_flight < LOAD_WINDOW:
            prompt = prompts[sent % len(prompts)]
            for op, fields in (("store", {"token_ids": prompt}), ("release", {})):
                request = {"op": op, "id": sent, "request_id": f"load-{sent}", **fields}
                sock.send_multipart([b"", msgpack.packb(request, use_bin_type=True)])
            if not sent:
                stop.send("started")
            sent += 1
            in_flight += 2
        elif sock.poll(max(0, int((due - now) * 1000)) if in_flight < LOAD_WINDOW else 100):
            reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
            refused += not reply.get("ok")
            in_flight -= 1
    stop.send({"stores": sent, "refused": refused, "seconds": time.monotonic() - start})
    sock.close()
    ctx.term()


def _time_reset(probe: ResetProbe) -> tuple[int, int]:
    """Like ResetProbe.time_reset, but skips the store batches in between by a byte search
    instead of decoding each (under load the SUB carries megabytes of them)."""
    start = time.perf_counter_ns()
    probe.send("reset", force=True)
    while True:
        payload = probe.sub.recv_multipart()[2]
        if b"AllBlocksCleared" in payload:
            marker = time.perf_counter_ns() - start
            break
    probe.recv_reply()
    return marker, time.perf_counter_ns() - start


def measure_resets_under_load(
    capacity_rps: float, fraction: float, resets: int, num_blocks: int
) -> dict[str, Any]:
    """reset -> marker received, ``resets`` times, while a paced client stores at
    ``fraction`` x ``capacity_rps``."""
    overrides: dict[str, dict[str, Any]] = {
        "cache": {**TINY_BLOCKS, "num_blocks": num_blocks},
        "events": {"buffer_steps": 1000},
        "service": {"log_level": "warning"},
    }
    spawn = multiprocessing.get_context("spawn")
    interval = 0.05
    seconds = 2.0 + resets * (interval + 0.05)
    with DaemonProcess(overrides, transport="tcp") as daemon:
        probe = ResetProbe(daemon)
        stop, child_stop = spawn.Pipe()
        load = spawn.Process(
            **tied(
                _paced_load,
                (daemon.control_endpoint, fraction * capacity_rps, seconds, child_stop),
            ),
            daemon=True,
        )
        stopped = False
        try:
            probe.wait_connected()
            with ctrl_c_kept_from_children():  # Ctrl-C is the bench's to handle: it stops the load
                load.start()
            # Its start (a fresh interpreter) can take longer than the resets on a busy host.
            if not stop.poll(60) or stop.recv() != "started":
                raise TimeoutError("the paced load did not start within 60 s")
            time.sleep(1.0)  # the load reaches its pace (a bench, not a test: sleeping is fine)
            markers, replies = [], []
            for _ in range(resets):
                time.sleep(interval)
                # Read what the interval's stores published first, as a subscriber that keeps
                # up has: timed from behind that backlog, a reset's marker waits for the
                # probe to read it all (megabytes at 90 %), not for the daemon.
                probe.drain_sub(0)
                marker, reply = _time_reset(probe)
                markers.append(marker)
                replies.append(reply)
            stop.send("stop")
            stopped = True
            done = stop.recv() if stop.poll(30) else {}
        finally:
            load.join(10 if stopped else 0)  # interrupted: the load would run its full time
            if load.is_alive():
                load.terminate()
            probe.close()
    stores = done.get("stores", 0)
    return {
        "load_fraction": fraction,
        "target_stores_per_s": round(fraction * capacity_rps),
        "stores": stores,
        "stores_per_s": round(stores / done["seconds"]) if done.get("seconds") else None,
        "refused": done.get("refused"),
        **summary(markers),
        "reply": summary(replies),
    }
