"""A subscriber of ``kvpubd bench relay``, in a process of its own: one on the engine's PUB
socket, one on kvpubd's, each decoding every batch with vLLM's ``KVEventBatch`` and noting
when each store arrived on the clock every process of the bench shares."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpubd.tools.relay_engine import WARM_HASHES, now_ns

# A phase ends when every block expected has come, or after this long without a measured one
# (batches lost for good never come).
QUIET_S = 3.0


@dataclass
class Tally:
    """What one subscriber received in one phase."""

    batches: int = 0  # batches holding measured events
    events: int = 0  # measured BlockStored and BlockRemoved events
    stored_blocks: int = 0
    removed_blocks: int = 0
    markers: int = 0  # AllBlocksCleared received
    missing_seqs: int = 0  # seqs skipped on this stream
    first_ns: int = 0
    last_ns: int = 0
    busy_s: float = 0.0  # CPU seconds spent decoding
    # The first hash of each BlockStored -> when its batch was received.
    arrivals: dict[int, int] = field(default_factory=dict)


class _Stream:
    def __init__(self, kv_path: str) -> None:
        import msgspec

        from kvpubd.tools.vllm_source import load_kv_events

        kv = load_kv_events(Path(kv_path))
        self._decode = msgspec.msgpack.Decoder(kv.KVEventBatch).decode
        self._stored, self._removed = kv.BlockStored, kv.BlockRemoved
        self._last_seq: int | None = None

    def seq_gap(self, seq: int) -> int:
        gap = 0 if self._last_seq is None else max(0, seq - self._last_seq - 1)
        self._last_seq = seq
        return gap

    def warm_block_in(self, payload: bytes) -> bool:
        return any(
            type(e) is self._stored and e.block_hashes[0] >= WARM_HASHES
            for e in self._decode(payload).events
        )

    def tally(self, tally: Tally, payload: bytes, received_ns: int) -> bool:
        """Count one batch's measured events; whether it held any."""
        started = time.thread_time()
        measured = False
        for event in self._decode(payload).events:
            kind = type(event)
            if kind is self._stored:
                if event.block_hashes[0] >= WARM_HASHES:
                    continue
                tally.stored_blocks += len(event.block_hashes)
                tally.arrivals[event.block_hashes[0]] = received_ns
            elif kind is self._removed:
                tally.removed_blocks += len(event.block_hashes)
            else:
                tally.markers += 1
                continue
            tally.events += 1
            measured = True
        if measured:
            tally.batches += 1
            tally.first_ns = tally.first_ns or received_ns
            tally.last_ns = received_ns
        tally.busy_s += time.thread_time() - started
        return measured


def run_subscriber(kv_path: str, endpoint: str, pipe: Any) -> None:
    """Answers ``"live"`` once a warm-up block came through ``endpoint``; then, per command
    ``(stored_blocks, removed_blocks)``, ``"armed"`` and, once those blocks came (or the
    stream fell quiet), the phase's ``Tally``. ``None`` ends it."""
    import zmq

    stream = _Stream(kv_path)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while True:
        frames = sub.recv_multipart()
        stream.seq_gap(int.from_bytes(frames[1], "big"))
        if stream.warm_block_in(frames[2]):
            break
    pipe.send("live")
    while (command := pipe.recv()) is not None:
        stored, removed = command
        pipe.send("armed")
        tally = Tally()
        quiet_since = time.monotonic()
        while tally.stored_blocks < stored or tally.removed_blocks < removed:
            if not sub.poll(100):
                if time.monotonic() - quiet_since > QUIET_S:
                    break
                continue
            frames = sub.recv_multipart()
            received = now_ns()
            tally.missing_seqs += stream.seq_gap(int.from_bytes(frames[1], "big"))
            if stream.tally(tally, frames[2], received):
                quiet_since = time.monotonic()
        pipe.send(tally)
    sub.close(linger=0)
    ctx.term()
