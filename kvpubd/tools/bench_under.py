"""``kvpubd bench reset --under LOAD``: reset -> marker on an idle daemon, then on the same
daemon while a load (bench_load) runs in other processes against its rank 1 or its ports."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from rich.progress import Progress
from rich.table import Table

from kvpubd.interrupts import interrupts_ignored
from kvpubd.tools.bench_daemon import start_with_free_ports, stop_and_report
from kvpubd.tools.bench_probe import TINY_BLOCKS, ResetProbe
from kvpubd.tools.bench_report import summary


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
    snapshot_clients: int = 8,
) -> dict[str, Any]:
    """Reset -> marker at each size on an idle daemon, then on the same daemon while
    ``load_name`` runs in other processes against its rank 1 (or its ports)."""
    from kvpubd.daemon.settings import ControlConfig
    from kvpubd.tools.bench_load import LOAD_RANK, Load, LoadSpec, client_summary

    # The largest store the daemon allows by default (block_size 16).
    limits = ControlConfig()
    store_tokens = min(limits.max_tokens_per_request, limits.max_blocks_per_store * 16)
    # The snapshot loads' rank holds snapshot_blocks, so that every snapshot is that large.
    load_blocks = {
        "snapshot": snapshot_blocks,
        "snapshot-endpoint": snapshot_blocks,
        "big-store": 2 * store_tokens // 16,
    }
    num_blocks = max([*sizes, load_blocks.get(load_name, 0), 1024]) + 1024
    overrides: dict[str, dict[str, Any]] = {
        "cache": {**TINY_BLOCKS, "num_blocks": num_blocks, "device": device},
        # Rank 0 is reset and measured; rank 1 carries the load's cache.
        "events": {"buffer_steps": 1000},
        "service": {"log_level": "warning"},
    }
    overrides["cache"]["data_parallel_size"] = 2
    if load_name == "snapshot-endpoint":
        # Only for this load: the endpoint makes every batch carry a publisher id and an idle
        # rank heartbeat each second, which the other loads' daemon (and their earlier
        # numbers) never had. Here the idle phase has them too, so idle and loaded differ
        # by the clients alone.
        overrides["events"]["snapshot_endpoint"] = True
    results: dict[str, Any] = {"under": load_name, "sizes": {}}
    daemon = start_with_free_ports(overrides)
    probe = ResetProbe(daemon)
    try:
        probe.wait_connected()
        if load_name in ("snapshot", "snapshot-endpoint"):
            probe.populate(snapshot_blocks, 0, rank=LOAD_RANK)
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
            snapshot_endpoint=probe.client.ping().endpoints[LOAD_RANK].snapshot,
            snapshot_clients=snapshot_clients,
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
        if load_name == "snapshot-endpoint":
            results["snapshot_clients"] = client_summary(load.results)
    finally:
        with interrupts_ignored():  # a second Ctrl-C must not leave the daemon behind
            probe.close()
            results["daemon"] = stop_and_report(daemon)
    return results


def under_table(result: dict[str, Any]) -> Table:
    daemon = result["daemon"]
    caption = (
        f"daemon alive at the end: {daemon['alive_at_end']}, "
        f"exit code on SIGTERM: {daemon['exit_code']}"
    )
    clients = result.get("snapshot_clients")
    if clients:
        caption += (
            f"\n{clients['clients']} snapshot clients: {clients['requests']} snapshots of "
            f"{clients['reply_bytes']:,} bytes, p50 {clients['p50_ms']} ms, p99 "
            f"{clients['p99_ms']} ms; timeouts {clients['timeouts']}, unavailable "
            f"{clients['unavailable']}, wrong event counts {clients['wrong_events']}"
        )
    table = Table(
        title=f"reset -> marker received, idle and under {result['under']} (loopback tcp)",
        caption=caption,
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
