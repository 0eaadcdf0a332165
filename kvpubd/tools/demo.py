"""``kvpubd demo``: the whole product in one command, on CPU, for a newcomer.

It starts a daemon (a child process on private ipc sockets), a load generator (a thread with
the shared-prefix workload of ``kvpubd loadgen``) and a subscriber (this thread), then:

1. streams: the subscriber follows every batch live;
2. stalls the subscriber, as a slow router would: with small high-water marks ZeroMQ drops
   batches for it, and it repairs the gap through replay when it reads again;
3. resets the cache while load runs: the marker is published at once;
4. stops the load, and checks that the cache rebuilt from the events alone equals the
   daemon's own snapshot.

It ends with a summary and exits 0 when the stream was complete and the check passed."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvpubd.client import (
    ControlClient,
    ControlError,
    Counters,
    Mirror,
    MirrorError,
    RankStats,
    Received,
    Subscriber,
)
from kvpubd.protocol.wire import BlockStored
from kvpubd.tools.launcher import DaemonProcess
from kvpubd.tools.loadgen import DEFAULT_MIX, LoadGenerator, LoadStats, Workload, parse_mix

# Small buffers make a stalled subscriber lose batches quickly (then replay repairs them);
# a fast tick publishes about one batch per request.
DAEMON_OVERRIDES: dict[str, dict[str, Any]] = {
    "cache": {"num_blocks": 1024, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
    "events": {"hwm": 16, "tick_interval_ms": 2},
    "service": {"log_level": "info"},
}
SUB_HWM = 16
REFRESH_S = 0.25


@dataclass
class Seen:
    """What the subscriber received."""

    batches: int = 0
    events: dict[str, int] = field(
        default_factory=lambda: {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    )
    last_seq: int = -1

    def add(self, batch: Received) -> None:
        self.batches += 1
        self.last_seq = batch.seq
        for event in batch.batch.events:
            name = type(event).__name__
            self.events[name] = self.events.get(name, 0) + 1


@dataclass
class ResetResult:
    marker_seq: int
    reply_ms: float
    marker_ms: float | None = None  # reset call -> marker received by the subscriber


class Demo:
    def __init__(self, console: Console, duration: float, rate: float, mix: str) -> None:
        self.console = console
        self.duration = duration
        self.rate = rate
        self.mix = parse_mix(mix)
        self.seen = Seen()
        self.mirror = Mirror()
        self.phase = "starting"
        self.started = time.monotonic()
        self.pool: RankStats | None = None
        self.reset: ResetResult | None = None
        self.stall_s = 0.0
        self.counters = Counters()
        self.snapshot_blocks = 0
        self.load: LoadGenerator | None = None
        self.load_error: BaseException | None = None
        self._stop_load = threading.Event()

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        with DaemonProcess(DAEMON_OVERRIDES) as daemon:
            self.note(f"daemon started: events on {daemon.events_endpoint}")
            context = zmq.Context()
            # Only the SUB sockets get the small receive queue; replay sockets keep the default.
            context.setsockopt(zmq.RCVHWM, SUB_HWM)
            subscriber = daemon.subscriber(context=context)
            context.setsockopt(zmq.RCVHWM, 1000)
            try:
                with daemon.client() as control:
                    return self._run(daemon, subscriber, control)
            finally:
                self._stop_load.set()
                subscriber.close()
                context.term()

    def _run(self, daemon: DaemonProcess, subscriber: Subscriber, control: ControlClient) -> int:
        load_thread = threading.Thread(target=self._load, args=(daemon,), name="loadgen")
        with Live(self.render(), console=self.console, refresh_per_second=4) as live:
            self.live = live
            self._receive(subscriber.catch_up())
            load_thread.start()
            d = self.duration
            self.phase = "streaming"
            self._follow(subscriber, control, until=0.3 * d)

            self.phase = "subscriber stalled"
            self.stall_s = min(2.0, 0.2 * d)
            gaps = subscriber.counters.gaps
            time.sleep(self.stall_s)  # the point: a subscriber that does not read
            self.phase = "catching up"
            self._follow(subscriber, control, until=0.6 * d)
            if subscriber.counters.gaps > gaps:
                self.note(
                    f"stalled {self.stall_s:.1f} s: ZeroMQ dropped batches at the high-water "
                    f"mark; the gap was repaired through replay"
                )
            else:
                self.note(f"stalled {self.stall_s:.1f} s: nothing was dropped this time")

            self.phase = "reset"
            self._reset(subscriber, control)
            self.phase = "streaming"
            self._follow(subscriber, control, until=d)

            self.phase = "checking"
            self._stop_load.set()
            load_thread.join()
            if self.load_error is not None:
                raise self.load_error
            ok = self._check(subscriber, control)
            self.phase = "done"
            live.update(self.render())
        self.summary(subscriber, ok)
        return 0 if ok else 1

    def _load(self, daemon: DaemonProcess) -> None:
        try:
            with daemon.client() as client:
                self.load = LoadGenerator(client, Workload(self.mix), rate=self.rate, hold=0.1)
                self.load.run(float("inf"), self._stop_load.is_set)
        except BaseException as exc:  # reported by the main thread
            self.load_error = exc

    def _receive(self, batches: list[Received]) -> None:
        for batch in batches:
            self.seen.add(batch)
            self.mirror.apply(batch.batch.events)

    def _follow(self, subscriber: Subscriber, control: Any, until: float) -> None:
        """Receive until ``until`` seconds into the demo, refreshing the display."""
        next_refresh = 0.0
        while (now := time.monotonic() - self.started) < until:
            self._receive(subscriber.receive(min(0.05, until - now)))
            if now >= next_refresh:
                self._refresh(subscriber, control)
                next_refresh = now + REFRESH_S
            if self.load_error is not None:
                raise self.load_error

    def _refresh(self, subscriber: Subscriber, control: ControlClient) -> None:
        self.pool = control.stats().ranks[0]
        self.counters = subscriber.counters
        self.live.update(self.render())

    def _reset(self, subscriber: Subscriber, control: ControlClient) -> None:
        started = time.monotonic()
        # force: the load keeps requests open; a reset drops them, as an engine's reset does.
        marker = control.reset(force=True).markers[0].seq
        assert marker is not None  # the demo daemon publishes markers at once
        self.reset = ResetResult(marker, (time.monotonic() - started) * 1e3)
        deadline = started + 5.0
        while self.seen.last_seq < marker and time.monotonic() < deadline:
            self._receive(subscriber.receive(0.01))
        if self.seen.last_seq >= marker:
            self.reset.marker_ms = (time.monotonic() - started) * 1e3
        self.note(
            f"reset: marker seq {marker}, reply after {self.reset.reply_ms:.2f} ms, "
            f"marker received after {self.reset.marker_ms or float('nan'):.2f} ms"
        )

    def _check(self, subscriber: Subscriber, control: ControlClient) -> bool:
        """The cache rebuilt from the events equals the daemon's snapshot."""
        snapshot = control.snapshot(0)
        deadline = time.monotonic() + 10.0
        while self.seen.last_seq < snapshot.seq and time.monotonic() < deadline:
            self._receive(subscriber.receive(0.05))
        self.pool = control.stats().ranks[0]
        self.counters = subscriber.counters
        expected = {e.block_hashes[0] for e in snapshot.events if isinstance(e, BlockStored)}
        self.snapshot_blocks = len(expected)
        return (
            self.seen.last_seq >= snapshot.seq
            and subscriber.counters.lost == 0
            and set(self.mirror.blocks) == expected
        )

    # -- output --------------------------------------------------------------------------------

    def note(self, text: str) -> None:
        self.console.print(f"[bold cyan]•[/] {text}")

    def render(self) -> Group:
        elapsed = min(time.monotonic() - self.started, self.duration)
        load = self.load.stats if self.load is not None else LoadStats()
        counters = self.counters
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        table.add_row("phase", f"{self.phase}  ({elapsed:.1f} s of {self.duration:g} s)")
        table.add_row(
            "load",
            f"{load.requests} requests, prefix hit rate {load.hit_rate:.0%}",
        )
        events = self.seen.events
        table.add_row(
            "events seen",
            f"{events['BlockStored']} BlockStored, {events['BlockRemoved']} BlockRemoved, "
            f"{events['AllBlocksCleared']} AllBlocksCleared",
        )
        table.add_row("batches", f"{self.seen.batches} (last seq {self.seen.last_seq})")
        table.add_row(
            "gaps", f"{counters.gaps}, {counters.replayed} batches repaired through replay"
        )
        if self.pool is not None:
            table.add_row(
                "pool",
                f"{self.pool.blocks_used}/{self.pool.blocks_capacity} blocks used, "
                f"{self.pool.blocks_pinned} pinned",
            )
        return Group(Text("kvpubd demo", style="bold"), table)

    def summary(self, subscriber: Subscriber, ok: bool) -> None:
        load = self.load.stats if self.load is not None else LoadStats()
        counters = subscriber.counters
        events = self.seen.events
        table = Table(title="kvpubd demo: summary", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        table.add_row(
            "requests",
            f"{load.requests} stored at {load.rate:.0f}/s, prefix hit rate {load.hit_rate:.0%}"
            + (f", {load.errors.get('unknown_request', 0)} dropped by the reset"),
        )
        table.add_row(
            "events seen",
            f"{sum(events.values())}: {events['BlockStored']} BlockStored, "
            f"{events['BlockRemoved']} BlockRemoved, {events['AllBlocksCleared']} "
            f"AllBlocksCleared (start + reset)",
        )
        table.add_row("batches", f"{self.seen.batches}, seqs 0..{self.seen.last_seq}")
        table.add_row(
            "gaps repaired",
            f"{counters.gaps} gap(s), {counters.replayed} batches through replay "
            f"(the initial catch-up included), {counters.lost} lost",
        )
        if self.reset is not None:
            marker = (
                f"{self.reset.marker_ms:.2f} ms" if self.reset.marker_ms is not None else "not seen"
            )
            table.add_row(
                "reset latency",
                f"reply {self.reset.reply_ms:.2f} ms, marker at the subscriber {marker} "
                f"(marker seq {self.reset.marker_seq})",
            )
        table.add_row(
            "check",
            (
                f"[green]the cache rebuilt from events equals the daemon's snapshot "
                f"({self.snapshot_blocks} blocks)[/]"
            )
            if ok
            else "[red]the cache rebuilt from events differs from the daemon's snapshot[/]",
        )
        self.console.print()
        self.console.print(table)
        self.console.print(
            "Next: [bold]kvpubd serve[/] in one shell, then [bold]kvpubd subscribe[/] and "
            "[bold]kvpubd loadgen[/] in two others."
        )


def run_demo(duration: float = 10.0, rate: float = 200.0, mix: str = DEFAULT_MIX) -> int:
    """Run the demo; returns the exit status."""
    console = Console()
    demo = Demo(console, duration, rate, mix)
    try:
        return demo.run()
    except MirrorError as exc:
        console.print(f"[red]the event stream broke an invariant: {exc}[/]")
        return 1
    except (RuntimeError, ControlError, TimeoutError) as exc:  # the daemon failed or went away
        console.print(f"[red]demo failed: {exc}[/]", markup=True, highlight=False)
        return 1
    except KeyboardInterrupt:
        return 130
