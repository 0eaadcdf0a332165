"""Reset latency on every rank of one service (``kvpubd bench throughput --fill-blocks N``, or
``--ranks N --load-fraction F``): each round fills every rank's cache to ``fill_blocks`` (all
ranks at once, one filling process per rank), then one ``reset`` of every rank (no rank field)
is timed from its send to the ``AllBlocksCleared`` received on each rank's own stream, and to
the reply. First with the service idle, then for each load fraction F while a paced load stores
at F x the capacity measured at N ranks, spread round-robin over the ranks.

Each rank's stream is read by a process of its own that drains it as it comes (a byte search
for the marker, no decoding) and reports each marker's seq and arrival time (CLOCK_MONOTONIC,
the same in every process); the reply names each rank's marker seq, which ties the two."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from multiprocessing.connection import wait
from typing import Any

import msgpack
import numpy as np
import zmq

from kvpubd.tools.bench_children import answer, start_child
from kvpubd.tools.bench_probe import PROMPT_TOKENS, TINY_BLOCKS
from kvpubd.tools.bench_prompts import iter_prompts
from kvpubd.tools.bench_report import err, summary
from kvpubd.tools.bench_reset_floor import ResetFloor
from kvpubd.tools.launcher import DaemonProcess
from kvpubd.tools.service_cpu import rank_workers

FILL_WINDOW = 64  # requests in flight per filling process
LOAD_WINDOW = 64  # requests in flight per paced load process: a paced client, not a flood
# A loaded round runs the load this long before its reset: the load is at its pace by then
# (it keeps its schedule from its start) and the daemon busy with it.
LOADED_S = 0.5
MARKER_TIMEOUT_S = 60.0
BLOCK_TOKENS = 16
# Fewer rounds by default where each fills this many blocks per rank or more (a 1M-block fill
# of every rank takes seconds).
LARGE_FILL = 1_000_000


def default_rounds(fill_blocks: int) -> int:
    return 20 if fill_blocks >= LARGE_FILL else 50


# -- the processes ---------------------------------------------------------------------------


def watch_markers(endpoint: str, pipe: Any) -> None:
    """One rank's stream, drained as it comes: ("marker", seq, arrival ns) for each batch
    holding AllBlocksCleared; a seq from the bench is answered ("reached", seq) once the batch
    of that seq was read (so that a reset's marker is not timed from behind the backlog of a
    fill, which a subscriber that keeps up would have read); on None from the bench, its
    totals (batches, seq gaps) and end."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(pipe.fileno(), zmq.POLLIN)
    batches = gaps = 0
    last_seq: int | None = None
    wanted: int | None = None
    while True:
        ready = dict(poller.poll(1000))
        if sub in ready:
            while sub.poll(0):
                _, seq_frame, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_frame, "big")
                if b"AllBlocksCleared" in payload:
                    pipe.send(("marker", seq, time.monotonic_ns()))
                gaps += last_seq is not None and seq != last_seq + 1
                last_seq = seq
                batches += 1
        if pipe.fileno() in ready:
            command = pipe.recv()
            if command is None:
                break
            wanted = command
        if wanted is not None and last_seq is not None and last_seq >= wanted:
            pipe.send(("reached", wanted, 0))
            wanted = None
    pipe.send({"batches": batches, "gaps": gaps})
    sub.close(linger=0)
    ctx.term()


def _replies(sock: zmq.Socket[bytes], count: int, timeout_s: float) -> tuple[int, Any]:
    """Read ``count`` replies; (how many were refused, the first refusal's error)."""
    refused, first = 0, None
    for _ in range(count):
        if not sock.poll(int(timeout_s * 1000)):
            return refused + count, f"no reply within {timeout_s:g} s"
        reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
        if not reply.get("ok"):
            refused += 1
            first = first or reply.get("error")
    return refused, first


def fill_rank(control_endpoint: str, rank: int, fill_blocks: int, pipe: Any) -> None:
    """One rank's filling process: for each round number from the bench, store (and release)
    fresh 8k-token prompts as packed uint32 until ``fill_blocks`` blocks are cached on the
    rank, ``FILL_WINDOW`` requests in flight; answers (refused, first error). None: end."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control_endpoint)
    per_prompt = PROMPT_TOKENS // BLOCK_TOKENS
    while (round_no := pipe.recv()) is not None:
        rng = np.random.default_rng((round_no, rank))
        refused, first, in_flight, ids = 0, None, 0, 0
        for i in range(-(-fill_blocks // per_prompt)):
            size = min(per_prompt, fill_blocks - i * per_prompt) * BLOCK_TOKENS
            tokens = rng.integers(0, 1 << 31, size=size, dtype=np.uint32).astype("<u4")
            request_id = f"fill{rank}-{round_no}-{i}"
            for request in (
                {"op": "store", "rank": rank, "request_id": request_id,
                 "token_ids": tokens.tobytes()},
                {"op": "release", "request_id": request_id},
            ):  # fmt: skip
                ids += 1
                sock.send_multipart([b"", msgpack.packb({"id": ids, **request})])
            in_flight += 2
            if in_flight >= FILL_WINDOW:
                more, error = _replies(sock, in_flight - FILL_WINDOW // 2, 600)
                refused, first = refused + more, first or error
                in_flight = FILL_WINDOW // 2
        more, error = _replies(sock, in_flight, 600)
        pipe.send((refused + more, first or error))
    sock.close()
    ctx.term()


def paced_rank_load(control_endpoint: str, rank: int, rate: float, pipe: Any) -> None:
    """One rank's share of the paced load: store + release of realistic prompts (fresh ones:
    shared prefixes, new bodies) at ``rate`` stores/s from the bench's "go" to its next word;
    on "pause" it answers "paused" (the replies in flight read); on None it answers its totals
    and ends. Refusals (a forced reset drops open requests) are counted."""
    prompts: Iterator[bytes] = iter_prompts(1 << 40, seed=1000 + rank)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control_endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(pipe.fileno(), zmq.POLLIN)
    stores = refused = in_flight = ids = 0
    running_s = 0.0
    command = pipe.recv()
    while command is not None:
        if command == "pause":
            pipe.send("paused")
            command = pipe.recv()
            continue
        # "go": one run until the next word, on its own schedule from its start.
        start, sent = time.monotonic(), 0
        while True:
            now = time.monotonic()
            due = start + sent / rate
            if now >= due and in_flight < LOAD_WINDOW:
                request_id = f"load{rank}-{stores}"
                for request in (
                    {"op": "store", "rank": rank, "request_id": request_id,
                     "token_ids": next(prompts)},
                    {"op": "release", "request_id": request_id},
                ):  # fmt: skip
                    ids += 1
                    sock.send_multipart([b"", msgpack.packb({"id": ids, **request})])
                sent += 1
                stores += 1
                in_flight += 2
                continue
            wait_ms = max(0, math.ceil((due - now) * 1000)) if in_flight < LOAD_WINDOW else 100
            ready = dict(poller.poll(wait_ms))
            if sock in ready:
                while in_flight and sock.poll(0):
                    reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
                    refused += not reply.get("ok")
                    in_flight -= 1
            if pipe.fileno() in ready:
                command = pipe.recv()
                break
        running_s += time.monotonic() - start
        more, _ = _replies(sock, in_flight, 60)
        refused, in_flight = refused + more, 0
    pipe.send({"stores": stores, "refused": refused, "seconds": running_s})
    sock.close()
    ctx.term()


# -- the bench -------------------------------------------------------------------------------


class _Markers:
    """Every marker the watchers reported so far, by rank and seq."""

    def __init__(self, pipes: list[Any]) -> None:
        self.pipes = pipes
        self.seen: list[dict[int, int]] = [{} for _ in pipes]
        self.reached: list[int] = [-1 for _ in pipes]

    def collect(self, timeout_s: float) -> None:
        ready = wait(self.pipes, timeout_s)
        for rank, pipe in enumerate(self.pipes):
            while pipe in ready and pipe.poll(0):
                kind, seq, arrived = pipe.recv()
                if kind == "reached":
                    self.reached[rank] = max(self.reached[rank], seq)
                else:
                    self.seen[rank][seq] = arrived

    def read_up_to(self, seqs: list[int], timeout_s: float = 300) -> None:
        """Until every watcher has read its rank's batches up to ``seqs[rank]``."""
        for pipe, seq in zip(self.pipes, seqs, strict=True):
            pipe.send(seq)
        deadline = time.monotonic() + timeout_s
        while any(r < s for r, s in zip(self.reached, seqs, strict=True)):
            if time.monotonic() > deadline:
                raise TimeoutError("the rank watchers did not read the fill's batches")
            self.collect(0.05)

    def arrival(self, rank: int, seq: int, deadline: float) -> int | None:
        """When rank's marker ``seq`` arrived (ns), waiting until ``deadline`` for it."""
        while seq not in self.seen[rank] and time.monotonic() < deadline:
            self.collect(max(0.0, min(0.1, deadline - time.monotonic())))
        return self.seen[rank].get(seq)


def measure_rank_resets(
    ranks: int,
    fill_blocks: int,
    load_fractions: list[float],
    rounds: int,
    capacity_rps: float,
    rank_processes: str = "auto",
    idle_ms: float = 20.0,
) -> dict[str, Any]:
    """Per rank: reset sent -> its marker received, ``rounds`` times with the service idle,
    then ``rounds`` times under each paced load (a fraction of ``capacity_rps`` requests/s)."""
    from kvpubd.protocol.endpoints import rank_endpoint

    # Room for the fill and for what a loaded round stores on top (a prompt adds at most
    # PROMPT_TOKENS / 16 blocks): the fill is never evicted.
    per_rank_rate = max(load_fractions, default=0.0) * capacity_rps / ranks
    margin = math.ceil(per_rank_rate * (LOADED_S + 1.0) * PROMPT_TOKENS // BLOCK_TOKENS)
    num_blocks = fill_blocks + max(65_536, margin)
    overrides: dict[str, dict[str, Any]] = {
        "cache": {**TINY_BLOCKS, "num_blocks": num_blocks, "data_parallel_size": ranks},
        "events": {"buffer_steps": 1000},
        "service": {"log_level": "warning", "rank_processes": rank_processes},
    }
    transport = "tcp" if ranks == 1 else "ipc"
    phases = []
    with ExitStack() as stack:
        daemon = stack.enter_context(DaemonProcess(overrides, transport=transport))
        client = daemon.client(timeout=MARKER_TIMEOUT_S)
        stack.callback(client.close)
        watchers = [
            start_child(stack, watch_markers, rank_endpoint(daemon.events_endpoint, rank))
            for rank in range(ranks)
        ]
        fillers = [
            start_child(stack, fill_rank, daemon.control_endpoint, rank, fill_blocks)
            for rank in range(ranks)
        ]
        markers = _Markers(watchers)
        _wait_watchers_live(
            lambda: [(m.rank, m.seq) for m in client.reset(force=True).markers], markers
        )
        floor = ResetFloor(
            stack, ranks, lambda endpoint: start_child(stack, watch_markers, endpoint)
        )
        floor_markers = _Markers(floor.watchers)
        _wait_watchers_live(lambda: list(enumerate(floor.reset(MARKER_TIMEOUT_S))), floor_markers)
        workers = len(rank_workers(daemon.proc.pid)) if daemon.proc is not None else 0
        for fraction in [0.0, *load_fractions]:
            loads = []
            if fraction:
                rate = fraction * capacity_rps / ranks
                for rank in range(ranks):
                    args = (daemon.control_endpoint, rank, rate)
                    loads.append(start_child(stack, paced_rank_load, *args))
            label = f"{fraction:.0%} load" if fraction else "idle"
            phase = _phase(
                client, markers, fillers, loads, rounds, idle_ms, label, (floor, floor_markers)
            )
            done = []
            for pipe in loads:
                pipe.send(None)
                done.append(answer(pipe, "a paced load process", 60))
            stores = sum(d["stores"] for d in done)
            seconds = max((d["seconds"] for d in done), default=0.0)
            phases.append(
                {
                    "load_fraction": fraction,
                    "target_stores_per_s": round(fraction * capacity_rps),
                    "stores": stores,
                    "stores_per_s": round(stores / seconds) if seconds else None,
                    "refused": sum(d["refused"] for d in done),
                    **phase,
                }
            )
        for pipe in fillers:
            pipe.send(None)
        streams = []
        for pipe in [*watchers, *floor.watchers]:
            pipe.send(None)
            while (report := answer(pipe, "a marker watcher", 60)) and isinstance(report, tuple):
                pass  # markers still on their way
            streams.append(report)
    return {
        "ranks": ranks,
        "rank_processes": workers > 0,
        "fill_blocks": fill_blocks,
        "num_blocks": num_blocks,
        "capacity_requests_per_s": round(capacity_rps),
        "transport": transport,
        "gaps": sum(s["gaps"] for s in streams),
        "phases": phases,
    }


def _wait_watchers_live(
    reset: Callable[[], list[tuple[int, int | None]]], markers: _Markers, timeout_s: float = 60.0
) -> None:
    """Resets (each giving its markers' (rank, seq)) until every watcher has reported one (its
    SUB is connected)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sent = reset()
        markers.collect(0.2)
        if all(seq is not None and markers.seen[rank].get(seq) for rank, seq in sent):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"a rank's marker never reached its watcher in {timeout_s:g} s")


def _phase(
    client: Any,
    markers: _Markers,
    fillers: list[Any],
    loads: list[Any],
    rounds: int,
    idle_ms: float,
    label: str,
    floor: tuple[ResetFloor, _Markers],
) -> dict[str, Any]:
    ranks = len(fillers)
    times = _Timings(ranks)
    floor_times = _Timings(ranks)
    cached_min: int | None = None
    fill_s: list[float] = []
    for round_no in range(rounds):
        for pipe in loads:
            pipe.send("pause")
        for pipe in loads:
            if answer(pipe, "a paced load process", 120) != "paused":
                raise RuntimeError("a paced load process did not pause")
        filling = time.monotonic()
        for pipe in fillers:
            pipe.send(round_no)
        for rank, pipe in enumerate(fillers):
            refused, error = answer(pipe, f"rank {rank}'s filling process", 900)
            if refused:
                raise RuntimeError(f"rank {rank}: {refused} fill request(s) refused: {error}")
        stats = client.stats().ranks
        while any(rank.events_pending for rank in stats):
            markers.collect(0.005)
            stats = client.stats().ranks
        # Read as a subscriber that keeps up would have (the 1M-block fill's batches are
        # megabytes a rank): a marker is timed from an idle stream, not from its backlog.
        markers.read_up_to([rank.seq for rank in stats])
        fill_s.append(time.monotonic() - filling)
        cached = min(rank.blocks_cached for rank in stats)
        cached_min = cached if cached_min is None else min(cached_min, cached)
        for pipe in loads:
            pipe.send("go")
        time.sleep(LOADED_S if loads else idle_ms / 1000)  # a bench, not a test
        start = time.monotonic_ns()
        reply = client.reset(force=True)
        times.arrivals(start, markers, [(m.rank, m.seq) for m in reply.markers])
        latest = times.slowest[-1]
        # The same fan-out in bare pyzmq, at the same moment of the host (the load, if any,
        # still running), after the same pause.
        time.sleep(idle_ms / 1000)
        _time_floor(*floor, floor_times)
        if round_no % 5 == 4 or round_no == rounds - 1:
            err.print(
                f"per-rank resets, {label}: round {round_no + 1}/{rounds}, slowest rank's "
                f"marker {latest / 1e6:.2f} ms"
            )
    return {
        "rounds": rounds,
        "cached_blocks_min": cached_min,
        # Filling every rank and publishing it all, per round: where a round's time goes.
        "fill_s_p50": round(float(np.median(fill_s)), 3),
        "fill_s_max": round(max(fill_s), 3),
        **times.report(),
        "floor": floor_times.report(),
    }


class _Timings:
    """Per round: each rank's reset -> marker time, the slowest of them, the reply (ns)."""

    def __init__(self, ranks: int) -> None:
        self.per_rank: list[list[int]] = [[] for _ in range(ranks)]
        self.slowest: list[int] = []
        self.replies: list[int] = []
        self.missing = 0

    def arrivals(self, start: int, markers: _Markers, seqs: list[tuple[int, int | None]]) -> None:
        """The markers (rank, seq) of a reset sent at ``start`` (and answered now), timed as
        they reach their watchers (``missing`` counts those that never did)."""
        self.replies.append(time.monotonic_ns() - start)
        deadline = time.monotonic() + MARKER_TIMEOUT_S
        latest = 0
        for rank, seq in seqs:
            arrived = markers.arrival(rank, seq, deadline) if seq is not None else None
            if arrived is None:
                self.missing += 1
                continue
            self.per_rank[rank].append(arrived - start)
            latest = max(latest, arrived - start)
        self.slowest.append(latest)

    def report(self) -> dict[str, Any]:
        return {
            "missing_markers": self.missing,
            "per_rank": [
                {"rank": rank, **summary(samples)} for rank, samples in enumerate(self.per_rank)
            ],
            "slowest_rank": summary(self.slowest),
            "reply": summary(self.replies),
        }


def _time_floor(floor: ResetFloor, markers: _Markers, timings: _Timings) -> None:
    """One fan-out of the floor, timed as kvpubd's resets are."""
    start = time.monotonic_ns()
    seqs = floor.reset(MARKER_TIMEOUT_S)
    timings.arrivals(start, markers, list(enumerate(seqs)))


def print_rank_resets(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"reset of every rank -> marker received on each rank's stream: {result['ranks']} "
        f"rank(s), {result['fill_blocks']:,} cached blocks per rank before each reset",
        caption=f"{result['gaps']} seq gap(s) on the streams; capacity "
        f"{result['capacity_requests_per_s']:,} requests/s; floor: the same fan-out in bare "
        "pyzmq (a front, a process per rank, the same watchers), timed after each reset",
    )
    for column in (
        "load",
        "stores/s (target)",
        "rank",
        "n",
        "p50 us",
        "p99 us",
        "max us",
    ):
        table.add_column(column, justify="right")
    for phase in result["phases"]:
        load = f"{phase['load_fraction']:.0%}" if phase["load_fraction"] else "idle"
        rate = (
            f"{phase['stores_per_s']} ({phase['target_stores_per_s']})"
            if phase["load_fraction"]
            else ""
        )
        floor = phase["floor"]
        rows = [(str(row["rank"]), row) for row in phase["per_rank"]]
        rows += [("slowest", phase["slowest_rank"]), ("reply", phase["reply"])]
        rows += [(f"floor {row['rank']}", row) for row in floor["per_rank"]]
        rows += [("floor slowest", floor["slowest_rank"]), ("floor reply", floor["reply"])]
        for i, (name, row) in enumerate(rows):
            table.add_row(
                load if i == 0 else "",
                rate if i == 0 else "",
                name,
                str(row["n"]),
                f"{row['p50_us']:.0f}",
                f"{row['p99_us']:.0f}",
                f"{row['max_us']:.0f}",
            )
    Console().print(table)
