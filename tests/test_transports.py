"""A new transport is one module and one line in the registry: a transport defined and
registered here, and nowhere else, carries a real in-process daemon's batches, the very ones
the ZeroMQ transport sends, with no change to the pipeline, the service or the operations."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvpubd.daemon.service import Service
from kvpubd.daemon.settings import ConfigError
from kvpubd.daemon.transports import (
    TRANSPORTS,
    Listener,
    TransportSetup,
    check_transport,
)
from kvpubd.protocol.wire import decode_batch, unpack_seq
from tests.loop_turns import settled, started_service
from tests.test_layout import loaded_by

TINY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8", "num_blocks": 64}
BOUND_S = 20.0  # a bound against hanging, far above anything a healthy daemon needs

Batch = tuple[int, Any]  # (seq, the decoded batch but its ts)


class Captured:
    """The test-only transport: every batch it is handed, kept in this process."""

    endpoint = "inproc://captured"
    replay_endpoint = ""
    replay_requests = 0
    replays_refused = 0
    snapshot_endpoint = ""
    snapshot_requests = 0
    snapshots_unavailable = 0

    def __init__(self, setup: TransportSetup) -> None:
        self.rank = setup.rank
        self.sent: list[tuple[bytes, bytes]] = []
        self.serving = False
        self.closed = False

    def send(self, seq_frame: bytes, payload: bytes) -> None:
        self.sent.append((seq_frame, payload))

    def listeners(self) -> list[Listener]:
        return []

    def start(self) -> None:
        self.serving = True

    def stop(self) -> None:
        self.serving = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def captured_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TRANSPORTS, "captured", Captured)  # the one registry line


def service_sections(publisher: str) -> dict[str, dict[str, Any]]:
    return {"events": {"publisher": publisher, "seq_origin": "zero"}, "cache": TINY}


async def call(service: Service, op: str, **fields: Any) -> dict[str, Any]:
    assert service.control is not None
    frame = msgpack.packb({"op": op, "id": 0, **fields}, use_bin_type=True)
    reply = service.control.handle_frames([b"peer", b"", frame])
    assert reply is not None
    answer = await settled(reply)
    assert answer["ok"], answer
    return answer


def tokens(*ranges: range) -> bytes:
    return np.concatenate([np.arange(r.start, r.stop, dtype="<u4") for r in ranges]).tobytes()


async def scenario(service: Service) -> tuple[int, int]:
    """Stores sharing a prefix, releases, a reset and a store after it, every batch out; the
    seqs of the scenario's first and last batches."""
    pipeline = service.pipelines[0]
    pipeline.flush()
    first = pipeline.publisher.history.next_seq
    await call(service, "store", request_id="a", token_ids=tokens(range(64)))
    await call(service, "store", request_id="b", token_ids=tokens(range(32), range(100, 132)))
    pipeline.flush()
    await call(service, "release", request_id="a")
    await call(service, "release", request_id="b")
    await call(service, "reset")  # its marker goes out at once
    await call(service, "store", request_id="c", token_ids=tokens(range(200, 248)))
    await call(service, "release", request_id="c")
    pipeline.flush()
    return first, pipeline.publisher.last_seq


def decoded(seq_frame: bytes, payload: bytes, first: int) -> Batch:
    batch = decode_batch(payload)
    return unpack_seq(seq_frame) - first, (batch.events, batch.data_parallel_rank)


async def over_zmq(tmp_path: Path) -> list[Batch]:
    """The scenario's batches as a subscriber of the ZeroMQ transport reads them."""
    async with started_service(tmp_path, **service_sections("zmq")) as service:
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.LINGER, 0)
        try:
            sub.connect(service.pipelines[0].publisher.endpoint)
            # Empty batches until one arrives: from then on the subscription is live.
            while not sub.poll(10):
                service.pipelines[0].publisher.publish([])
            first, last = await scenario(service)
            got: list[Batch] = []
            deadline = time.monotonic() + BOUND_S
            while not got or got[-1][0] < last - first:
                assert sub.poll(max(1, int((deadline - time.monotonic()) * 1000))), got
                topic, seq_frame, payload = sub.recv_multipart()
                assert topic == b""
                if unpack_seq(seq_frame) >= first:
                    got.append(decoded(seq_frame, payload, first))
            return got
        finally:
            sub.close()
            context.term()


async def test_a_transport_registered_in_one_line_carries_what_zmq_sends(
    tmp_path: Path, captured_registered: None
) -> None:
    expected = await over_zmq(tmp_path / "zmq")
    async with started_service(tmp_path / "captured", **service_sections("captured")) as service:
        transport = service.pipelines[0].publisher.transport
        assert isinstance(transport, Captured) and transport.serving
        first, last = await scenario(service)
        # Every batch of the run (seq_origin "zero"), in order, the scenario's as over zmq.
        assert [unpack_seq(frame) for frame, _ in transport.sent] == list(range(last + 1))
        got = [decoded(frame, payload, first) for frame, payload in transport.sent[first:]]
        assert got == expected
        assert len(expected) >= 3  # the stores, the marker (with the releases), the last store
        # ping and stats report the transport's own endpoints and counters.
        (endpoints,) = (await call(service, "ping"))["endpoints"]
        assert (endpoints["events"], endpoints["replay"]) == ("inproc://captured", "")
        (stats,) = (await call(service, "stats"))["ranks"]
        assert (stats["endpoint"], stats["seq"], stats["replay_requests"]) == (
            "inproc://captured",
            last,
            0,
        )
    assert transport.closed and not transport.serving


async def test_the_null_transport_publishes_nowhere_and_keeps_numbering(tmp_path: Path) -> None:
    async with started_service(tmp_path, **service_sections("null")) as service:
        publisher = service.pipelines[0].publisher
        before = publisher.history.batches
        first, last = await scenario(service)
        assert last - first + 1 == publisher.history.batches - before >= 3
        (endpoints,) = (await call(service, "ping"))["endpoints"]
        assert (endpoints["events"], endpoints["replay"]) == ("", "")


def test_an_unknown_transport_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"^events.publisher: 'nats' is no transport .*zmq"):
        check_transport("nats")
    check_transport("null")


@pytest.mark.process
def test_the_history_needs_no_zeromq() -> None:
    """What was published (seqs, the ring, heartbeats, snapshots of lost history) is apart
    from how it travels."""
    loaded = loaded_by("import kvpubd.daemon.history")
    assert "kvpubd.daemon.history" in loaded and "zmq" not in loaded
