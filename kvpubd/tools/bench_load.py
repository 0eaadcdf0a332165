"""Loads for ``kvpubd bench reset --under LOAD``, each in its own processes (no shared GIL with
the bench that times resets).

A load runs while its ``go`` event is set and idles while it is clear (the bench clears it to
refill the cache), and ends when ``stop`` is set; ``ops`` counts operations started, so the
bench can send its reset while one is in progress. Every wait in here is bounded, so a daemon
that stops answering never hangs a load process. Each process puts one dict of what it did on
``results`` as it ends.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import resource
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from kvpubd.interrupts import ctrl_c_kept_from_children
from kvpubd.tools.launcher import tied

LOADS = ("snapshot", "snapshot-endpoint", "replay-flood", "big-store", "idle-conns")
# The rank a load works on; the bench resets rank 0 alone, so a load's own cache survives.
LOAD_RANK = 1
POLL_MS = 100  # how often a blocked load process looks at stop and go


class SharedFlag:
    """A flag the processes of one multiprocessing context share, without a lock or condition
    anyone waits on. A multiprocessing Event's set() waits for every process waiting on it to
    wake, and one killed while waiting never does: a signal to the whole process group (as
    ``timeout`` sends) left a bench hung in set() for good. Waiting polls, every 5 ms."""

    def __init__(self, ctx: Any) -> None:
        self._value = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def clear(self) -> None:
        self._value.value = 0

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, timeout: float) -> bool:
        """Whether the flag is set, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._value.value:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.005, left))  # polling: nothing here can be left waiting
        return True


@dataclass
class LoadControl:
    """The shared flags and counters of one load's processes."""

    go: SharedFlag
    stop: SharedFlag
    ops: Any
    ready: Any  # processes set up (connected, connections opened)
    results: Any

    @classmethod
    def shared(cls, ctx: Any) -> LoadControl:
        """Fresh flags and counters that the processes of the multiprocessing ``ctx`` share."""
        flags = SharedFlag(ctx), SharedFlag(ctx)
        return cls(*flags, ctx.Value("q", 0), ctx.Value("q", 0), ctx.Queue())

    def set_ready(self) -> None:
        with self.ready.get_lock():
            self.ready.value += 1


@dataclass
class LoadSpec:
    """What a load needs to run against one daemon."""

    name: str
    control_endpoint: str
    replay_endpoint: str
    events_endpoint: str
    metrics_port: int
    snapshot_blocks: int = 200_000
    store_tokens: int = 1_000_000
    flood_processes: int = 4
    idle_connections: int = 2000
    # snapshot-endpoint: the load rank's snapshot endpoint, its clients, and how many
    # requests each makes before it ends (0: until stopped).
    snapshot_endpoint: str = ""
    snapshot_clients: int = 8
    requests_per_client: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def send_request(sock: zmq.Socket[bytes], request: dict[str, Any]) -> None:
    sock.send_multipart([b"", msgpack.packb(request, use_bin_type=True)])


def _await_replies(
    sock: zmq.Socket[bytes],
    request_ids: list[int],
    control: LoadControl,
    timeout: float,
    tolerated: frozenset[str] = frozenset(),
) -> list[str]:
    """Wait for the replies to ``request_ids`` (a late one to an earlier request is skipped),
    until all came, or stop, or ``timeout``; what went wrong, one line per request: refused
    (unless with a ``tolerated`` error code) or unanswered. Empty on stop."""
    waiting = set(request_ids)
    wrong: list[str] = []
    deadline = time.monotonic() + timeout
    while waiting and not control.stop.is_set() and time.monotonic() < deadline:
        if sock.poll(POLL_MS):
            reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
            if reply.get("id") in waiting:
                waiting.discard(reply["id"])
                # A batch's own requests are answered in its reply, each ok or refused.
                for answer in [reply, *(reply.get("replies") or [])]:
                    error = answer.get("error") or {}
                    if not answer.get("ok") and error.get("code") not in tolerated:
                        wrong.append(f"refused: {error.get('code')}: {error.get('message')}")
    if control.stop.is_set():
        return []
    return [*wrong, *(f"unanswered after {timeout:g} s" for _ in waiting)]


def rounds(control: LoadControl) -> Iterator[int]:
    """0, 1, ...: a load's rounds, each once ``go`` is set, until ``stop`` is set."""
    for n in itertools.count():
        while not control.go.wait(POLL_MS / 1000):
            if control.stop.is_set():
                return
        if control.stop.is_set():
            return
        yield n


def request_loop(
    control: LoadControl,
    endpoint: str,
    next_requests: Callable[[int], list[dict[str, Any]]],
    label: str,
    reply_timeout: float = 600.0,
    tolerated: frozenset[str] = frozenset(),
    pipelined: bool = False,
) -> None:
    """Send the requests of ``next_requests(n)`` for each round n: one after another, each
    awaiting its reply, or with ``pipelined`` all back to back and then their replies. Times
    the first request of each round (pipelined: the whole round); a request refused (unless
    with a ``tolerated`` code) or unanswered within ``reply_timeout`` is a failure."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    ids = itertools.count(1)
    durations: list[float] = []
    failures = 0
    first_failures: list[str] = []  # what the first of them were, and when
    control.set_ready()
    began = time.monotonic()
    try:
        for n in rounds(control):
            # The id first, long token lists last (msgpack keeps the order).
            batch = [{"id": next(ids), **request} for request in next_requests(n)]
            waves = [batch] if pipelined else [[request] for request in batch]
            for i, wave in enumerate(waves):
                started = time.perf_counter()
                for request in wave:
                    send_request(sock, request)
                if i == 0:
                    with control.ops.get_lock():
                        control.ops.value += 1
                wave_ids = [request["id"] for request in wave]
                wrong = _await_replies(sock, wave_ids, control, reply_timeout, tolerated)
                if control.stop.is_set():
                    return
                if i == 0:
                    durations.append(time.perf_counter() - started)
                failures += len(wrong)
                if wrong and len(first_failures) < 3:
                    at = round(time.monotonic() - began, 1)
                    first_failures += [f"at {at} s: {line}" for line in wrong[:1]]
    finally:
        sock.close()
        ctx.term()
        control.results.put(
            {
                "load": label,
                "ops": len(durations),
                "failures": failures,
                "first_failures": first_failures,
                "op_p50_ms": _ms(durations, 50),
                "op_max_ms": round(max(durations) * 1000, 1) if durations else None,
            }
        )


def _ms(seconds: list[float], q: float) -> float | None:
    return round(float(np.percentile(seconds, q)) * 1000, 1) if seconds else None


def snapshot_load(control: LoadControl, spec: LoadSpec) -> None:
    """One client asking for the snapshot of the load rank's cache, again and again."""
    request_loop(
        control,
        spec.control_endpoint,
        lambda n: [{"op": "snapshot", "rank": LOAD_RANK}],
        "snapshot",
    )


def snapshot_endpoint_load(control: LoadControl, spec: LoadSpec) -> None:
    """One REQ client of the snapshot endpoint (vLLM's snapshot protocol) asking again and
    again, each request timed to the whole reply. A reply whose events (counted from its
    batch headers) are not the ``snapshot_blocks`` the rank holds is counted as wrong;
    "unavailable" (-2) replies and requests unanswered within a minute are counted too."""
    from kvpubd.tools.snapshot_client import SnapshotMismatch, SnapshotRequester, counted_events

    ctx = zmq.Context()
    requester = SnapshotRequester(ctx, spec.snapshot_endpoint)
    latencies: list[float] = []
    counts = {"timeouts": 0, "unavailable": 0, "wrong_events": 0, "malformed": 0}
    reply_bytes = 0
    control.set_ready()
    try:
        for n in rounds(control):
            if spec.requests_per_client and n >= spec.requests_per_client:
                return
            with control.ops.get_lock():
                control.ops.value += 1
            try:
                reply = requester.request(60.0, control.stop.is_set)
            except SnapshotMismatch:
                counts["malformed"] += 1
                continue
            if control.stop.is_set():
                return
            if reply is None:
                counts["timeouts"] += 1
            elif reply.unavailable:
                counts["unavailable"] += 1
            else:
                latencies.append(reply.seconds)
                reply_bytes = max(reply_bytes, reply.nbytes)
                try:
                    events = counted_events(reply.chunks)
                except SnapshotMismatch:
                    events = -1
                counts["wrong_events"] += events != spec.snapshot_blocks
    finally:
        requester.close()
        ctx.term()
        control.results.put(
            {
                "load": "snapshot-endpoint",
                "ops": len(latencies),
                **counts,
                "reply_bytes": reply_bytes,
                "latencies_s": latencies,
            }
        )


def client_summary(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The snapshot-endpoint clients' reports as one: every request's latency pooled into
    percentiles, the failures summed. The reports lose their raw latencies."""
    latencies = [s for report in reports for s in report.pop("latencies_s", [])]
    keys = ("timeouts", "unavailable", "wrong_events", "malformed")
    return {
        "clients": len(reports),
        "requests": len(latencies),
        "p50_ms": _ms(latencies, 50),
        "p99_ms": _ms(latencies, 99),
        "max_ms": round(max(latencies) * 1000, 1) if latencies else None,
        **{key: sum(int(report.get(key, 0)) for report in reports) for key in keys},
        "reply_bytes": max((int(report.get("reply_bytes", 0)) for report in reports), default=0),
    }


def big_store_load(control: LoadControl, spec: LoadSpec) -> None:
    """One client storing the largest allowed prompt (fresh tokens each time, so every block
    is hashed, inserted and published, evicting the last one's) and releasing it."""
    rng = np.random.default_rng(7)

    def store_and_release(n: int) -> list[dict[str, Any]]:
        tokens = rng.integers(0, 1 << 31, size=spec.store_tokens, dtype=np.uint32)
        request_id = f"big-{n}"
        return [
            {
                "op": "store",
                "rank": LOAD_RANK,
                "request_id": request_id,
                "token_ids": tokens.astype("<u4").tobytes(),
            },
            {"op": "release", "request_id": request_id},
        ]

    request_loop(control, spec.control_endpoint, store_and_release, "big-store")


def replay_flood_load(control: LoadControl, spec: LoadSpec) -> None:
    """One DEALER sending replay requests from seq 0 as fast as the socket takes them and
    never reading the replies (an unauthenticated peer of the replay port can)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, POLL_MS)
    sock.connect(spec.replay_endpoint)
    request = [b"", (0).to_bytes(8, "big")]
    sent = 0
    control.set_ready()
    try:
        for _ in rounds(control):
            try:
                for _ in range(100):
                    sock.send_multipart(request)
                    sent += 1
            except zmq.Again:  # the socket's queue is full: the daemon is behind
                pass
            with control.ops.get_lock():
                control.ops.value += 1
    finally:
        sock.close()
        ctx.term()
        control.results.put({"load": "replay-flood", "requests_sent": sent})


# ZMTP 3.0 greeting for the NULL mechanism, as a client (as-server 0).
_ZMTP_GREETING = (
    b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
)


def _zmtp_hello(socket_type: bytes) -> bytes:
    """Greeting and READY command of an idle peer of the given ZeroMQ socket type: the
    handshake completes, so libzmq keeps the connection (an incomplete one it drops)."""
    body = b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return _ZMTP_GREETING + bytes([0x04, len(body)]) + body


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's soft fd limit towards ``wanted`` (at most the hard limit); returns
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def idle_conns_load(control: LoadControl, spec: LoadSpec) -> None:
    """``idle_connections`` TCP connections spread over the PUB, replay and metrics ports,
    held open and idle: ZeroMQ peers that finish the handshake and then say nothing, HTTP
    peers that never send a request. One the daemon closes is opened again."""
    limit = raise_fd_limit(spec.idle_connections + 256)
    count = min(spec.idle_connections, limit - 64)
    targets: list[tuple[int, bytes]] = []
    for endpoint, hello in (
        (spec.events_endpoint, _zmtp_hello(b"SUB")),
        (spec.replay_endpoint, _zmtp_hello(b"DEALER")),
    ):
        targets.append((int(endpoint.rpartition(":")[2]), hello))
    if spec.metrics_port:
        targets.append((spec.metrics_port, b""))
    selector = selectors.DefaultSelector()
    opened = reopened = refused = 0

    def connect(slot: int) -> None:
        nonlocal opened, refused
        port, hello = targets[slot % len(targets)]
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            if hello:
                sock.sendall(hello)
            sock.setblocking(False)
        except OSError:
            refused += 1
            return
        selector.register(sock, selectors.EVENT_READ, slot)
        opened += 1

    try:
        for slot in range(count):
            connect(slot)
        control.set_ready()
        while not control.stop.is_set():
            with control.ops.get_lock():
                control.ops.value = len(selector.get_map())
            for key, _ in selector.select(POLL_MS / 1000):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)  # the daemon's greeting: read and ignored
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the daemon: hold the connection again
                    selector.unregister(sock)
                    sock.close()
                    reopened += 1
                    connect(key.data)
    finally:
        held = len(selector.get_map())
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()
        control.results.put(
            {
                "load": "idle-conns",
                "wanted": spec.idle_connections,
                "held_at_end": held,
                "opened": opened,
                "reopened": reopened,
                "refused": refused,
                "fd_soft_limit": limit,
            }
        )


class Load:
    """A load's processes, started on entry and stopped (bounded waits) on exit."""

    def __init__(self, spec: LoadSpec) -> None:
        if spec.name not in LOADS:
            raise ValueError(f"unknown load {spec.name!r}; known: {', '.join(LOADS)}")
        self.spec = spec
        ctx = multiprocessing.get_context("spawn")
        self.control = LoadControl.shared(ctx)
        target, copies = {
            "snapshot": (snapshot_load, 1),
            "snapshot-endpoint": (snapshot_endpoint_load, spec.snapshot_clients),
            "big-store": (big_store_load, 1),
            "replay-flood": (replay_flood_load, spec.flood_processes),
            "idle-conns": (idle_conns_load, 1),
        }[spec.name]
        self.processes = [
            ctx.Process(**tied(target, (self.control, spec)), daemon=True) for _ in range(copies)
        ]
        self.results: list[dict[str, Any]] = []

    @property
    def ops(self) -> int:
        return int(self.control.ops.value)

    def run(self) -> None:
        self.control.go.set()

    def hold(self) -> None:
        """No new operations from now on (one in flight finishes)."""
        self.control.go.clear()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every process of the load is set up."""
        deadline = time.monotonic() + timeout
        while self.control.ready.value < len(self.processes):
            if time.monotonic() > deadline or not all(p.is_alive() for p in self.processes):
                return False
            time.sleep(0.01)
        return True

    def collect(self, timeout: float) -> bool:
        """Wait until every process has put its report (each puts one as it ends) and keep
        them in ``results``; whether all came within ``timeout``."""
        deadline = time.monotonic() + timeout
        while len(self.results) < len(self.processes):
            try:
                left = max(0.1, deadline - time.monotonic())
                self.results.append(self.control.results.get(timeout=min(left, 1.0)))
            except queue.Empty:
                given_up = time.monotonic() > deadline or not any(
                    p.is_alive() for p in self.processes
                )
                # One that died reports nothing; the others' reports may still be queued.
                if given_up and self.control.results.empty():
                    return False
        return True

    def wait_active(self, after: int, timeout: float) -> bool:
        """Wait until ``ops`` passes ``after``: an operation of this load has started. Idle
        connections are no operations: they are active once most are held."""
        deadline = time.monotonic() + timeout
        while (
            self.ops < 0.9 * self.spec.idle_connections
            if self.spec.name == "idle-conns"
            else self.ops <= after
        ):
            if time.monotonic() > deadline or not any(p.is_alive() for p in self.processes):
                return False
            time.sleep(0.001)
        return True

    def __enter__(self) -> Load:
        with ctrl_c_kept_from_children():  # Ctrl-C is the bench's to handle: __exit__ stops them
            for process in self.processes:
                process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.control.stop.set()
        self.control.go.set()
        deadline = time.monotonic() + 10
        self.collect(10)  # a process that died or hangs reports nothing
        for process in self.processes:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
