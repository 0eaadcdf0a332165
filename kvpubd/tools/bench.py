"""``kvpubd bench``: measurements of a real daemon, the way its users will judge it."""

from __future__ import annotations

import gc
import json
import os
import time
import zipfile
from collections.abc import Callable
from typing import Annotated, Any

import msgpack
import numpy as np
import typer
import zmq
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpubd.exits import USAGE, check_positive, fail, warn
from kvpubd.interrupts import ctrl_c_kept_from_children, interrupts_ignored
from kvpubd.protocol.hashing import HashAlgorithm
from kvpubd.tools.launcher import DaemonProcess

bench_app = typer.Typer(
    help="Measure a real daemon (started here, on loopback).",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help: flags without a <bool>, long names wrapped, not cut
)
err = Console(stderr=True)

# The smallest block the pool allows: the bench measures bookkeeping, not memory traffic.
TINY_BLOCKS = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"}
PROMPT_TOKENS = 8192


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q)) if samples else float("nan")


def summary(samples_ns: list[int]) -> dict[str, Any]:
    us = [s / 1000 for s in samples_ns]
    return {
        "n": len(us),
        "p50_us": round(percentile(us, 50), 1),
        "p99_us": round(percentile(us, 99), 1),
        "max_us": round(max(us), 1) if us else None,
    }


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
            frames = self.sub.recv_multipart()
            events = msgpack.unpackb(frames[2], raw=False)[1]
            if any(_is_marker(e) for e in events):
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


def _is_marker(event: Any) -> bool:
    if isinstance(event, dict):
        return event.get("type") == "AllBlocksCleared"
    return bool(event) and event[0] == "AllBlocksCleared"


def _bare_marker_server(control: str, events: str) -> None:
    """The floor of the reset path: a plain loop that answers each request by publishing a
    pre-encoded marker batch on a PUB and replying, nothing else (run in its own process, until
    it is terminated)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(control)
    pub = ctx.socket(zmq.PUB)
    pub.bind(events)
    payload = msgpack.packb([0.0, [{"type": "AllBlocksCleared"}], 0])
    seq = 0
    while True:
        frames = router.recv_multipart()
        request = msgpack.unpackb(frames[-1])
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        reply = {"ok": True, "id": request.get("id"), "markers": [{"rank": 0, "seq": seq}]}
        router.send_multipart([frames[0], b"", msgpack.packb(reply)])
        seq += 1


class BareMarkerServer:
    """``_bare_marker_server`` in a child process, with the endpoints ResetProbe expects."""

    def __init__(self) -> None:
        import multiprocessing

        from kvpubd.tools.launcher import free_tcp_ports

        control, events = free_tcp_ports(2)
        self.control_endpoint = f"tcp://127.0.0.1:{control}"
        self.events_endpoint = f"tcp://127.0.0.1:{events}"
        self._process = multiprocessing.get_context("spawn").Process(
            target=_bare_marker_server, args=(self.control_endpoint, self.events_endpoint)
        )

    def client(self, timeout: float = 5.0) -> Any:
        from kvpubd.client import ControlClient

        return ControlClient(self.control_endpoint, timeout=timeout)

    def __enter__(self) -> BareMarkerServer:
        with ctrl_c_kept_from_children():  # Ctrl-C is this process's to handle: it stops the server
            self._process.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()
        self._process.join(10)


def measure_floor(resets: int, idle_ms: float, progress: Progress) -> dict[str, Any]:
    """Reset latency of the bare marker server, measured exactly like the daemon's."""
    with BareMarkerServer() as server:
        probe = ResetProbe(server)  # type: ignore[arg-type]
        try:
            probe.wait_connected()
            task = progress.add_task("floor (bare pyzmq loop)", total=resets)
            markers, replies = [], []
            for _ in range(resets):
                probe.drain_sub(idle_ms / 1000)
                marker, reply = probe.time_reset()
                markers.append(marker)
                replies.append(reply)
                progress.advance(task)
        finally:
            probe.close()
    return {**summary(markers), "reply": summary(replies)}


def measure_resets(
    sizes: list[int],
    resets: int,
    flush: bool,
    progress: Progress,
    device: str = "cpu",
    idle_ms: float = 20.0,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    biggest = max([*sizes, 1024])
    overrides: dict[str, dict[str, Any]] = {
        "cache": {**TINY_BLOCKS, "num_blocks": biggest + 1024, "device": device},
        "events": {"flush_on_reset": flush, "buffer_steps": 1000},
        "service": {"log_level": "warning"},
    }
    label = "immediate flush" if flush else "baseline (next tick)"
    with DaemonProcess(overrides, transport="tcp") as daemon:
        probe = ResetProbe(daemon)
        try:
            probe.wait_connected()
            for size in sizes:
                # Refilling a large cache before every reset is slow: fewer rounds there.
                rounds = resets if size == 0 else max(10, min(resets, 2_000_000 // size))
                task = progress.add_task(f"{label}: {size:>9,} blocks", total=rounds)
                markers, replies = [], []
                for round_no in range(rounds):
                    if size:
                        probe.populate(size, round_no)
                    # The daemon is idle when the reset comes: nothing for idle_ms.
                    probe.drain_sub(idle_ms / 1000)
                    marker, reply = probe.time_reset()
                    markers.append(marker)
                    replies.append(reply)
                    progress.advance(task)
                results[str(size)] = {**summary(markers), "reply": summary(replies)}
        finally:
            probe.close()
    return results


# Fewer resets per size than this give percentiles that mean little.
MIN_RESETS = 100


def _cache_sizes(text: str) -> list[int]:
    """``--sizes``: comma-separated block counts >= 0 (at least one)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() for part in parts):
        raise fail(f"--sizes: {text!r} is not a comma-separated list of block counts >= 0", USAGE)
    return [int(part) for part in parts]


def _check_device(device: str) -> None:
    """``--device``: cpu, or cuda:N with CuPy and that GPU here (one line otherwise)."""
    from kvpubd.daemon.pool import check_device
    from kvpubd.protocol.config import CacheConfig, ValidationError

    try:
        CacheConfig(device=device)
    except ValidationError as exc:
        message = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise fail(f"--device: {message}", USAGE) from None
    try:
        check_device(device)
    except ValueError as exc:
        raise fail(f"--device: {exc}", USAGE) from None


def _reset_phase(
    probe: ResetProbe,
    size: int,
    rounds: int,
    reset_timeout: float,
    idle_ms: float,
    load: Any = None,
    progress: Progress | None = None,
    label: str = "",
) -> dict[str, Any]:
    """``rounds`` resets of rank 0 holding ``size`` blocks: the daemon idle for ``idle_ms``
    before each, or, with ``load``, each sent while an operation of the load is in progress
    (at a random offset up to ``idle_ms`` after it started). A reset not published within
    ``reset_timeout`` counts as that long and as a timeout; one never answered ends the
    phase (what came after it could not be told apart)."""
    rng = np.random.default_rng(size)
    markers: list[int] = []
    replies: list[int] = []
    out: dict[str, Any] = {"timeouts": 0, "load_idle_rounds": 0}
    task = progress.add_task(label, total=rounds) if progress is not None else None
    try:
        for round_no in range(rounds):
            if load is not None:
                load.hold()
            if size:
                probe.populate(size, round_no)
            # Read the refill's events first: the marker comes after everything published
            # before it, so a backlog at the subscriber would be timed as the reset's.
            probe.drain_sub(idle_ms / 1000)
            if load is not None:
                before = load.ops
                load.run()
                if not load.wait_active(before, reset_timeout):
                    out["load_idle_rounds"] += 1
                time.sleep(float(rng.uniform(0, idle_ms)) / 1000)
            marker, reply, request_id = probe.try_reset(reset_timeout, rank=0)
            if marker is None or reply is None:
                out["timeouts"] += 1
                markers.append(marker or int(reset_timeout * 1e9))
                replies.append(int(reset_timeout * 1e9))
                # Its reply (and marker) may still come: wait for them before the next round.
                probe.recv_reply(request_id, timeout=max(60.0, 2 * reset_timeout))
                probe.drain_sub(0.2)
            else:
                markers.append(marker)
                replies.append(reply)
            if task is not None and progress is not None:
                progress.advance(task)
    except (TimeoutError, RuntimeError) as exc:
        out["error"] = str(exc)
    finally:
        if load is not None:
            load.hold()
    return {**summary(markers), "reply": summary(replies), **out}


def measure_under(
    load_name: str,
    sizes: list[int],
    resets: int,
    progress: Progress,
    device: str = "cpu",
    idle_ms: float = 20.0,
    reset_timeout: float = 30.0,
    snapshot_blocks: int = 200_000,
    flood_processes: int = 4,
    idle_connections: int = 2000,
) -> dict[str, Any]:
    """Reset -> marker at each size on an idle daemon, then on the same daemon while
    ``load_name`` runs in other processes against its rank 1 (or its ports)."""
    from kvpubd.protocol.config import ControlConfig
    from kvpubd.tools.bench_load import Load, LoadSpec
    from kvpubd.tools.launcher import free_tcp_ports

    # The largest store the daemon allows by default (block_size 16).
    limits = ControlConfig()
    store_tokens = min(limits.max_tokens_per_request, limits.max_blocks_per_store * 16)
    load_blocks = {"snapshot": snapshot_blocks, "big-store": 2 * store_tokens // 16}
    num_blocks = max([*sizes, load_blocks.get(load_name, 0), 1024]) + 1024
    overrides: dict[str, dict[str, Any]] = {
        "cache": {**TINY_BLOCKS, "num_blocks": num_blocks, "device": device},
        # Rank 0 is reset and measured; rank 1 carries the load's cache.
        "events": {"buffer_steps": 1000},
        "service": {"log_level": "warning"},
    }
    overrides["cache"]["data_parallel_size"] = 2
    results: dict[str, Any] = {"under": load_name, "sizes": {}}
    daemon = _start_with_free_ports(overrides, free_tcp_ports)
    probe = ResetProbe(daemon)
    try:
        probe.wait_connected()
        if load_name == "snapshot":
            probe.populate(snapshot_blocks, 0, rank=1)
        # Refilling a large cache before every reset is slow: fewer rounds there.
        rounds = {s: resets if s == 0 else min(resets, max(10, 2_000_000 // s)) for s in sizes}
        for size in sizes:
            results["sizes"][str(size)] = {
                "idle": _reset_phase(
                    probe,
                    size,
                    rounds[size],
                    reset_timeout,
                    idle_ms,
                    progress=progress,
                    label=f"idle: {size:>9,} blocks",
                )
            }
        spec = LoadSpec(
            load_name,
            control_endpoint=daemon.control_endpoint,
            replay_endpoint=daemon.replay_endpoint,
            events_endpoint=daemon.events_endpoint,
            metrics_port=int(daemon.settings["metrics"]["port"]),
            snapshot_blocks=snapshot_blocks,
            store_tokens=store_tokens,
            flood_processes=flood_processes,
            idle_connections=idle_connections,
        )
        with Load(spec) as load:
            if not load.wait_ready(60):
                results["load_error"] = "the load processes did not start within 60 s"
            for size in sizes:
                results["sizes"][str(size)]["loaded"] = _reset_phase(
                    probe,
                    size,
                    rounds[size],
                    reset_timeout,
                    idle_ms,
                    load,
                    progress=progress,
                    label=f"under {load_name}: {size:>9,} blocks",
                )
        results["load"] = load.results
    finally:
        with interrupts_ignored():  # a second Ctrl-C must not leave the daemon behind
            probe.close()
            results["daemon"] = _stop_and_report(daemon)
    return results


def _start_with_free_ports(
    overrides: dict[str, dict[str, Any]], free_tcp_ports: Any
) -> DaemonProcess:
    """A tcp daemon with metrics on; the metrics port is picked at random, so a clash with
    another process gets a second try with a fresh one."""
    for attempt in range(3):
        (metrics_port,) = free_tcp_ports(1)
        daemon = DaemonProcess({**overrides, "metrics": {"port": metrics_port}}, transport="tcp")
        try:
            return daemon.start()
        except RuntimeError:
            daemon.cleanup()
            if attempt == 2:
                raise
        except BaseException:  # Ctrl-C or SIGTERM while it starts: stop it, remove its files
            daemon.__exit__()
            raise
    raise AssertionError("unreachable")


def _stop_and_report(daemon: DaemonProcess) -> dict[str, Any]:
    """Whether the daemon survived the bench, and its exit status on SIGTERM."""
    alive = daemon.alive()
    log_tail = "" if alive else daemon.log()[-2000:]
    try:
        code = daemon.stop(timeout=30) if alive else daemon.proc.returncode  # type: ignore[union-attr]
        report: dict[str, Any] = {"alive_at_end": alive, "exit_code": code}
    except RuntimeError:
        report = {"alive_at_end": alive, "exit_code": None, "ignored_sigterm": True}
    finally:
        daemon.cleanup()
    if log_tail:
        report["log_tail"] = log_tail
    return report


@bench_app.command("reset")
def bench_reset(
    sizes: Annotated[
        str | None,
        typer.Option(
            help="Cached blocks before each reset, comma-separated.",
            show_default="0,10000,100000,1000000; with --under 0,100000",
        ),
    ] = None,
    resets: Annotated[
        int, typer.Option(help="Resets measured per size (fewer at large sizes).")
    ] = 200,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
    device: Annotated[str, typer.Option(help="Pool device of the daemon: cpu or cuda:N.")] = "cpu",
    idle_ms: Annotated[
        float,
        typer.Option(
            help="Quiet time before each reset (the daemon is idle); under a load, the most "
            "a reset waits after an operation of the load started."
        ),
    ] = 20.0,
    under: Annotated[
        str | None,
        typer.Option(
            help="Also time resets while this load runs in other processes: snapshot, "
            "replay-flood, big-store or idle-conns."
        ),
    ] = None,
    reset_timeout: Annotated[
        float, typer.Option(help="With --under: a reset slower than this counts as a timeout.")
    ] = 30.0,
    snapshot_blocks: Annotated[
        int, typer.Option(help="With --under snapshot: published blocks the snapshot returns.")
    ] = 200_000,
    flood_processes: Annotated[
        int, typer.Option(help="With --under replay-flood: flooding processes.")
    ] = 4,
    idle_connections: Annotated[
        int, typer.Option(help="With --under idle-conns: TCP connections held open.")
    ] = 2000,
) -> None:
    """Reset sent -> AllBlocksCleared received by a subscriber, idle daemon, at each cache size;
    beside it the same daemon with the immediate flush off (the marker waits for a tick).
    With --under LOAD: the same, idle, beside the same daemon while LOAD runs."""
    if under is not None:
        from kvpubd.tools.bench_load import LOADS

        if under not in LOADS:
            raise fail(f"--under: {under!r} is not a load; choose from {', '.join(LOADS)}", USAGE)
    size_list = _cache_sizes(sizes or ("0,100000" if under else "0,10000,100000,1000000"))
    check_positive("--resets", resets, integer=True)
    check_positive("--reset-timeout", reset_timeout)
    if not 0 <= idle_ms < float("inf"):
        raise fail(f"--idle-ms: {idle_ms} is not a number of milliseconds >= 0", USAGE)
    _check_device(device)
    if resets < MIN_RESETS:
        warn(
            f"{resets} resets per size is too small a sample for a p99 (or a stable p50); "
            f"use --resets {MIN_RESETS} or more"
        )
    if under is not None:
        with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
            result = measure_under(
                under,
                size_list,
                resets,
                progress,
                device,
                idle_ms,
                reset_timeout,
                snapshot_blocks,
                flood_processes,
                idle_connections,
            )
        if as_json:
            typer.echo(json.dumps(result))
        else:
            Console().print(under_table(result))
        return
    with Progress(console=err, transient=True, disable=not err.is_terminal) as progress:
        immediate = measure_resets(size_list, resets, True, progress, device, idle_ms)
        baseline = measure_resets(size_list, resets, False, progress, device, idle_ms)
        floor = measure_floor(resets, idle_ms, progress)
    if as_json:
        typer.echo(json.dumps({"sizes": immediate, "baseline": baseline, "floor": floor}))
        return
    table = Table(
        title="reset -> marker received (loopback tcp, idle daemon)",
        caption="floor: a bare pyzmq loop that only publishes a marker and replies",
    )
    for column in (
        "cached blocks",
        "n",
        "p50 us",
        "p99 us",
        "max us",
        "reply p50 us",
        "baseline p50 us",
        "baseline p99 us",
    ):
        table.add_column(column, justify="right")
    for size in size_list:
        row, base = immediate[str(size)], baseline[str(size)]
        table.add_row(
            f"{size:,}",
            str(row["n"]),
            f"{row['p50_us']:.0f}",
            f"{row['p99_us']:.0f}",
            f"{row['max_us']:.0f}",
            f"{row['reply']['p50_us']:.0f}",
            f"{base['p50_us']:.0f}",
            f"{base['p99_us']:.0f}",
        )
    table.add_row(
        "floor",
        str(floor["n"]),
        f"{floor['p50_us']:.0f}",
        f"{floor['p99_us']:.0f}",
        f"{floor['max_us']:.0f}",
        f"{floor['reply']['p50_us']:.0f}",
        "",
        "",
    )
    Console().print(table)


def under_table(result: dict[str, Any]) -> Table:
    daemon = result["daemon"]
    table = Table(
        title=f"reset -> marker received, idle and under {result['under']} (loopback tcp)",
        caption=f"daemon alive at the end: {daemon['alive_at_end']}, "
        f"exit code on SIGTERM: {daemon['exit_code']}",
    )
    for column in ("cached blocks", "", "n", "p50 us", "p99 us", "max us", "timeouts"):
        table.add_column(column, justify="right")
    for size, phases in result["sizes"].items():
        for phase, row in phases.items():
            table.add_row(
                f"{int(size):,}" if phase == "idle" else "",
                phase,
                str(row["n"]),
                f"{row['p50_us']:.0f}",
                f"{row['p99_us']:.0f}",
                f"{row['max_us']:.0f}" if row["max_us"] is not None else "",
                str(row["timeouts"]) + (f" ({row['error']})" if "error" in row else ""),
            )
    return table


@bench_app.command("kernels")
def bench_kernels(
    pool_gib: Annotated[float, typer.Option(help="GPU pool size per block size, GiB.")] = 8.0,
    block_bytes: Annotated[
        list[int] | None, typer.Option(help="Block size in bytes (repeatable).")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Timed runs per operation (median).")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed runs first.")] = 2,
    bandwidth_gib: Annotated[
        float, typer.Option(help="Size of the device-to-device copy that sets the bandwidth.")
    ] = 4.0,
    variant: Annotated[
        list[str] | None,
        typer.Option(help="Also time a build TILE:UNROLL[:STREAMING] (repeatable)."),
    ] = None,
    check: Annotated[bool, typer.Option(help="Only compare every kernel with its NumPy twin.")] = (
        False
    ),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """GB/s of the GPU scrub, copy and checksum kernels beside CuPy's own operations and the
    device's measured bandwidth (needs CuPy and a GPU)."""
    from kvpubd.daemon.kernels import gpu_available
    from kvpubd.tools import bench_kernels as kb

    if not gpu_available():
        err.print("kvpubd: bench kernels needs CuPy and a CUDA GPU")
        raise typer.Exit(1)
    if check:
        failures = kb.self_check()
        for failure in failures:
            err.print(f"FAIL {failure}")
        typer.echo(f"self-check: {'OK' if not failures else f'{len(failures)} failures'}")
        raise typer.Exit(1 if failures else 0)
    builds = []
    for spec in variant or []:
        parts = [int(x) for x in spec.split(":")] + [0]
        builds.append((parts[0], parts[1], bool(parts[2])))
    result = kb.run_kernel_bench(
        pool_gib,
        block_bytes or list(kb.DEFAULT_BLOCK_BYTES),
        repeats=repeats,
        warmup=warmup,
        bandwidth_gib=bandwidth_gib,
        variants=builds,
        log=None if as_json else (lambda msg: err.print(f"[dim]{msg}[/dim]")),
    )
    if as_json:
        typer.echo(json.dumps(result))
    else:
        Console(width=200).print(kb.format_table(result))
    if not all(result["checks"].values()):
        raise typer.Exit(1)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_index(blocks: int, chain: int, rounds: int) -> dict[str, Any]:
    """Radix index alone: build ``blocks`` cached blocks in chains of ``chain``, then a mix of
    stores (match + insert), lookups (match) and evictions at that size."""
    from hashlib import sha256

    from kvpubd.daemon.radix import ROOT, RadixIndex

    gc.collect()
    before = _rss_bytes()
    index = RadixIndex(blocks)
    for start in range(0, blocks, chain):
        digest = sha256(start.to_bytes(8, "little")).digest()
        run = []
        for _ in range(start, min(start + chain, blocks)):
            digest = sha256(digest).digest()
            run.append(digest)
        ids = list(range(start, start + len(run)))
        index.insert_run(run, ids, ROOT, None)
        index.unpin(ids)
    gc.collect()
    bytes_per_block = (_rss_bytes() - before) / blocks

    rng = np.random.default_rng(0)
    chains = [list(range(s, min(s + chain, blocks))) for s in range(0, blocks, chain)]
    ops = {"match": 0, "insert": 0, "evict": 0}
    seconds = {"match": 0.0, "insert": 0.0, "evict": 0.0}
    next_digest = 0
    for _ in range(rounds):
        # Look up a few cached chains (what a store's prefix match does).
        picks = [chains[i] for i in rng.integers(0, len(chains), size=8)]
        lookups = [[index.digest[b] for b in c] for c in picks]
        t0 = time.perf_counter()
        for digests in lookups:
            ops["match"] += len(index.match(digests))
        seconds["match"] += time.perf_counter() - t0
        # Make room for one new chain, then store it under a cached prefix.
        t0 = time.perf_counter()
        freed = index.evict(chain)
        seconds["evict"] += time.perf_counter() - t0
        ops["evict"] += len(freed)
        fresh = [
            sha256(b"n" + (next_digest + i).to_bytes(8, "little")).digest() for i in range(chain)
        ]
        next_digest += chain
        t0 = time.perf_counter()
        index.insert_run(fresh, freed, ROOT, None)
        index.unpin(freed)
        seconds["insert"] += time.perf_counter() - t0
        ops["insert"] += len(freed)
    total_ops = sum(ops.values())
    total_s = sum(seconds.values())
    return {
        "blocks": blocks,
        "ops_per_s": round(total_ops / total_s),
        "bytes_per_block": round(bytes_per_block, 1),
        "by_op": {op: round(ops[op] / seconds[op]) for op in ops},
    }


@bench_app.command("index")
def bench_index(
    blocks: Annotated[int, typer.Option(help="Cached blocks.")] = 1_000_000,
    chain: Annotated[int, typer.Option(help="Blocks per prompt chain.")] = 64,
    rounds: Annotated[int, typer.Option(help="Mixed rounds timed after the build.")] = 2000,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """Radix index ops/s (store/match/evict mix) and RSS bytes per cached block."""
    for option, value in (("--blocks", blocks), ("--chain", chain), ("--rounds", rounds)):
        check_positive(option, value, integer=True)
    with err.status(f"building and exercising an index of {blocks:,} blocks"):
        result = measure_index(blocks, chain, rounds)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(title=f"radix index at {blocks:,} cached blocks (chains of {chain})")
    for column in ("ops/s (mix)", "match/s", "insert/s", "evict/s", "RSS bytes/block"):
        table.add_column(column, justify="right")
    by_op = result["by_op"]
    table.add_row(
        f"{result['ops_per_s']:,}",
        f"{by_op['match']:,}",
        f"{by_op['insert']:,}",
        f"{by_op['evict']:,}",
        f"{result['bytes_per_block']:.0f}",
    )
    Console().print(table)


def _publisher_batches(count: int, events_per_batch: int, seed: int = 0) -> list[list[Any]]:
    """Realistic batches: 80 % BlockStored of 1-32 blocks of 16 tokens, 20 % BlockRemoved."""
    from kvpubd.protocol.wire import BlockRemoved, BlockStored

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        events: list[Any] = []
        for _ in range(events_per_batch):
            if rng.random() < 0.8:
                blocks = int(rng.integers(1, 33))
                events.append(
                    BlockStored(
                        block_hashes=rng.integers(0, 2**63, size=blocks).tolist(),
                        parent_block_hash=int(rng.integers(0, 2**63)),
                        token_ids=rng.integers(0, 150_000, size=16 * blocks).tolist(),
                        block_size=16,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                )
            else:
                events.append(
                    BlockRemoved(block_hashes=rng.integers(0, 2**63, size=4).tolist(), medium="GPU")
                )
        batches.append(events)
    return batches


def measure_publisher(batches: int, events_per_batch: int, rounds: int) -> dict[str, Any]:
    """``Publisher.publish(events)`` against the floor: msgpack-encoding the same events
    (pre-converted to their wire form) and sending them on a bare PUB. The publisher keeps
    each seq in a state file, as the daemon does under the default ``seq_origin``."""
    import tempfile
    from pathlib import Path

    from kvpubd.daemon.publisher import Publisher
    from kvpubd.daemon.seq_state import SeqState
    from kvpubd.protocol.wire import event_to_wire, pack_seq

    data = _publisher_batches(batches, events_per_batch)
    wire = [[event_to_wire(e, "map") for e in batch] for batch in data]
    total = batches * events_per_batch
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="kvpb") as tmp:
        seq_state = SeqState.open(Path(tmp) / "rank0.seq")
        publisher = Publisher(
            ctx,
            endpoint=f"ipc://{tmp}/ours",
            hwm=0,
            buffer_steps=batches,
            record_seq=seq_state.record,
        )
        floor_pub = ctx.socket(zmq.PUB)
        floor_pub.setsockopt(zmq.SNDHWM, 0)
        floor_pub.bind(f"ipc://{tmp}/floor")
        subs = []
        for endpoint in (f"ipc://{tmp}/ours", f"ipc://{tmp}/floor"):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            subs.append(sub)
        # Both PUBs deliver to a connected subscriber, drained between rounds.
        while not subs[0].poll(10):
            publisher.publish([])
        while not subs[1].poll(10):
            floor_pub.send_multipart([b"", pack_seq(0), msgpack.packb([0.0, [], 0])])

        def drain() -> None:
            for sub in subs:
                while sub.poll(0):
                    sub.recv_multipart()

        packer = msgpack.Packer(use_bin_type=True)
        ours, floor = [], []
        for _ in range(rounds):
            drain()
            start = time.perf_counter()
            for batch in data:
                publisher.publish(batch)
            ours.append(total / (time.perf_counter() - start))
            drain()
            start = time.perf_counter()
            for seq, batch in enumerate(wire):
                payload = packer.pack([time.time(), batch, 0])
                floor_pub.send_multipart([b"", pack_seq(seq), payload])
            floor.append(total / (time.perf_counter() - start))
        drain()
        publisher.close()
        seq_state.close()
        floor_pub.close(linger=0)
        for sub in subs:
            sub.close(linger=0)
    ctx.term()
    ours_median, floor_median = float(np.median(ours)), float(np.median(floor))
    return {
        "events_per_s": round(ours_median),
        "floor_events_per_s": round(floor_median),
        "ratio": round(ours_median / floor_median, 3),
        "batches": batches,
        "events_per_batch": events_per_batch,
        "rounds": rounds,
    }


@bench_app.command("publisher")
def bench_publisher(
    batches: Annotated[int, typer.Option(help="Pre-built batches per round.")] = 2000,
    events_per_batch: Annotated[int, typer.Option(help="Events per batch (floor mode).")] = 20,
    rounds: Annotated[int, typer.Option(help="Alternating rounds (median reported).")] = 7,
    against_vllm: Annotated[
        bool,
        typer.Option(
            "--against-vllm",
            help="Beside vLLM's own ZmqEventPublisher on identical batches (8 BlockStored x 16 "
            "blocks x 16 tokens), each stream decoded in another process by vLLM's KVEventBatch. "
            "Needs vLLM's kv_events.py: $KVPUBD_VLLM_KV_EVENTS or "
            "~/.cache/kvpubd/vllm/kv_events.py (see `kvpubd bench vllm-extract`).",
        ),
    ] = False,
    decoders: Annotated[
        int,
        typer.Option(
            help="With --against-vllm: decoding processes per stream, sharing its batches "
            "(one decodes each batch). One process decodes more slowly than either publisher "
            "publishes; with enough of them the publishers set the rate.",
        ),
    ] = 1,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """In-process publisher events/s on identical pre-built batches, beside the floor: a plain
    loop that msgpack-encodes the same batches and sends them on a bare pyzmq PUB; or, with
    --against-vllm, blocks/s beside vLLM's own publisher."""
    for option, value in (
        ("--batches", batches),
        ("--events-per-batch", events_per_batch),
        ("--rounds", rounds),
        ("--decoders", decoders),
    ):
        check_positive(option, value, integer=True)
    if against_vllm:
        _bench_against_vllm(batches, rounds, decoders, as_json)
        return
    with err.status(f"publishing {rounds} x {batches} batches, ours and the floor"):
        result = measure_publisher(batches, events_per_batch, rounds)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(
        title=f"publisher: {batches} batches x {events_per_batch} events, median of {rounds}"
    )
    for column in ("kvpubd events/s", "floor events/s", "kvpubd / floor"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result['events_per_s']:,}", f"{result['floor_events_per_s']:,}", f"{result['ratio']:.0%}"
    )
    Console().print(table)


def _bench_against_vllm(batches: int, rounds: int, decoders: int, as_json: bool) -> None:
    from kvpubd.tools import vllm_peer

    path = vllm_peer.kv_events_path()
    if not path.is_file():
        reason = (
            f"vLLM's kv_events.py not found at {path}: set {vllm_peer.ENV_VAR} or run "
            "`kvpubd bench vllm-extract WHEEL`; comparison skipped"
        )
        err.print(f"kvpubd: {reason}")
        if as_json:
            typer.echo(json.dumps({"skipped": reason}))
        return
    with err.status(f"{rounds} alternating rounds of {batches} batches, kvpubd and vLLM"):
        result = vllm_peer.measure_against_vllm(batches, rounds, path, decoders)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(
        title=f"publisher vs vLLM's ZmqEventPublisher: {batches} batches of {result['batch']}, "
        f"median of {rounds}, {decoders} decoding process(es) per stream",
        caption="blocks/s from the first publish to the last decode (vLLM's KVEventBatch); "
        "decoder busy: share of a round the busiest decoding process spent decoding (near "
        "100 %: the decoders, not the publisher, set the rate; add --decoders)",
    )
    for column in (
        "kvpubd blocks/s",
        "vLLM blocks/s",
        "kvpubd / vLLM",
        "paired rounds",
        "kvpubd CPU us/block",
        "vLLM CPU us/block",
        "decoder busy kvpubd / vLLM",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result['kvpubd_blocks_per_s']:,}",
        f"{result['vllm_blocks_per_s']:,}",
        f"{result['ratio']:.2f}x",
        f"{result['paired_ratio']:.2f}x",
        f"{result['kvpubd_cpu_us_per_block']:.3f}",
        f"{result['vllm_cpu_us_per_block']:.3f}",
        f"{result['decoder_busy']['kvpubd']:.0%} / {result['decoder_busy']['vllm']:.0%}",
    )
    Console().print(table)


@bench_app.command("vllm-extract")
def bench_vllm_extract(
    wheel: Annotated[str, typer.Argument(help="A vLLM wheel (pip download vllm --no-deps).")],
) -> None:
    """Copy vllm/distributed/kv_events.py out of a vLLM wheel to where --against-vllm looks."""
    from pathlib import Path

    from kvpubd.tools import vllm_peer

    try:
        dest = vllm_peer.extract_from_wheel(Path(wheel), vllm_peer.kv_events_path())
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        err.print(f"kvpubd: cannot extract {vllm_peer.WHEEL_MEMBER} from {wheel}: {exc}")
        raise typer.Exit(1) from None
    typer.echo(str(dest))


def make_prompts(count: int, seed: int = 0) -> list[bytes]:
    """Realistic prompts as packed uint32: 1-8k tokens, most starting with one of a few shared
    system prompts (256-2048 tokens), the rest unique."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 150_000, size=int(n)) for n in rng.integers(256, 2049, size=8)]
    prompts = []
    for _ in range(count):
        length = int(rng.integers(1024, 8193))
        if rng.random() < 0.8:
            prefix = prefixes[int(rng.integers(0, len(prefixes)))]
            body = rng.integers(0, 150_000, size=max(0, length - len(prefix)))
            tokens = np.concatenate([prefix, body])[:length]
        else:
            tokens = rng.integers(0, 150_000, size=length)
        prompts.append(tokens.astype("<u4").tobytes())
    return prompts


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

    from kvpubd.protocol.config import rank_endpoint

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


@bench_app.command("throughput")
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


@bench_app.command("soak")
def bench_soak(
    duration: Annotated[float, typer.Option(help="seconds of load", min=5)] = 60.0,
    seed: Annotated[int, typer.Option(help="seed of the prober's choices")] = 0,
    load: Annotated[
        list[str] | None,
        typer.Option(help="run only this load (repeat for several); default: every load"),
    ] = None,
    reloads: Annotated[bool, typer.Option(help="send SIGHUP now and then")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Every load at once (large, cached and small stores, checksums, snapshots, a replay
    flood, dying clients, reloads) while resets are timed and a follower's mirrors are
    checked against snapshots; exit 1 on a divergence, a lost reset or a dead daemon."""
    from kvpubd.tools.soak import run_soak

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("soak", total=None)
        try:
            report = run_soak(
                duration,
                seed,
                lambda text: progress.update(task, description=text),
                loads_run=load or None,
                reloads=reloads,
            )
        except ValueError as exc:
            raise fail(f"--load: {exc}", USAGE) from None
    if as_json:
        print(json.dumps(report))
    else:
        resets = report["resets"]
        print(
            f"soak {duration:g} s: {resets['n']} resets, "
            f"marker p50 {resets['p50_us'] / 1000:.2f} ms, "
            f"p99 {resets['p99_us'] / 1000:.2f} ms, max {(resets['max_us'] or 0) / 1000:.2f} ms; "
            f"{report['resets_lost']} lost; {report['checkpoints']} checkpoints, "
            f"{len(report['divergences'])} divergence(s); {report['load_failures']} load "
            f"request(s) failed; daemon alive: "
            f"{report['daemon'].get('alive_at_end')}"
        )
        for line in report["divergences"]:
            print(f"  divergence: {line}")
    if not report["ok"]:
        raise typer.Exit(1)
