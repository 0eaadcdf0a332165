"""``kvpubd bench relay``: kvpubd in upstream mode beside the engine it follows.

vLLM's own ``ZmqEventPublisher`` (relay_engine) publishes batches of stores and removals in a
process of its own; a ``kvpubd serve`` follows it (``upstream.flavour = "vllm"``, with its
replay endpoint) and republishes. One subscriber process on the engine's PUB socket and one on
kvpubd's (relay_subscriber) decode every batch with vLLM's types. Three phases:

- saturated: the engine publishes ``batches`` batches as fast as it can; each stream's rate is
  its events (and blocks) over the time from the first publish to the last batch received, and
  a batch's added latency is its arrival on kvpubd's stream minus its arrival on the engine's,
  matched by its first block hash (one system-wide clock, CLOCK_MONOTONIC);
- paced: ``paced_batches`` batches ``paced_interval_ms`` apart, the same figures for an engine
  that is not saturated;
- resets: with the engine idle, reset sent -> AllBlocksCleared received on kvpubd's stream
  (kvpubd calls the engine's reset endpoint, whose clear the idle engine sends with its next
  batch, as vLLM's does);
- resets under load: the same while the engine publishes at ``load_fraction`` of the blocks/s
  kvpubd relayed saturated (the subscriber processes are gone by then): kvpubd busy, without a
  backlog. After each, kvpubd drops the engine's events until the engine's own clear comes,
  with its next batch; the next reset waits until kvpubd republishes the engine's events.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kvpubd.exits import USAGE, check_positive, fail
from kvpubd.tools.bench_children import answer, start_child
from kvpubd.tools.bench_probe import ResetProbe
from kvpubd.tools.bench_report import err, summary
from kvpubd.tools.launcher import DaemonProcess, free_tcp_ports
from kvpubd.tools.relay_engine import Shape, run_engine
from kvpubd.tools.relay_subscriber import Tally, run_subscriber

STREAMS = ("engine", "kvpubd")
WARMUP_TIMEOUT_S = 60.0
# A phase's answer: the engine's batches, decoded twice, behind a saturated kvpubd.
PHASE_TIMEOUT_S = 600.0


def _rates(tally: Tally, started_ns: int) -> dict[str, Any]:
    seconds = max(tally.last_ns - started_ns, 1) / 1e9
    return {
        "batches": tally.batches,
        "events": tally.events,
        "stored_blocks": tally.stored_blocks,
        "removed_blocks": tally.removed_blocks,
        "events_per_s": round(tally.events / seconds),
        "blocks_per_s": round((tally.stored_blocks + tally.removed_blocks) / seconds),
        "missing_seqs": tally.missing_seqs,
        "markers": tally.markers,
        "decoder_busy": round(tally.busy_s / seconds, 3),
    }


def _phase_report(
    shape: Shape, batches: range, started_ns: int, tallies: dict[str, Tally]
) -> dict[str, Any]:
    engine, relayed = tallies["engine"], tallies["kvpubd"]
    keys = [shape.key(i) for i in batches]
    added = [
        relayed.arrivals[key] - engine.arrivals[key]
        for key in keys
        if key in engine.arrivals and key in relayed.arrivals
    ]
    rates = {name: _rates(tallies[name], started_ns) for name in STREAMS}
    return {
        "batches": len(batches),
        "expected": {
            "events": shape.events(batches),
            "stored_blocks": shape.stored_blocks(batches),
            "removed_blocks": shape.removed_blocks(batches),
        },
        **rates,
        "lost_batches": {
            name: sum(key not in tallies[name].arrivals for key in keys) for name in STREAMS
        },
        # kvpubd's arrival minus the engine's, per batch both received (ns in, us out).
        "added_latency": summary(added),
        # Blocks, not events: kvpubd republishes removals back to back as one event.
        "relayed_ratio": round(
            rates["kvpubd"]["blocks_per_s"] / max(rates["engine"]["blocks_per_s"], 1), 3
        ),
    }


class _Children:
    """The engine and both subscribers, each in a process of its own."""

    def __init__(
        self, stack: ExitStack, kv_path: Path, shape: Shape, engine: tuple[str, str, int]
    ) -> None:
        self.engine = start_child(stack, run_engine, str(kv_path), *engine, shape)
        answer(self.engine, "the engine")  # bound
        self.subscribers: dict[str, Any] = {}
        self._kv_path = kv_path
        self._stack = stack

    def subscribe(self, name: str, endpoint: str) -> None:
        self.subscribers[name] = start_child(
            self._stack, run_subscriber, str(self._kv_path), endpoint
        )

    def warm_up(self) -> None:
        """Warm-up batches until a block of theirs reached both subscribers (kvpubd's through
        the daemon, which then follows the engine)."""
        live: set[str] = set()
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while time.monotonic() < deadline:
            self.engine.send(("warm",))
            answer(self.engine, "the engine")
            for name, pipe in self.subscribers.items():
                # Waiting on the subscriber paces the warm-up batches.
                if name not in live and pipe.poll(0.01):
                    pipe.recv()
                    live.add(name)
            if len(live) == len(self.subscribers):
                return
        missing = ", ".join(sorted(set(self.subscribers) - live))
        raise TimeoutError(f"no warm-up block reached the subscriber(s) of {missing}")

    def phase(
        self, shape: Shape, batches: range, interval_s: float
    ) -> tuple[int, dict[str, Tally]]:
        expected = (shape.stored_blocks(batches), shape.removed_blocks(batches))
        self.build(batches)
        for pipe in self.subscribers.values():
            pipe.send(expected)
        for name, pipe in self.subscribers.items():
            answer(pipe, f"the {name} subscriber")  # armed
        self.engine.send(("run", interval_s))
        started: int = answer(self.engine, "the engine", PHASE_TIMEOUT_S)
        tallies = {
            name: answer(pipe, f"the {name} subscriber", PHASE_TIMEOUT_S)
            for name, pipe in self.subscribers.items()
        }
        return started, tallies

    def build(self, batches: range) -> None:
        """The engine builds the batches, before anyone waits for them."""
        self.engine.send(("build", batches.start, len(batches)))
        answer(self.engine, "the engine", PHASE_TIMEOUT_S)

    def close_subscribers(self) -> None:
        for pipe in self.subscribers.values():
            pipe.send(None)
        self.subscribers = {}

    def close(self) -> None:
        self.close_subscribers()
        self.engine.send(None)


def measure_relay(
    kv_path: Path,
    batches: int,
    shape: Shape,
    paced_batches: int,
    paced_interval_ms: float,
    resets: int,
    idle_ms: float,
    loaded_resets: int = 0,
    load_fraction: float = 0.9,
) -> dict[str, Any]:
    pub_port, replay_port, reset_port = free_tcp_ports(3)
    engine = (f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", reset_port)
    overrides: dict[str, dict[str, Any]] = {
        "upstream": {
            "flavour": "vllm",
            "endpoint": f"tcp://127.0.0.1:{pub_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "reset_url": f"http://127.0.0.1:{reset_port}/reset_prefix_cache",
        },
        "service": {"log_level": "warning"},
    }
    result: dict[str, Any] = {
        "shape": {
            "stores_per_batch": shape.stores,
            "blocks_per_store": shape.blocks,
            "block_size": shape.block_size,
            "engine_pool_blocks": shape.pool_blocks,
        },
        "vllm_kv_events": str(kv_path),
    }
    with ExitStack() as stack:
        children = _Children(stack, kv_path, shape, engine)
        daemon = stack.enter_context(DaemonProcess(overrides, transport="tcp"))
        children.subscribe("engine", overrides["upstream"]["endpoint"])
        children.subscribe("kvpubd", daemon.events_endpoint)
        children.warm_up()
        saturated = range(batches)
        started, tallies = children.phase(shape, saturated, 0.0)
        result["saturated"] = _phase_report(shape, saturated, started, tallies)
        if paced_batches:
            paced = range(batches, batches + paced_batches)
            started, tallies = children.phase(shape, paced, paced_interval_ms / 1000)
            result["paced"] = {
                **_phase_report(shape, paced, started, tallies),
                "interval_ms": paced_interval_ms,
            }
        if resets:
            result["resets"] = _time_resets(daemon, resets, idle_ms)
        if loaded_resets:
            during = range(batches + paced_batches, 2 * batches + paced_batches)
            relayed = result["saturated"]["kvpubd"]["blocks_per_s"]
            per_batch = (shape.stored_blocks(saturated) + shape.removed_blocks(saturated)) / batches
            interval_s = per_batch / max(load_fraction * relayed, 1.0)
            result["loaded_resets"] = {
                **_time_loaded_resets(children, daemon, during, interval_s, loaded_resets),
                "load_fraction": load_fraction,
                "engine_interval_us": round(interval_s * 1e6, 1),
            }
        children.close()
    return result


def _time_resets(daemon: DaemonProcess, resets: int, idle_ms: float) -> dict[str, Any]:
    """Reset sent -> AllBlocksCleared received on kvpubd's stream, the engine idle."""
    probe = ResetProbe(daemon)

    def idle(_: int) -> bool:
        probe.drain_sub(idle_ms / 1000)  # the daemon and the engine are idle
        return True

    try:
        probe.wait_connected()
        return _timed_resets(probe, resets, idle)
    finally:
        probe.close()


def _time_loaded_resets(
    children: _Children, daemon: DaemonProcess, batches: range, interval_s: float, resets: int
) -> dict[str, Any]:
    """Reset sent -> AllBlocksCleared received on kvpubd's stream while the engine publishes
    ``batches``, one per ``interval_s``: up to ``resets``, each once kvpubd relays again."""
    probe = ResetProbe(daemon)
    try:
        probe.wait_connected()
        children.close_subscribers()  # nobody left to read their streams
        children.build(batches)
        children.engine.send(("run", interval_s))
        timed = _timed_resets(
            probe,
            resets,
            # Until the engine has finished (a first reset in any case).
            lambda done: (
                not (done and children.engine.poll(0)) and probe.wait_relaying(timeout=5.0)
            ),
        )
        answer(children.engine, "the engine", PHASE_TIMEOUT_S)
    finally:
        probe.close()
    return {**timed, "engine_batches": len(batches)}


def _timed_resets(probe: ResetProbe, resets: int, ready: Callable[[int], bool]) -> dict[str, Any]:
    """Up to ``resets`` resets timed, each once ``ready(resets timed so far)``; none more
    once it says False."""
    markers: list[int] = []
    replies: list[int] = []
    while len(markers) < resets and ready(len(markers)):
        marker, reply = probe.time_reset()
        markers.append(marker)
        replies.append(reply)
    return {**summary(markers), "reply": summary(replies)}


def bench_relay(
    batches: Annotated[
        int, typer.Option(help="Batches the engine publishes as fast as it can.")
    ] = 5000,
    stores_per_batch: Annotated[int, typer.Option(help="BlockStored events per batch.")] = 4,
    blocks_per_store: Annotated[int, typer.Option(help="Blocks per BlockStored.")] = 16,
    block_size: Annotated[int, typer.Option(help="Tokens per block.")] = 16,
    engine_pool_blocks: Annotated[
        int,
        typer.Option(
            help="The engine's pool: once full, each stored block evicts the oldest (a "
            "BlockRemoved each, as vLLM reports evictions)."
        ),
    ] = 65_536,
    paced_batches: Annotated[
        int, typer.Option(help="Then batches published --paced-interval-ms apart (0: none).")
    ] = 500,
    paced_interval_ms: Annotated[
        float, typer.Option(help="The engine's pause between paced batches.")
    ] = 10.0,
    resets: Annotated[
        int, typer.Option(help="Resets timed last, the engine idle (0: none).")
    ] = 200,
    idle_ms: Annotated[float, typer.Option(help="Quiet time before each reset.")] = 20.0,
    loaded_resets: Annotated[
        int,
        typer.Option(
            help="Then resets timed while the engine publishes --batches more at "
            "--load-fraction of the rate kvpubd relayed saturated (0: none)."
        ),
    ] = 50,
    load_fraction: Annotated[
        float, typer.Option(help="The engine's rate during --loaded-resets.", min=0.01, max=1.0)
    ] = 0.9,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """kvpubd following vLLM's own ZmqEventPublisher (upstream mode): the engine's delivered
    rate beside kvpubd's relayed rate in the same run, each stream decoded by vLLM's
    KVEventBatch in a subscriber process; lost batches and markers on each; the latency kvpubd
    adds per batch, saturated and paced; and reset -> AllBlocksCleared on kvpubd's stream with
    the engine idle. Needs vLLM's kv_events.py ($KVPUBD_VLLM_KV_EVENTS or
    ~/.cache/kvpubd/vllm/kv_events.py; see `kvpubd bench vllm-extract`): skipped without it."""
    from kvpubd.tools import vllm_source

    for option, value in (
        ("--batches", batches),
        ("--stores-per-batch", stores_per_batch),
        ("--blocks-per-store", blocks_per_store),
        ("--block-size", block_size),
        ("--engine-pool-blocks", engine_pool_blocks),
    ):
        check_positive(option, value, integer=True)
    if paced_batches < 0 or resets < 0 or loaded_resets < 0:
        raise fail("--paced-batches, --resets and --loaded-resets: a whole number >= 0", USAGE)
    if paced_batches:
        check_positive("--paced-interval-ms", paced_interval_ms)
    if not 0 <= idle_ms < float("inf"):
        raise fail(f"--idle-ms: {idle_ms} is not a number of milliseconds >= 0", USAGE)
    path = vllm_source.kv_events_path()
    if not path.is_file():
        reason = (
            f"vLLM's kv_events.py not found at {path}: set {vllm_source.ENV_VAR} or run "
            "`kvpubd bench vllm-extract WHEEL`; relay bench skipped"
        )
        err.print(f"kvpubd: {reason}")
        if as_json:
            typer.echo(json.dumps({"skipped": reason}))
        return
    shape = Shape(stores_per_batch, blocks_per_store, block_size, engine_pool_blocks)
    with err.status(f"engine -> kvpubd: {batches} batches saturated, {paced_batches} paced"):
        result = measure_relay(
            path,
            batches,
            shape,
            paced_batches,
            paced_interval_ms,
            resets,
            idle_ms,
            loaded_resets,
            load_fraction,
        )
    if as_json:
        typer.echo(json.dumps(result))
        return
    _print(result)


def _print(result: dict[str, Any]) -> None:
    shape = result["shape"]
    table = Table(
        title=f"kvpubd following vLLM's publisher: {shape['stores_per_batch']} stores x "
        f"{shape['blocks_per_store']} blocks x {shape['block_size']} tokens a batch, evicting "
        f"beyond {shape['engine_pool_blocks']:,} blocks",
        caption="rates: events (and blocks stored or removed) from the first publish to the "
        "last batch received; added latency: a batch's arrival on kvpubd's stream minus on the "
        "engine's (both subscribers' wake-ups included: below 0 where the engine's woke later)",
    )
    for column in (
        "phase",
        "stream",
        "batches",
        "events/s",
        "blocks/s",
        "lost batches",
        "missing seqs",
        "markers",
        "decoder busy",
        "added p50 us",
        "added p99 us",
    ):
        table.add_column(column, justify="right")
    for phase in ("saturated", "paced"):
        if phase not in result:
            continue
        report = result[phase]
        for name in STREAMS:
            row = report[name]
            latency = report["added_latency"] if name == "kvpubd" else None
            table.add_row(
                phase,
                name,
                f"{row['batches']:,}/{report['batches']:,}",
                f"{row['events_per_s']:,}",
                f"{row['blocks_per_s']:,}",
                str(report["lost_batches"][name]),
                str(row["missing_seqs"]),
                str(row["markers"]),
                f"{row['decoder_busy']:.0%}",
                f"{latency['p50_us']:.0f}" if latency else "",
                f"{latency['p99_us']:.0f}" if latency else "",
            )
    Console().print(table)
    resets = result.get("resets")
    if resets:
        Console().print(
            f"reset -> AllBlocksCleared on kvpubd's stream (engine idle), n = {resets['n']}: "
            f"p50 {resets['p50_us'] / 1000:.2f} ms, p99 {resets['p99_us'] / 1000:.2f} ms, "
            f"max {resets['max_us'] / 1000:.2f} ms (target p99 <= 5 ms)"
        )
    busy = result.get("loaded_resets")
    if busy and busy.get("n"):
        Console().print(
            f"reset -> AllBlocksCleared on kvpubd's stream (engine at "
            f"{busy['load_fraction']:.0%} of kvpubd's saturated rate), n = {busy['n']}: "
            f"p50 {busy['p50_us'] / 1000:.2f} ms, p99 {busy['p99_us'] / 1000:.2f} ms, "
            f"max {busy['max_us'] / 1000:.2f} ms"
        )
