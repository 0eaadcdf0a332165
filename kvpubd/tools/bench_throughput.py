"""``kvpubd bench throughput``: store requests of realistic prompts in, BlockStored blocks
decoded by a subscriber per rank (other processes) out; with ``--load-fraction`` also resets
timed under a paced load (bench_paced)."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table

from kvpubd.daemon.settings import RankProcessesMode
from kvpubd.exits import USAGE, check_positive, fail
from kvpubd.protocol.hashing import HashAlgorithm
from kvpubd.tools.bench_children import answer, start_child
from kvpubd.tools.bench_counting import count_stored, vllm_decoder_path
from kvpubd.tools.bench_probe import TINY_BLOCKS, ResetProbe
from kvpubd.tools.bench_rank_resets import (
    LARGE_FILL,
    default_rounds,
    measure_rank_resets,
    print_rank_resets,
)
from kvpubd.tools.bench_report import err
from kvpubd.tools.bench_senders import send_in_process, send_rank_share
from kvpubd.tools.launcher import DaemonProcess
from kvpubd.tools.service_cpu import CpuReading, rank_workers

Senders = Literal["per-rank", "one"]


def measure_throughput(
    requests: int,
    window: int,
    num_blocks: int,
    ranks: int = 1,
    daemon_per_rank: bool = False,
    hash_algorithm: HashAlgorithm = "sha256",
    rank_processes: RankProcessesMode = "auto",
    senders: Senders = "per-rank",
    batch: int = 1,
    cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Store+release requests round-robin over ``ranks``, served by one daemon (its ranks in
    worker processes or not, as ``rank_processes`` says), or with ``daemon_per_rank`` by one
    single-rank daemon each (``cache.data_parallel_start_rank``); ``window`` requests in
    flight per rank either way, sent by one process per rank or (``senders`` "one") all from
    this one; ``batch`` > 1: that many stores per ``batch`` message (per-rank senders);
    ``cache``: more cache settings (e.g. ``groups``)."""
    if batch > 1 and senders != "per-rank":
        raise ValueError("--batch needs --senders per-rank")
    from kvpubd.protocol.endpoints import rank_endpoint

    layouts = (
        [{"data_parallel_start_rank": rank, "data_parallel_size": 1} for rank in range(ranks)]
        if daemon_per_rank
        else [{"data_parallel_size": ranks}]
    )
    kv_path = vllm_decoder_path()
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
                    **(cache or {}),
                },
                "events": {"buffer_steps": 1000},
                "service": {"log_level": "warning", "rank_processes": rank_processes},
            }
            daemons.append(stack.enter_context(DaemonProcess(overrides, transport=transport)))
        probes = []
        for daemon in daemons:
            probe = ResetProbe(daemon)
            stack.callback(probe.close)
            probes.append(probe)
        # Per rank: the daemon serving it, and a counting subscriber on its stream.
        route: list[int] = []
        counters = []
        for index, daemon in enumerate(daemons):
            for rank in daemon.served:
                endpoint = rank_endpoint(daemon.events_endpoint, rank)
                counters.append(start_child(stack, count_stored, endpoint, kv_path))
                route.append(index)
        # Resets (no stores) until every counter's SUB has received one.
        for index, pipe in zip(route, counters, strict=True):
            while not pipe.poll(0.1):
                probes[index].client.reset(force=True)
            pipe.recv()
        sending = []
        if senders == "per-rank":
            for rank, index in enumerate(route):
                endpoint = daemons[index].control_endpoint
                args = (endpoint, rank, ranks, requests, window)
                sending.append(start_child(stack, send_rank_share, *args, batch))
            for rank, pipe in enumerate(sending):
                if answer(pipe, f"rank {rank}'s sender", 300) != "ready":
                    raise RuntimeError(f"rank {rank}'s sender did not start")
        pids = [daemon.proc.pid for daemon in daemons if daemon.proc is not None]
        cpu_start = CpuReading.now(pids)
        start = time.monotonic()
        if sending:
            for pipe in sending:
                pipe.send("go")
            sent = [answer(pipe, f"rank {rank}'s sender", 600) for rank, pipe in enumerate(sending)]
        else:
            sockets = [probe.control for probe in probes]
            sent = [send_in_process(sockets, route, requests, window)]
        sent_all = time.monotonic()
        failed = [report for report in sent if report["failures"]]
        if failed:
            raise RuntimeError(
                f"{sum(r['failures'] for r in failed)} bench request(s) failed: "
                f"{failed[0]['first_error']}"
            )
        ranks_stats = [stats for probe in probes for stats in probe.client.stats().ranks]
        while any(rank.events_pending for rank in ranks_stats):
            ranks_stats = [stats for probe in probes for stats in probe.client.stats().ranks]
        parent_cpu, worker_cpu = CpuReading.now(pids).since(cpu_start)
        for pipe, rank_stats in zip(counters, ranks_stats, strict=True):
            pipe.send(rank_stats.seq)
        counted = [answer(pipe, "a counting subscriber", 120) for pipe in counters]
        lost = [rank for rank, c in enumerate(counted) if not c["complete"]]
        if lost:
            raise RuntimeError(f"rank(s) {lost}: the subscriber never got the last batch")
        workers = sum(len(rank_workers(pid)) for pid in pids)
    blocks = sum(c["blocks"] for c in counted)
    elapsed = max(c["last"] for c in counted) - start
    cpu = parent_cpu + worker_cpu
    return {
        "blocks_per_s": round(blocks / elapsed),
        "blocks": blocks,
        "gaps": sum(c["gaps"] for c in counted),
        "undecodable_batches": sum(c["undecodable"] for c in counted),
        "decoded_by": "vllm" if kv_path else "msgpack",
        "requests": requests,
        "window_per_rank": window,
        "batch": batch,
        "ranks": ranks,
        "daemons": len(daemons),
        "rank_processes": workers > 0,
        "rank_worker_processes": workers,
        "senders": len(sent),
        "hash_algorithm": hash_algorithm,
        "transport": transport,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(requests / (sent_all - start)),
        # The whole service: daemon processes and their rank workers.
        "daemon_cpu_us_per_block": _per_block(cpu, blocks),
        "parent_cpu_us_per_block": _per_block(parent_cpu, blocks),
        "daemon_cpus_busy": round(cpu / elapsed, 2),
        # Near 1: that sending process, not the daemon, set the rate.
        "sender_cpu_busy_max": round(max(s["cpu_s"] / s["wall_s"] for s in sent), 3),
        "sender_cpu_us_per_request": round(sum(s["cpu_s"] for s in sent) / requests * 1e6, 1),
        # Near 1: that subscriber's decoding, not the daemon, set its rank's rate.
        "subscriber_decoding_busy_max": round(
            max(c["decoding_s"] / max(1e-9, c["last"] - start) for c in counted), 3
        ),
        "dropped_stored_blocks": sum(rank.dropped_stored_blocks for rank in ranks_stats),
    }


def _per_block(seconds: float, blocks: int) -> float | None:
    return round(seconds / blocks * 1e6, 3) if blocks else None


def bench_throughput(
    requests: Annotated[int, typer.Option(help="store requests (each followed by release).")] = (
        2000
    ),
    window: Annotated[
        int,
        typer.Option(help="Requests in flight per rank (a store and a release each count)."),
    ] = 32,
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
    rank_processes: Annotated[
        RankProcessesMode,
        typer.Option(
            help="The daemon's service.rank_processes: auto (a worker process per rank when "
            "it serves more than one), on, or off (every rank in the daemon's process)."
        ),
    ] = "auto",
    batch: Annotated[
        int,
        typer.Option(
            help="Stores per control message: 1, a store and a release message per prompt; N, "
            "a batch op of N stores and the previous batch's releases (as an engine has them "
            "at a scheduler step; per-rank senders)."
        ),
    ] = 1,
    senders: Annotated[
        Senders,
        typer.Option(
            help="Who sends the requests: per-rank (a process per rank, each with its own "
            "DEALER and its share of the prompts) or one (this process, for every rank)."
        ),
    ] = "per-rank",
    load_fraction: Annotated[
        list[float] | None,
        typer.Option(
            help="Then reset latency while a paced load stores at this fraction of the "
            "requests/s just measured (repeatable, e.g. 0.5 and 0.9). One rank without "
            "--fill-blocks: resets of a fresh one-rank daemon under a continuous load; "
            "otherwise the per-rank resets of --fill-blocks, with this load spread over the "
            "ranks.",
            min=0.01,
            max=1.0,
        ),
    ] = None,
    fill_blocks: Annotated[
        int,
        typer.Option(
            help="Then per-rank resets on a fresh service of --ranks ranks: each round fills "
            "every rank to this many cached blocks, then one reset of every rank is timed to "
            "the marker on each rank's stream; idle, then under each --load-fraction.",
            min=0,
        ),
    ] = 0,
    resets: Annotated[
        int | None,
        typer.Option(
            help="Resets timed per --load-fraction (per-rank resets: rounds per phase).",
            show_default=f"50; per-rank resets with --fill-blocks {LARGE_FILL:,} or more: 20",
        ),
    ] = None,
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
        ("--batch", batch),
    ):
        check_positive(option, value, integer=True)
    if batch > 1 and senders != "per-rank":
        raise fail("--batch needs --senders per-rank", USAGE)
    if resets is not None:
        check_positive("--resets", resets, integer=True)
    per_rank_resets = fill_blocks > 0 or (ranks > 1 and bool(load_fraction))
    if per_rank_resets and daemon_per_rank:
        raise fail("per-rank resets (--fill-blocks, or --load-fraction with --ranks > 1) "
                   "time one service: not with --daemon-per-rank", USAGE)  # fmt: skip
    with err.status(f"{requests} store requests through a daemon to a subscriber"):
        result = measure_throughput(
            requests,
            window,
            num_blocks,
            ranks,
            daemon_per_rank,
            hash_algorithm,
            rank_processes,
            senders,
            batch,
        )
    if against_vllm:
        from kvpubd.tools.bench_blockpool import beside_vllm

        result["vllm_blockpool"] = beside_vllm(
            requests, hash_algorithm, num_blocks, result["daemon_cpu_us_per_block"]
        )
    if per_rank_resets:
        result["per_rank_resets"] = measure_rank_resets(
            ranks,
            fill_blocks,
            load_fraction or [],
            resets or default_rounds(fill_blocks),
            result["requests_per_s"],
            rank_processes,
        )
    elif load_fraction:
        from kvpubd.tools.bench_paced import measure_resets_under_load

        with err.status("resets under paced load"):
            result["reset_under_load"] = [
                measure_resets_under_load(result["requests_per_s"], f, resets or 50, num_blocks)
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
    if per_rank_resets:
        print_rank_resets(result["per_rank_resets"])
    elif load_fraction:
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
