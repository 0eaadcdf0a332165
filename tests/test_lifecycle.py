"""The promises of the daemon's lifecycle that only show where they happen: the reset marker is
handed to ZeroMQ before the reply exists, queued messages survive shutdown within linger_ms,
and a background task that dies stops the daemon with a non-zero status."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import zmq

from kvpubd.client import ControlClient
from kvpubd.daemon.service import Service, TaskFailed
from kvpubd.daemon.settings import Settings
from kvpubd.protocol.wire import AllBlocksCleared, decode_batch, unpack_seq
from kvpubd.tools.launcher import DaemonProcess
from tests.daemon import wait_for, write_config

SMALL_CACHE = {"num_blocks": 64, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8}


def in_process_settings(tmp_path: Path, **events: object) -> Settings:
    return Settings(
        events={"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": "", **events},
        control={"endpoint": f"ipc://{tmp_path}/ctl"},
        cache=SMALL_CACHE,
        service={"linger_ms": 0},
    )


def request(op: str, id_: int, **fields: object) -> list[bytes]:
    return [b"peer", b"", msgpack.packb({"op": op, "id": id_, **fields})]


def receive_marker(sub: zmq.Socket[bytes], timeout_s: float) -> int | None:
    """Read the SUB socket (no loop turn in between) until a batch holding AllBlocksCleared
    arrives; its seq, or None when none came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sub.poll(int(left * 1000) + 1):
            return None
        _topic, seq, payload = sub.recv_multipart()
        if any(isinstance(e, AllBlocksCleared) for e in decode_batch(payload).events):
            return unpack_seq(seq)
    return None


async def test_reset_marker_is_on_the_wire_before_the_reply_exists(tmp_path: Path) -> None:
    """The control handler returns the reset's reply only after the marker's batch went to
    the PUB socket: the subscriber reads the marker before the loop ever runs again, so no
    deferred flush (call_soon, the next tick) could have sent it."""
    service = Service(in_process_settings(tmp_path, tick_interval_ms=60_000))
    await service.startup()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(service.pipelines[0].publisher.endpoint)
        assert service.control is not None
        # Wait for the subscription to reach the PUB: the startup marker was sent before it,
        # so probe with resets until one arrives (each is handled synchronously, like below).
        for probe in range(1, 200):
            if service.control.handle_frames(request("reset", probe)) is None:
                raise AssertionError("reset got no reply")
            if receive_marker(sub, 0.05) is not None:
                break
        else:
            raise AssertionError("the subscriber never received a marker")
        store = service.control.handle_frames(
            request("store", 1, request_id="a", token_ids=[7] * 32)
        )
        assert isinstance(store, bytes) and msgpack.unpackb(store)["ok"]
        service.control.handle_frames(request("release", 2, request_id="a"))

        reply = service.control.handle_frames(request("reset", 3))
        # No await between the handler and here: the loop has not run since the reset.
        assert isinstance(reply, bytes)
        answer = msgpack.unpackb(reply)
        assert answer["ok"], answer
        marker_seq = receive_marker(sub, 5.0)
        assert marker_seq == answer["markers"][0]["seq"]
    finally:
        sub.close(linger=0)
        context.term()
        await service.shutdown()


async def test_a_dead_background_task_stops_the_daemon(tmp_path: Path) -> None:
    """The drain loop raising is not swallowed: serve() ends with TaskFailed."""
    service = Service(in_process_settings(tmp_path, tick_interval_ms=1))
    serving = asyncio.create_task(service.serve())
    await asyncio.wait_for(_until(lambda: service.control is not None and service.pipelines), 10)

    def broken_flush(new_tick: bool = False) -> int | None:
        raise RuntimeError("injected drain failure")

    service.pipelines[0].flush = broken_flush  # type: ignore[method-assign]
    try:
        await asyncio.wait_for(serving, 10)
    except TaskFailed as exc:
        assert "drain loop" in str(exc) and "injected drain failure" in str(exc)
    else:
        raise AssertionError("serve() returned normally after its drain loop died")


@pytest.mark.process
def test_a_dead_background_task_exits_the_process_non_zero(tmp_path: Path) -> None:
    """The same fault in a real ``kvpubd serve`` process: logged, exit status 1."""
    config = tmp_path / "kvpubd.toml"
    write_config(
        config,
        {
            "events": {"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
            "control": {"endpoint": f"ipc://{tmp_path}/ctl"},
            "cache": SMALL_CACHE,
        },
    )
    inject = (
        "import sys; from kvpubd.daemon.pipeline import RankPipeline\n"
        "calls = {'n': 0}\n"
        "original = RankPipeline.flush\n"
        "def flush(self, new_tick=False):\n"
        "    calls['n'] += 1\n"
        "    if new_tick and calls['n'] > 20: raise RuntimeError('injected drain failure')\n"
        "    return original(self, new_tick)\n"
        "RankPipeline.flush = flush\n"
        "from kvpubd.cli import main; sys.argv = ['kvpubd', 'serve', '--config', sys.argv[1]]\n"
        "main()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", inject, str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1, result.stderr
    assert "drain loop died" in result.stderr
    assert "injected drain failure" in result.stderr


@pytest.mark.process
def test_shutdown_delivers_queued_batches_to_a_slow_tcp_subscriber() -> None:
    """Batches still queued for a subscriber that reads slowly reach it after SIGTERM: the
    PUB socket lingers (service.linger_ms) instead of dropping them."""
    overrides = {
        "cache": {**SMALL_CACHE, "num_blocks": 8192},
        "events": {"hwm": 0},  # no drops at the PUB: only linger decides what arrives
        "service": {"linger_ms": 20_000},
    }
    with DaemonProcess(overrides, transport="tcp") as daemon:
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(daemon.events_endpoint)
        try:
            with daemon.client() as client:
                wait_for(lambda: _probe(client, sub), what="the subscription")
                # Far more than the socket buffers hold: most of it waits in the daemon.
                for n in range(600):
                    client.store(f"r{n}", [n % 60_000 + 1] * (16 * 512))
                    client.release(f"r{n}")
                last = client.stats().ranks[0].seq
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
            seqs = []
            while sub.poll(10_000):
                seqs.append(unpack_seq(sub.recv_multipart()[1]))
                if seqs[-1] >= last:
                    break
            assert seqs and seqs[-1] >= last, f"got up to {seqs[-1:]} of {last}"
            assert daemon.proc.wait(30) == 0
        finally:
            sub.close(linger=0)
            context.term()


def _probe(client: ControlClient, sub: zmq.Socket[bytes]) -> bool:
    client.reset()
    return receive_marker(sub, 0.1) is not None


async def _until(predicate: Callable[[], object]) -> None:
    while not predicate():
        await asyncio.sleep(0.01)
