"""The probe every latency bench measures a daemon with: a DEALER for control requests and a SUB
that watches for the reset marker, both in the bench's own process."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import numpy as np
import zmq

from kvpubd.tools.launcher import DaemonProcess

# The smallest block the pool allows: the bench measures bookkeeping, not memory traffic.
TINY_BLOCKS = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"}
PROMPT_TOKENS = 8192


class ResetProbe:
    """A DEALER for requests and a SUB that watches for the marker, both in this process."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.connect(daemon.control_endpoint)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(daemon.events_endpoint)
        self.client = daemon.client(timeout=60)
        self._ids = 0

    def close(self) -> None:
        self.client.close()
        self.control.close(linger=0)
        self.sub.close(linger=0)
        self.ctx.term()

    def send(self, op: str, **fields: Any) -> int:
        self._ids += 1
        self.control.send_multipart(
            [b"", msgpack.packb({"op": op, "id": self._ids, **fields}, use_bin_type=True)]
        )
        return self._ids

    def recv_reply(self, request_id: int | None = None, timeout: float = 60.0) -> dict[str, Any]:
        """The next reply (to ``request_id`` if given: a late one to an abandoned request is
        skipped); TimeoutError after ``timeout`` s without it."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.control.poll(int(left * 1000)):
                raise TimeoutError(f"the daemon did not answer within {timeout:g} s")
            reply: dict[str, Any] = msgpack.unpackb(self.control.recv_multipart()[-1], raw=False)
            if request_id is None or reply.get("id") == request_id:
                break
        if not reply.get("ok"):
            raise RuntimeError(f"daemon refused a bench request: {reply.get('error')}")
        return reply

    def wait_connected(self, timeout: float = 30.0) -> None:
        """The SUB is live once it receives the batch of a reset sent after connecting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.client.reset(force=True)
            if self.sub.poll(200):
                while self.sub.poll(50):
                    self.sub.recv_multipart()
                return
        raise TimeoutError(f"no reset marker reached the subscriber within {timeout:g} s")

    def populate(self, blocks: int, round_no: int, rank: int = 0) -> None:
        """Cache ``blocks`` full blocks on ``rank`` (8k-token prompts, pipelined, as packed
        uint32), then unpin them."""
        per_prompt = PROMPT_TOKENS // 16
        prompts = -(-blocks // per_prompt)
        rng = np.random.default_rng((round_no, rank))
        sent = 0
        for i in range(prompts):
            size = min(per_prompt, blocks - i * per_prompt) * 16
            tokens = rng.integers(0, 1 << 31, size=size, dtype=np.uint32)
            packed = tokens.astype("<u4").tobytes()
            self.send("store", request_id=f"bench-{i}", token_ids=packed, rank=rank)
            sent += 1
        for _ in range(sent):
            self.recv_reply()
        for i in range(prompts):
            self.send("release", request_id=f"bench-{i}")
        for _ in range(sent):
            self.recv_reply()
        # Let the drain loop publish everything captured, and read it, so a reset's batch
        # holds the marker alone.
        while self.client.stats().ranks[rank].events_pending:
            self.drain_sub(0.01)

    def wait_relaying(self, timeout: float) -> bool:
        """Read the SUB until a batch without the marker comes (the daemon publishes again
        after a reset), then whatever is queued; False when none came within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sub.poll(max(1, int(left * 1000))):
                return False
            if not holds_marker(self.sub.recv_multipart()[2]):
                break
        while self.sub.poll(0):
            self.sub.recv_multipart()
        return True

    def drain_sub(self, quiet_s: float) -> None:
        while self.sub.poll(int(quiet_s * 1000)):
            self.sub.recv_multipart()

    def try_reset(self, timeout: float, **fields: Any) -> tuple[int | None, int | None, int]:
        """Send a reset; (reset sent -> marker received, reset sent -> reply received) in ns,
        None for what did not come within ``timeout`` s; and the reset's request id."""
        start = time.perf_counter_ns()
        deadline = time.monotonic() + timeout
        request_id = self.send("reset", force=True, **fields)
        marker = reply = None
        while marker is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sub.poll(max(1, int(left * 1000))):
                return None, None, request_id
            if holds_marker(self.sub.recv_multipart()[2]):
                marker = time.perf_counter_ns() - start
        try:
            self.recv_reply(request_id, max(0.001, deadline - time.monotonic()))
            reply = time.perf_counter_ns() - start
        except TimeoutError:
            pass
        return marker, reply, request_id

    def time_reset(self, timeout: float = 60.0, **fields: Any) -> tuple[int, int]:
        """(reset sent -> marker received, reset sent -> reply received), in ns."""
        marker, reply, _ = self.try_reset(timeout, **fields)
        if marker is None or reply is None:
            raise TimeoutError(f"a reset was not published and answered within {timeout:g} s")
        return marker, reply


def holds_marker(payload: bytes) -> bool:
    """Whether a batch holds the reset marker (decoded only when its name is in the bytes:
    a saturated stream's batches are read as fast as they come)."""
    if b"AllBlocksCleared" not in payload:
        return False
    return any(is_marker(e) for e in msgpack.unpackb(payload, raw=False)[1])


def is_marker(event: Any) -> bool:
    if isinstance(event, dict):
        return event.get("type") == "AllBlocksCleared"
    return bool(event) and event[0] == "AllBlocksCleared"
