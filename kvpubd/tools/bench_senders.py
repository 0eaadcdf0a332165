"""The clients that send ``kvpubd bench throughput``'s store requests: one sending process per
rank (each with its own DEALER, its share of the prompts dealt out round-robin, and ``window``
requests in flight), or all ranks from the bench's own process over one DEALER per daemon, with
``window`` requests in flight per rank either way. Each reports the CPU it spent, so that a
sender that sets the rate shows (near 100 % of a CPU)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from kvpubd.tools.bench_prompts import make_prompts, share_of_prompts

# A sender gives up on a daemon silent for this long.
REPLY_TIMEOUT_MS = 60_000


def _store_and_release(position: int, rank: int, prompt: bytes) -> list[bytes]:
    """The two requests of one prompt: a store (the request id is the prompt's position: unique
    across ranks) and its release. Each request's id is its position times two (plus one)."""
    store = {"op": "store", "id": 2 * position, "request_id": position, "rank": rank}
    release = {"op": "release", "id": 2 * position + 1, "request_id": position}
    # The token list last (msgpack keeps the order): the daemon reads the small fields first.
    return [
        msgpack.packb({**store, "token_ids": prompt}, use_bin_type=True),
        msgpack.packb(release, use_bin_type=True),
    ]


def _batches(share: Sequence[tuple[int, bytes]], rank: int, size: int) -> list[bytes]:
    """``size`` prompts' stores per ``batch`` message, each with the releases of the previous
    message's stores (as an engine has them at a scheduler step: new requests in, finished
    ones out); a last message of releases alone."""
    messages: list[bytes] = []
    previous: list[int] = []
    for start in range(0, len(share) + size, size):
        chunk = share[start : start + size]
        if not chunk and not previous:
            break
        entries: list[dict[str, Any]] = [
            {"op": "store", "request_id": position, "token_ids": prompt}
            for position, prompt in chunk
        ]
        entries += [{"op": "release", "request_id": position} for position in previous]
        batch = {"op": "batch", "id": len(messages), "rank": rank, "requests": entries}
        messages.append(msgpack.packb(batch, use_bin_type=True))
        previous = [position for position, _ in chunk]
    return messages


class _Failures:
    """Refused requests: counted, with the first error kept for the report."""

    def __init__(self) -> None:
        self.count = 0
        self.first: Any = None

    def note(self, reply: dict[str, Any]) -> None:
        if not reply.get("ok"):
            self.count += 1
            self.first = self.first or reply.get("error")


def send_rank_share(
    control_endpoint: str,
    rank: int,
    ranks: int,
    requests: int,
    window: int,
    batch: int,
    pipe: Any,
) -> None:
    """Sending process of one rank: its share of the prompts (positions rank, rank + ranks,
    ...), store + release each, ``window`` requests in flight (with ``batch`` > 1: that many
    stores per ``batch`` message, see _batches, and window / batch / 2 messages in flight, at
    least 2). "ready" once connected; sends on the bench's word; answers what it did and the
    CPU and time that took."""
    share = share_of_prompts(requests, rank, ranks)
    if batch > 1:
        messages = _batches(share, rank, batch)
        most = max(2, window // (2 * batch))
    else:
        messages = [
            m for position, prompt in share for m in _store_and_release(position, rank, prompt)
        ]
        most = window
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control_endpoint)
    pipe.send("ready")
    pipe.recv()
    cpu, start = time.process_time(), time.monotonic()
    failures = _Failures()
    sent = in_flight = 0
    while sent < len(messages) or in_flight:
        while sent < len(messages) and in_flight < most:
            sock.send_multipart([b"", messages[sent]])
            sent += 1
            in_flight += 1
        if not sock.poll(REPLY_TIMEOUT_MS):
            failures.count += in_flight
            failures.first = failures.first or f"no reply within {REPLY_TIMEOUT_MS} ms"
            break
        while in_flight and sock.poll(0):
            reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
            failures.note(reply)
            for entry in reply.get("replies", []):  # a batch's requests
                failures.note(entry)
            in_flight -= 1
    pipe.send(
        {
            "requests": len(share),
            "messages": len(messages),
            "failures": failures.count,
            "first_error": failures.first,
            "cpu_s": time.process_time() - cpu,
            "wall_s": time.monotonic() - start,
        }
    )
    sock.close()
    ctx.term()


def send_in_process(
    sockets: Sequence[zmq.Socket[bytes]], route: Sequence[int], requests: int, window: int
) -> dict[str, Any]:
    """Every rank's share from this process: ``sockets[route[rank]]`` is the DEALER of the
    daemon serving ``rank`` (``len(route)`` ranks); prompts round-robin over the ranks,
    ``window`` requests in flight per rank. The prompts are made before the clock starts."""
    prompts = make_prompts(requests)
    ranks = len(route)
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    in_flight = [0] * ranks
    failures = _Failures()
    next_of_rank = list(range(ranks))  # the next position each rank sends
    cpu, start = time.process_time(), time.monotonic()
    while any(p < requests for p in next_of_rank) or any(in_flight):
        for rank in range(ranks):
            while next_of_rank[rank] < requests and in_flight[rank] < window:
                position = next_of_rank[rank]
                sock = sockets[route[rank]]
                for request in _store_and_release(position, rank, prompts[position]):
                    sock.send_multipart([b"", request])
                next_of_rank[rank] += ranks
                in_flight[rank] += 2
        ready = poller.poll(REPLY_TIMEOUT_MS)
        if not ready:
            raise TimeoutError(f"the daemons did not answer within {REPLY_TIMEOUT_MS} ms")
        for sock, _ in ready:
            while sock.poll(0):
                reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
                failures.note(reply)
                # The position (hence the rank) is in the request's id.
                in_flight[(int(reply["id"]) // 2) % ranks] -= 1
    return {
        "requests": requests,
        "failures": failures.count,
        "first_error": failures.first,
        "cpu_s": time.process_time() - cpu,
        "wall_s": time.monotonic() - start,
    }
