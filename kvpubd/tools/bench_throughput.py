"""``kvpubd bench throughput``: store requests of realistic prompts in, BlockStored blocks
decoded by a subscriber per rank (other processes) out; with ``--load-fraction`` also resets
timed under a paced load (bench_paced)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgpack
import typer
import zmq
from rich.console import Console
from rich.table import Table

from kvpubd.exits import check_positive
from kvpubd.interrupts import ctrl_c_kept_from_children
from kvpubd.protocol.hashing import HashAlgorithm
from kvpubd.tools.bench_probe import TINY_BLOCKS, ResetProbe
from kvpubd.tools.bench_prompts import make_prompts
from kvpubd.tools.bench_report import err
from kvpubd.tools.launcher import DaemonProcess


def _count_stored(endpoint: str, ready: Any, results: Any) -> None:
    """Subscriber process: decode every batch, count published blocks, check seqs."""
    from kvpubd.tools.launcher import live_subscriber

    # Live once a batch arrives (the bench sends resets until then).
    ctx, sub = live_subscriber(endpoint, poll_ms=50)
    ready.send("live")
    stop_seq: int | None = None
    blocks = gaps = 0
    last_seq: int | None = None
    last_time = first_time = 0.0
    while stop_seq is None or last_seq is None or last_seq < stop_seq:
        if ready.poll(0):
            stop_seq = ready.recv()
        if not sub.poll(100):
            continue
        _, seq_frame, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_frame, "big")
        if last_seq is not None and seq != last_seq + 1:
            gaps += 1
        last_seq = seq
        for event in msgpack.unpackb(payload)[1]:
            if event["type"] == "BlockStored":
                if not blocks:
                    first_time = time.monotonic()
                blocks += len(event["block_hashes"])
        last_time = time.monotonic()
    results.send({"blocks": blocks, "gaps": gaps, "first": first_time, "last": last_time})
    sub.close(linger=0)
    ctx.term()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_throughput(
    requests: int,
    window: int,
    num_blocks: int,
    ranks: int = 1,
    daemon_per_rank: bool = False,
    hash_algorithm: HashAlgorithm = "sha256",
) -> dict[str, Any]:
    """Store+release requests round-robin over ``ranks``, served by one daemon, or with
    ``daemon_per_rank`` by one single-rank daemon each (``cache.data_parallel_start_rank``)
    with ``window`` requests in flight per daemon."""
    import multiprocessing
    from contextlib import ExitStack

    from kvpubd.protocol.endpoints import rank_endpoint

    prompts = make_prompts(requests)
    layouts = (
        [{"data_parallel_start_rank": rank, "data_parallel_size": 1} for rank in range(ranks)]
        if daemon_per_rank
        else [{"data_parallel_size": ranks}]
    )
    spawn = multiprocessing.get_context("spawn")
    # Several ranks use ipc: one transport for every rank count keeps the figures comparable
    # with earlier runs.
    transport = "tcp" if ranks == 1 else "ipc"
    with ExitStack() as stack:
        daemons = []
        for layout in layouts:
            overrides: dict[str, dict[str, Any]] = {
                "cache": {
                    **TINY_BLOCKS,
                    "num_blocks": num_blocks,
                    "hash_algorithm": hash_algorithm,
                    **layout,
                },
                "events": {"buffer_steps": 1000},
                "service": {"log_level": "warning"},
            }
            daemons.append(stack.enter_context(DaemonProcess(overrides, transport=transport)))
        probes = []
        for daemon in daemons:
            probe = ResetProbe(daemon)
            stack.callback(probe.close)
            probes.append(probe)
        # Per rank: the probe of the daemon serving it, and a counter process on its stream.
        route: list[ResetProbe] = []
        pipes, results = [], []
        for daemon, probe in zip(daemons, probes, strict=True):
            for rank in daemon.served:
                control_side, sub_side = spawn.Pipe()
                results_in, results_out = spawn.Pipe(duplex=False)
                endpoint = rank_endpoint(daemon.events_endpoint, rank)
                # daemon=True: a failed run never waits on a counter that waits for its stop seq.
                counter = spawn.Process(
                    target=_count_stored, args=(endpoint, sub_side, results_out), daemon=True
                )
                with ctrl_c_kept_from_children():  # Ctrl-C is ours to handle: we stop the counters
                    counter.start()
                stack.push(_counter_stopper(counter))
                pipes.append((probe, control_side))
                results.append(results_in)
                route.append(probe)
        # Resets (no stores) until every counter's SUB has received one.
        for probe, pipe in pipes:
            while not pipe.poll(0.1):
                probe.client.reset(force=True)
            pipe.recv()
        pids = [daemon.proc.pid for daemon in daemons if daemon.proc is not None]
        cpu_start = sum(map(_cpu_seconds, pids))
        start = time.monotonic()
        in_flight = dict.fromkeys(probes, 0)
        poller = zmq.Poller()
        by_socket = {}
        for probe in probes:
            poller.register(probe.control, zmq.POLLIN)
            by_socket[probe.control] = probe
        sent = 0
        while sent < len(prompts) or any(in_flight.values()):
            while sent < len(prompts) and in_flight[route[sent % ranks]] < window:
                rank = sent % ranks
                probe = route[rank]
                probe.send("store", request_id=sent, rank=rank, token_ids=prompts[sent])
                probe.send("release", request_id=sent)
                sent += 1
                in_flight[probe] += 2
            ready = poller.poll(60_000)
            if not ready:
                raise TimeoutError("the daemons did not answer within 60 s")
            for socket, _ in ready:
                probe = by_socket[socket]
                probe.recv_reply()
                in_flight[probe] -= 1
        sent_all = time.monotonic()
        ranks_stats = [stats for probe in probes for stats in probe.client.stats().ranks]
        while any(rank.events_pending for rank in ranks_stats):
            ranks_stats = [stats for probe in probes for stats in probe.client.stats().ranks]
        cpu = sum(map(_cpu_seconds, pids)) - cpu_start
        for (_, pipe), rank_stats in zip(pipes, ranks_stats, strict=True):
            pipe.send(rank_stats.seq)
        counted = [result.recv() for result in results]
    blocks = sum(c["blocks"] for c in counted)
    elapsed = max(c["last"] for c in counted) - start
    return {
        "blocks_per_s": round(blocks / elapsed),
        "blocks": blocks,
        "gaps": sum(c["gaps"] for c in counted),
        "requests": requests,
        "ranks": ranks,
        "daemons": len(daemons),
        "hash_algorithm": hash_algorithm,
        "transport": transport,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(requests / (sent_all - start)),
        "daemon_cpu_us_per_block": round(cpu / blocks * 1e6, 3) if blocks else None,
        "dropped_stored_blocks": sum(rank.dropped_stored_blocks for rank in ranks_stats),
    }


def _counter_stopper(counter: Any) -> Callable[..., None]:
    """An exit callback: after a complete run the counter reports and ends by itself; after
    a failure or Ctrl-C it waits for a stop seq that never comes, so it is stopped at once."""

    def stop(exc_type: type[BaseException] | None, *_: object) -> None:
        counter.join(10 if exc_type is None else 0)
        if counter.is_alive():
            counter.terminate()
            counter.join()

    return stop


def bench_throughput(
    requests: Annotated[int, typer.Option(help="store requests (each followed by release).")] = (
        2000
    ),
    window: Annotated[int, typer.Option(help="Requests in flight.")] = 32,
    num_blocks: Annotated[
        int, typer.Option(help="Pool blocks per rank (evictions when full).")
    ] = 400_000,
    ranks: Annotated[int, typer.Option(help="Data-parallel ranks; requests go round-robin.")] = 1,
    daemon_per_rank: Annotated[
        bool,
        typer.Option(
            help="One single-rank daemon per rank (cache.data_parallel_start_rank), each "
            "with --window requests in flight, instead of one daemon serving every rank."
        ),
    ] = False,
    hash_algorithm: Annotated[
        HashAlgorithm, typer.Option(help="The daemons' cache.hash_algorithm.")
    ] = "sha256",
    load_fraction: Annotated[
        list[float] | None,
        typer.Option(
            help="Then reset p50/p99 while a paced client stores at this fraction of the "
            "measured requests/s (repeatable, e.g. 0.5 and 0.9; one rank).",
            min=0.01,
            max=1.0,
        ),
    ] = None,
    resets: Annotated[int, typer.Option(help="Resets timed per --load-fraction.")] = 50,
    against_vllm: Annotated[
        bool,
        typer.Option(
            "--against-vllm",
            help="Also vLLM's own BlockPool on the same prompts and hash, in this process "
            "(bench blockpool): its CPU us per stored block and its ratio to the daemon's. "
            "Needs vLLM's files (see `kvpubd bench vllm-extract`).",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """store requests of realistic prompts (shared prefixes, 1-8k tokens) in -> BlockStored
    blocks decoded by a subscriber per rank in other processes: blocks/s, the daemon's CPU
    us per published block, and the gaps the subscribers saw."""
    for option, value in (
        ("--requests", requests),
        ("--window", window),
        ("--num-blocks", num_blocks),
        ("--ranks", ranks),
    ):
        check_positive(option, value, integer=True)
    with err.status(f"{requests} store requests through a daemon to a subscriber"):
        result = measure_throughput(
            requests, window, num_blocks, ranks, daemon_per_rank, hash_algorithm
        )
    if against_vllm:
        from kvpubd.tools.bench_blockpool import beside_vllm

        result["vllm_blockpool"] = beside_vllm(
            requests, hash_algorithm, num_blocks, result["daemon_cpu_us_per_block"]
        )
    if load_fraction:
        from kvpubd.tools.bench_paced import measure_resets_under_load

        with err.status("resets under paced load"):
            result["reset_under_load"] = [
                measure_resets_under_load(result["requests_per_s"], f, resets, num_blocks)
                for f in load_fraction
            ]
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(
        title=f"end-to-end: {requests} store requests, {window} in flight, {ranks} rank(s)"
        + (" in a daemon each" if daemon_per_rank else "")
    )
    for column in (
        "blocks/s",
        "daemon CPU us/block",
        "blocks",
        "gaps",
        "dropped",
        "requests/s",
        "seconds",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result['blocks_per_s']:,}",
        f"{result['daemon_cpu_us_per_block']}",
        f"{result['blocks']:,}",
        str(result["gaps"]),
        str(result["dropped_stored_blocks"]),
        f"{result['requests_per_s']:,}",
        f"{result['seconds']:.2f}",
    )
    Console().print(table)
    if against_vllm:
        from kvpubd.tools.bench_blockpool import print_beside_vllm

        print_beside_vllm(result["vllm_blockpool"])
    if load_fraction:
        loaded = Table(title="reset -> marker received while storing at a fraction of capacity")
        for column in ("load", "stores/s (target)", "n", "p50 us", "p99 us", "max us"):
            loaded.add_column(column, justify="right")
        for row in result["reset_under_load"]:
            loaded.add_row(
                f"{row['load_fraction']:.0%}",
                f"{row['stores_per_s']} ({row['target_stores_per_s']})",
                str(row["n"]),
                f"{row['p50_us']:.0f}",
                f"{row['p99_us']:.0f}",
                f"{row['max_us']:.0f}",
            )
        Console().print(loaded)
