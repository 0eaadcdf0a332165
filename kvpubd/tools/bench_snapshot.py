"""``kvpubd bench snapshot``: the snapshot endpoint (vLLM's snapshot protocol) of a daemon
holding N cached blocks on its one rank, asked by real REQ clients.

Per size, a daemon of its own is filled, then for each round a change is published (one new
block) and two requests follow: cold, the first after the change (the daemon builds the
snapshot), and warm, sent as soon as the cold reply is in (nothing published in between but
a heartbeat, so the build is shared unless one came). Each is timed from the send to the whole
reply; its bytes and chunks are reported and its events counted, and they must be the blocks
the rank holds (the first reply of a size is decoded event by event as well). Then
``--clients`` clients, each in its own process, ask in a loop at once: the latency of every
request, and the daemon's resident memory before, at its peak (sampled) and after.

A reply that breaks the protocol or rebuilds other than the blocks cached fails the run
(exit 1) once the numbers are printed."""

from __future__ import annotations

import json
import os
import time
from typing import Annotated, Any

import typer
import zmq
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpubd.exits import check_positive, fail
from kvpubd.tools.bench_probe import TINY_BLOCKS, ResetProbe
from kvpubd.tools.bench_report import err, percentile
from kvpubd.tools.bench_reset import cache_sizes
from kvpubd.tools.bench_rss import PeakRss, memory_mib
from kvpubd.tools.launcher import DaemonProcess
from kvpubd.tools.snapshot_client import (
    SnapshotMismatch,
    SnapshotReply,
    SnapshotRequester,
    check_publisher_id,
    counted_events,
    verified_events,
)

RANK = 0


def _ms_summary(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "max_ms": round(max(ms), 1) if ms else None,
    }


class _Checks:
    """What a size's replies got wrong, kept to fail the run once its numbers are out."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.problems: list[str] = []

    def reply(
        self, reply: SnapshotReply | None, what: str, publisher_id: bytes, blocks: int
    ) -> SnapshotReply | None:
        """The reply if it is a whole snapshot of ``blocks`` events of this publisher."""
        try:
            if reply is None:
                raise SnapshotMismatch("no reply within the timeout")
            if reply.seq < 0:
                raise SnapshotMismatch(f"seq {reply.seq} (no snapshot) from an idle daemon")
            check_publisher_id(reply, publisher_id)
            events = counted_events(reply.chunks)
            if events != blocks:
                raise SnapshotMismatch(f"{events:,} events, but {blocks:,} blocks are cached")
        except SnapshotMismatch as exc:
            self.problems.append(f"{self.size:,} blocks, {what}: {exc}")
            return None
        return reply


def _request(requester: SnapshotRequester, timeout: float) -> SnapshotReply | None:
    try:
        return requester.request(timeout)
    except SnapshotMismatch:
        return None  # malformed: counted as a missing reply by the checks


def measure_size(
    size: int,
    rounds: int,
    clients: int,
    requests: int,
    timeout: float,
    progress: Progress,
) -> dict[str, Any]:
    """Cold and warm requests, then ``clients`` at once, against a daemon holding ``size``
    blocks."""
    from kvpubd.tools.bench_load import Load, LoadSpec, client_summary

    checks = _Checks(size)
    overrides: dict[str, dict[str, Any]] = {
        # Room for the fill and each round's new block, so nothing is evicted.
        "cache": {**TINY_BLOCKS, "num_blocks": size + rounds + 1024},
        "events": {"buffer_steps": 1000, "snapshot_endpoint": True},
        "service": {"log_level": "warning"},
    }
    out: dict[str, Any] = {}
    with DaemonProcess(overrides, transport="tcp") as daemon:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        probe = ResetProbe(daemon)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        requester: SnapshotRequester | None = None
        try:
            probe.wait_connected()
            (endpoints,) = probe.client.ping().endpoints
            requester = SnapshotRequester(ctx, endpoints.snapshot)
            started = time.perf_counter()
            if size:
                probe.populate(size, 0)
            out["fill_s"] = round(time.perf_counter() - started, 2)
            filled = memory_mib(pid).get("rss")  # before any snapshot was built

            task = progress.add_task(f"cold and warm: {size:>9,} blocks", total=rounds)
            cold: list[float] = []
            warm: list[float] = []
            reused = 0
            last: SnapshotReply | None = None
            for round_no in range(rounds):
                if round_no:  # a change since the last round's requests: a new block
                    probe.populate(1, round_no)
                blocks = probe.client.stats().ranks[RANK].blocks_cached
                first = _request(requester, timeout)
                again = _request(requester, timeout)  # at once: the same build, if it can be
                first = checks.reply(
                    first, f"cold request {round_no}", endpoints.publisher_id, blocks
                )
                again = checks.reply(
                    again, f"warm request {round_no}", endpoints.publisher_id, blocks
                )
                if first is not None:
                    cold.append(first.seconds)
                    last = first
                if again is not None:
                    warm.append(again.seconds)
                    # The same build: each chunk begins with the time its build began.
                    reused += first is not None and b"".join(again.chunks[:1]) == b"".join(
                        first.chunks[:1]
                    )
                if round_no == 0 and first is not None:
                    try:  # once per size: every event decoded (seconds at 1M blocks)
                        verified = verified_events(first.chunks, RANK)
                        if verified != blocks:
                            raise SnapshotMismatch(f"{verified:,} blocks rebuilt of {blocks:,}")
                    except SnapshotMismatch as exc:
                        checks.problems.append(f"{size:,} blocks, decoded: {exc}")
                progress.advance(task)
            out.update(
                blocks=blocks,
                events=counted_events(last.chunks) if last is not None else None,
                reply_bytes=last.nbytes if last is not None else None,
                chunks=len(last.chunks) if last is not None else None,
                cold=_ms_summary(cold),
                warm=_ms_summary(warm),
                warm_reused=reused,
            )
            del first, again, last  # the replies' frames: not the daemon's memory, but ours

            spec = LoadSpec(
                "snapshot-endpoint",
                control_endpoint=daemon.control_endpoint,
                replay_endpoint=daemon.replay_endpoint,
                events_endpoint=daemon.events_endpoint,
                metrics_port=0,
                snapshot_blocks=blocks,
                snapshot_endpoint=endpoints.snapshot,
                snapshot_clients=clients,
                requests_per_client=requests,
            )
            rss: dict[str, Any] = {"filled": filled}
            with Load(spec) as load:
                if not load.wait_ready(60):
                    checks.problems.append(f"{size:,} blocks: the clients did not start in 60 s")
                rss["before"] = memory_mib(pid).get("rss")
                task = progress.add_task(f"{clients} clients: {size:>9,} blocks", total=None)
                with PeakRss(pid) as peak:
                    load.run()
                    if not load.collect(requests * timeout + 60):
                        checks.problems.append(f"{size:,} blocks: a client never reported")
                progress.remove_task(task)
                after = memory_mib(pid)
                rss.update(peak=peak.peak_mib, after=after.get("rss"), hwm=after.get("hwm"))
            concurrent = client_summary(load.results)
            for key in ("wrong_events", "malformed"):
                if concurrent[key]:
                    checks.problems.append(
                        f"{size:,} blocks, {clients} clients: {key} {concurrent[key]}"
                    )
            out.update(concurrent=concurrent, rss_mib=rss)
            snapshot_stats = probe.client.stats().ranks[RANK]
            out["daemon"] = {
                "snapshot_requests": snapshot_stats.snapshot_requests,
                "snapshots_unavailable": snapshot_stats.snapshots_unavailable,
                "alive": daemon.alive(),
            }
        finally:
            if requester is not None:
                requester.close()
            ctx.term()
            probe.close()
    out["problems"] = checks.problems
    return out


def snapshot_tables(result: dict[str, Any]) -> list[Table]:
    """One table of the single requests, one of the clients at once."""
    single = Table(
        title=f'snapshot endpoint: b"snapshot" -> whole reply (loopback tcp, one rank, '
        f"{result['cpus']} CPUs)",
        caption="cold: the first request after a change (a build); warm: again at once "
        "(reused: the same build came back, shared; its seq may be later, past heartbeats)",
    )
    for column in ("cached blocks", "reply MiB", "chunks", "events", "cold p50 ms",
                   "cold max ms", "warm p50 ms", "warm reused"):  # fmt: skip
        single.add_column(column, justify="right")
    many = Table(
        title=f"{result['clients']} clients x {result['requests_per_client']} requests at once",
        caption="-2: answered unavailable; lost: no reply within --timeout. RSS of the "
        "daemon in MiB: once filled (no snapshot built yet), before the clients, its peak "
        "(sampled every 20 ms) while they ask, after their last reply",
    )
    for column in ("blocks", "n", "p50 ms", "p99 ms", "max ms", "-2", "lost",
                   "RSS filled", "RSS before", "RSS peak", "RSS after"):  # fmt: skip
        many.add_column(column, justify="right")
    for size, row in result["sizes"].items():
        mib = row["reply_bytes"] / (1 << 20) if row["reply_bytes"] is not None else None
        single.add_row(
            f"{int(size):,}",
            f"{mib:.1f}" if mib is not None else "",
            str(row["chunks"]),
            f"{row['events']:,}" if row["events"] is not None else "",
            str(row["cold"]["p50_ms"]),
            str(row["cold"]["max_ms"]),
            str(row["warm"]["p50_ms"]),
            f"{row['warm_reused']}/{row['warm']['n']}",
        )
        concurrent, rss = row["concurrent"], row["rss_mib"]
        many.add_row(
            f"{int(size):,}",
            str(concurrent["requests"]),
            str(concurrent["p50_ms"]),
            str(concurrent["p99_ms"]),
            str(concurrent["max_ms"]),
            str(concurrent["unavailable"]),
            str(concurrent["timeouts"]),
            str(rss.get("filled")),
            str(rss.get("before")),
            str(rss.get("peak")),
            str(rss.get("after")),
        )
    return [single, many]


def bench_snapshot(
    sizes: Annotated[
        str, typer.Option(help="Cached blocks on the rank, comma-separated (a daemon each).")
    ] = "100000,1000000",
    rounds: Annotated[int, typer.Option(help="Cold and warm requests per size.")] = 5,
    clients: Annotated[
        int, typer.Option(help="Clients asking at once, each in its own process.")
    ] = 8,
    requests: Annotated[int, typer.Option(help="Requests of each of those clients.")] = 10,
    timeout: Annotated[
        float, typer.Option(help="Seconds one request may wait for its reply.")
    ] = 300.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """The snapshot endpoint at each cache size: request -> whole reply, cold and warm, the
    reply's size and events; then many clients at once, their latency and the daemon's RSS."""
    size_list = cache_sizes(sizes)
    check_positive("--rounds", rounds, integer=True)
    check_positive("--clients", clients, integer=True)
    check_positive("--requests", requests, integer=True)
    check_positive("--timeout", timeout)
    result: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "clients": clients,
        "requests_per_client": requests,
        "rounds": rounds,
        "sizes": {},
    }
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        for size in size_list:
            result["sizes"][str(size)] = measure_size(
                size, rounds, clients, requests, timeout, progress
            )
    problems = [p for row in result["sizes"].values() for p in row["problems"]]
    if as_json:
        typer.echo(json.dumps(result))
    else:
        console = Console()
        for table in snapshot_tables(result):
            console.print(table)
    if problems:
        raise fail("the snapshot endpoint got it wrong: " + "; ".join(problems))
