"""``kvpubd bench soak``: every load at once against one daemon, for a set time, while a prober
times each reset -> marker and a follower process mirrors every rank from the stream alone.

The loads (soak_loads) run in processes of their own: large stores, the same large prompt
stored again (a prefix-cache hit), pipelined small stores, checksums of the whole pool,
snapshots, a replay flood, and clients that go away or die holding stores. The prober resets
rank 0 or every rank (forced) a few times a second and sends SIGHUP now and then. Two follower
processes mirror every rank: one repairs gaps through replay and the control snapshot, the
other follows vLLM's snapshot protocol (the daemon serves ``events.snapshot_endpoint``),
bootstrapping from the snapshot endpoint again at every gap under the loads. At checkpoints
the loads hold still and each follower's mirror of each rank must equal the daemon's
snapshot.

Reported: reset -> marker p50/p99/max, resets that never published, divergences, whether the
daemon lived. The exit status is 1 on a divergence, a lost reset or a dead daemon; latency is
reported, not judged (it depends on the machine)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import tempfile
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress

from kvpubd.client import ControlError
from kvpubd.daemon.settings import RankProcessesMode
from kvpubd.exits import USAGE, fail
from kvpubd.interrupts import ctrl_c_kept_from_children, interrupts_ignored
from kvpubd.tools.bench_daemon import start_with_free_ports, stop_and_report
from kvpubd.tools.bench_load import LoadControl, LoadSpec, raise_fd_limit
from kvpubd.tools.bench_probe import ResetProbe
from kvpubd.tools.bench_report import summary
from kvpubd.tools.launcher import DaemonProcess, tied
from kvpubd.tools.soak_loads import LOADS, NUM_BLOCKS, OPT_IN, ORPHAN_GRACE_S

if TYPE_CHECKING:
    from kvpubd.client import Mirror
    from kvpubd.protocol.wire import BlockHash

RANKS = 2
RESET_TIMEOUT_S = 30.0
CHECKPOINT_EVERY_S = 10.0
PINS_DEADLINE_S = 30.0  # past the orphan grace, for what the loads left open to be released


FOLLOWERS = ("replay", "snapshot")  # how each follower repairs: see _follow


def _follow(endpoints: dict[str, str], conn: Any, how: str, host_medium: str | None) -> None:
    """A follower process: a Subscriber mirroring every rank, repairing through replay and
    the control snapshot (``how`` "replay") or bootstrapping from the snapshot endpoint
    ("snapshot"); on "check" it compares each mirror with the daemon's snapshot at the same
    seq. ``host_medium``: the medium of the daemon's host tier, if it has one."""
    from kvpubd.client import ControlClient, Subscriber

    repair: dict[str, Any] = (
        {"snapshot_endpoint": endpoints["snapshot"], "snapshot_timeout": 60}
        if how == "snapshot"
        else {"replay_endpoint": endpoints["replay"], "control": endpoints["control"]}
    )
    with (
        Subscriber(
            endpoints["events"],
            ranks=RANKS,
            control_timeout=60,
            replay_timeout=30,
            host_medium=host_medium,
            **repair,
        ) as sub,
        ControlClient(endpoints["control"], timeout=60) as client,
    ):
        while True:
            if conn.poll(0):
                if conn.recv() == "stop":
                    conn.send({})
                    return
                found = [d for r in range(RANKS) for d in _check(sub, client, r, host_medium)]
                conn.send({"divergences": [f"{how} follower: {d}" for d in found]})
            with contextlib.suppress(TimeoutError):
                sub.receive(0.05)


def _check(
    sub: Any, client: Any, rank: int, host_medium: str | None, attempts: int = 60
) -> list[str]:
    """The rank's mirror against its snapshot. A load's operation still finishing may publish
    after the snapshot (a large store on a CPU-starved machine takes seconds): then the mirror
    is past it and a newer snapshot is taken, for up to ``attempts`` half seconds. A real
    divergence stays."""
    from kvpubd.client import Mirror

    problem = ""
    for _ in range(attempts):
        snap = client.snapshot(rank)
        deadline = time.monotonic() + 60
        while (sub.last_seq(rank) or -1) < snap.seq and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                sub.receive(0.05)
        if (sub.last_seq(rank) or -1) < snap.seq:
            return [f"rank {rank}: never reached seq {snap.seq}"]
        expected = Mirror(host_medium=host_medium)
        expected.apply(snap.events)
        mirror = sub.mirror(rank)
        have = set() if mirror is None else held_blocks(mirror)
        want = held_blocks(expected)
        if have == want:
            return []
        problem = (
            f"rank {rank} at seq {snap.seq} (mirror at {sub.last_seq(rank)}): "
            f"{len(want - have)} blocks missing, {len(have - want)} extra"
        )
        time.sleep(0.5)
    return [problem]


def held_blocks(mirror: Mirror) -> set[tuple[int | str | None, BlockHash]]:
    """(group_idx, hash) of every block a mirror holds (None: events without a group;
    "host": the host tier's)."""
    held: set[tuple[int | str | None, BlockHash]] = {(None, h) for h in mirror.blocks}
    for group_idx, blocks in mirror.group_blocks.items():
        held.update((group_idx, h) for h in blocks)
    held.update(("host", h) for h in mirror.host_blocks)
    return held


def run_soak(
    duration_s: float,
    seed: int = 0,
    progress: Any = None,
    loads_run: list[str] | None = None,
    reloads: bool = True,
    rank_processes: RankProcessesMode = "auto",
    host_blocks: int = 0,
) -> dict[str, Any]:
    """The soak with ``loads_run`` (default: all of LOADS), SIGHUPs now and then if
    ``reloads``, the daemon's ``service.rank_processes`` and ``cache.host_blocks`` (a host
    tier per rank) as given."""
    names = [name for name in LOADS if name not in OPT_IN] if loads_run is None else loads_run
    unknown = [name for name in names if name not in LOADS]
    if unknown:
        raise ValueError(f"unknown load(s) {', '.join(unknown)}; known: {', '.join(LOADS)}")

    raise_fd_limit(4096)
    control_dir = tempfile.mkdtemp(prefix="kvs", dir="/tmp")  # ipc paths: ~107 bytes at most
    try:
        return _soak(
            names, duration_s, seed, progress, reloads, rank_processes, host_blocks, control_dir
        )
    finally:
        shutil.rmtree(control_dir, ignore_errors=True)


def _soak(
    names: list[str],
    duration_s: float,
    seed: int,
    progress: Any,
    reloads: bool,
    rank_processes: RankProcessesMode,
    host_blocks: int,
    control_dir: str,
) -> dict[str, Any]:
    overrides: dict[str, dict[str, Any]] = {
        "cache": {
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "uint8",
            "num_blocks": NUM_BLOCKS,
            "data_parallel_size": RANKS,
            "host_blocks": host_blocks,
        },
        # The snapshot endpoint on: the snapshot follower bootstraps from it (and every batch
        # carries the publisher id, which the replay follower reads past).
        "events": {"buffer_steps": 1000, "snapshot_endpoint": True},
        # The control socket over ipc, as an engine beside the daemon uses it: each client is
        # its process there, so what a load that dies or goes away left open is released
        # (over tcp every client of this host is one, kept by the prober's connection).
        "control": {
            "orphan_grace_ms": int(ORPHAN_GRACE_S * 1000),
            "endpoint": f"ipc://{control_dir}/control",
        },
        "service": {"log_level": "warning", "rank_processes": rank_processes},
    }
    daemon: DaemonProcess = start_with_free_ports(overrides)
    host_medium = "CPU" if host_blocks else None  # cache.host_medium's default
    ctx = multiprocessing.get_context("spawn")
    spec = LoadSpec(
        "soak",
        control_endpoint=daemon.control_endpoint,
        replay_endpoint=daemon.replay_endpoint,
        events_endpoint=daemon.events_endpoint,
        metrics_port=int(daemon.settings["metrics"]["port"]),
        flood_processes=1,
    )
    control = LoadControl.shared(ctx)
    loads = [ctx.Process(**tied(LOADS[name], (control, spec)), daemon=True) for name in names]
    endpoints = {
        "events": daemon.events_endpoint,
        "replay": daemon.replay_endpoint,
        "control": daemon.control_endpoint,
        "snapshot": daemon.snapshot_endpoint,
    }
    pipes = [ctx.Pipe() for _ in FOLLOWERS]
    commands = [ours for ours, _ in pipes]
    followers = [
        ctx.Process(**tied(_follow, (endpoints, theirs, how, host_medium)), daemon=True)
        for (_, theirs), how in zip(pipes, FOLLOWERS, strict=True)
    ]
    probe = ResetProbe(daemon)
    rng = random.Random(seed)
    markers: list[int] = []
    lost = 0
    divergences: list[str] = []
    checkpoints = 0
    answer_s: dict[str, float] = {}  # each follower's slowest checkpoint answer
    sighups = 0
    report: dict[str, Any] = {"loads_run": names}
    try:
        probe.wait_connected()
        with ctrl_c_kept_from_children():  # Ctrl-C is the soak's to handle: it stops them
            for follower in followers:
                follower.start()
            for process in loads:
                process.start()
        control.go.set()
        started = time.monotonic()
        next_checkpoint = started + CHECKPOINT_EVERY_S
        while (now := time.monotonic()) < started + duration_s:
            if now >= next_checkpoint:
                checkpoints += 1
                divergences += _checkpoint(control, probe, commands, followers, answer_s)
                next_checkpoint = time.monotonic() + CHECKPOINT_EVERY_S
            time.sleep(rng.uniform(0.05, 0.25))
            if reloads and rng.random() < 0.05 and daemon.proc is not None:
                os.kill(daemon.proc.pid, signal.SIGHUP)
                sighups += 1
            fields = {"rank": 0} if rng.random() < 0.5 else {}
            probe.drain_sub(0)
            marker, _reply, _ = probe.try_reset(RESET_TIMEOUT_S, **fields)
            if marker is None:
                lost += 1
            else:
                markers.append(marker)
            if progress is not None:
                progress(f"soak: {len(markers)} resets, {now - started:.0f}/{duration_s:.0f} s")
        checkpoints += 1
        divergences += _checkpoint(control, probe, commands, followers, answer_s)
    finally:
        # A second Ctrl-C must not cut this short: the daemon would be left behind.
        with interrupts_ignored():
            _stop_all(control, loads, followers, commands, probe, daemon, report)
    report.update(
        {
            "duration_s": duration_s,
            "resets": summary(markers),
            "resets_lost": lost,
            "reloads": sighups,
            "checkpoints": checkpoints,
            "checkpoint_answer_s_max": {k: round(v, 2) for k, v in answer_s.items()},
            "divergences": divergences,
        }
    )
    # A load that failed did not load the daemon as meant (a request it got wrong, say).
    report["load_failures"] = sum(int(r.get("failures") or 0) for r in report["loads"])
    report["ok"] = (
        not divergences
        and not lost
        and not report["load_failures"]
        and not report["daemon_log"]["errors"]  # a bug logged (a task destroyed pending, say)
        and not report["pins_left"]
        and bool(report["daemon"].get("alive_at_end"))
    )
    return report


def _stop_all(
    control: LoadControl,
    loads: list[Any],
    followers: list[Any],
    commands: list[Any],
    probe: Any,
    daemon: DaemonProcess,
    report: dict[str, Any],
) -> None:
    """Stop the loads and followers that were started, read what is left pinned, and stop
    the daemon, whatever failed before (an interrupt before the loads started, a daemon the
    terminal's Ctrl-C stopped too)."""
    try:
        control.stop.set()
        control.go.set()
        started = [process for process in loads if process.pid is not None]
        results = []
        for _ in started:
            try:
                results.append(control.results.get(timeout=10))
            except Exception:
                break
        for process in started:
            process.join(10)
            if process.is_alive():
                process.kill()
        for follower, command in zip(followers, commands, strict=True):
            if follower.is_alive():
                command.send("stop")
                if command.poll(10):
                    command.recv()
                follower.join(10)
                if follower.is_alive():
                    follower.kill()
        report["loads"] = results
        try:
            report["pins_left"] = _pins_left(probe) if daemon.alive() else {"daemon": "gone"}
        except (ControlError, TimeoutError, OSError) as exc:
            report["pins_left"] = {"daemon": f"no answer: {exc}"}
        probe.close()
    finally:
        # At log level warning: what went wrong, in the daemon's words.
        warnings = daemon.log().splitlines()
        errors = sum(" ERROR " in line or " CRITICAL " in line for line in warnings)
        report["daemon_log"] = {"lines": len(warnings), "errors": errors, "last": warnings[-20:]}
        report["daemon"] = stop_and_report(daemon)
        report.setdefault("loads", [])
        report.setdefault("pins_left", {})


def _pins_left(probe: Any) -> dict[str, str]:
    """Once every load is gone: what is still open or pinned on each rank (after the orphan
    grace, nothing should be: every load's connection is closed, so the daemon releases what
    it left open). Empty when nothing is; the last counts after PINS_DEADLINE_S else."""
    deadline = time.monotonic() + ORPHAN_GRACE_S + PINS_DEADLINE_S
    while True:
        ranks = probe.client.stats().ranks
        left = {
            f"rank {r.rank}": f"{r.requests_open} requests open, {r.blocks_pinned} blocks pinned"
            for r in ranks
            if r.requests_open or r.blocks_pinned
        }
        if not left or time.monotonic() > deadline:
            return left
        probe.drain_sub(0.05)


def _checkpoint(
    control: LoadControl,
    probe: Any,
    commands: list[Any],
    followers: list[Any],
    answer_s: dict[str, float],
) -> list[str]:
    """Loads hold still (what is in flight finishes), the daemon publishes what it captured,
    then each follower compares its mirrors with the snapshots; ``answer_s`` keeps each
    follower's slowest answer (seconds from the check sent)."""
    control.go.clear()
    found = _compare(probe, commands, followers, answer_s)
    control.go.set()  # on an error, run_soak's cleanup stops the loads
    return found


def _compare(
    probe: Any, commands: list[Any], followers: list[Any], answer_s: dict[str, float]
) -> list[str]:
    """Each follower's mirrors against the snapshots, once the daemon published what it
    captured; ``answer_s`` keeps each follower's slowest answer (seconds from the check
    sent). A follower that died (its subscriber refused what it got, say) is named at once,
    not waited for."""
    time.sleep(1.0)  # in-flight operations of the loads finish (a tool, not a test)
    deadline = time.monotonic() + 60
    while any(r.events_pending for r in probe.client.stats().ranks):
        if time.monotonic() > deadline:
            return ["the daemon never published what it captured"]
        probe.drain_sub(0.01)
    for command in commands:
        command.send("check")
    sent = time.monotonic()
    found: list[str] = []
    # Answers as they come: a slow follower is named as such, not the one read after it.
    waiting = dict(zip(commands, FOLLOWERS, strict=True))
    sentinels = dict(zip(commands, (f.sentinel for f in followers), strict=True))
    while waiting and (left := sent + 180 - time.monotonic()) > 0:
        ready = multiprocessing.connection.wait([*waiting, *sentinels.values()], left)
        for command in [c for c in waiting if c in ready]:
            how = waiting.pop(command)
            answer_s[how] = max(answer_s.get(how, 0.0), time.monotonic() - sent)
            found += command.recv()["divergences"]
        for command in [c for c in waiting if sentinels[c] in ready]:
            found.append(f"the {waiting.pop(command)} follower died (see its stderr)")
    found += [f"the {how} follower did not answer a checkpoint" for how in waiting.values()]
    return found


def bench_soak(
    duration: Annotated[float, typer.Option(help="seconds of load", min=5)] = 60.0,
    seed: Annotated[int, typer.Option(help="seed of the prober's choices")] = 0,
    load: Annotated[
        list[str] | None,
        typer.Option(help="run only this load (repeat for several); default: every load"),
    ] = None,
    reloads: Annotated[bool, typer.Option(help="send SIGHUP now and then")] = True,
    rank_processes: Annotated[
        RankProcessesMode, typer.Option(help="the daemon's service.rank_processes")
    ] = "auto",
    host_blocks: Annotated[
        int, typer.Option(help="the daemon's cache.host_blocks: a host tier per rank", min=0)
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Every load at once (large, cached and small stores, checksums, snapshots, a replay
    flood, dying clients, reloads) while resets are timed and a follower's mirrors are
    checked against snapshots; exit 1 on a divergence, a lost reset, a load's request
    refused or unanswered, an error the daemon logged, blocks left pinned once every load is
    gone, or a dead daemon."""
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("soak", total=None)
        try:
            report = run_soak(
                duration,
                seed,
                lambda text: progress.update(task, description=text),
                loads_run=load or None,
                reloads=reloads,
                rank_processes=rank_processes,
                host_blocks=host_blocks,
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
            f"request(s) failed; {report['daemon_log']['errors']} error(s) logged; "
            f"daemon alive: {report['daemon'].get('alive_at_end')}"
        )
        for line in report["divergences"]:
            print(f"  divergence: {line}")
        for rank, left in report["pins_left"].items():
            print(f"  left pinned once every load was gone: {rank}: {left}")
        for ran in report["loads"]:
            for failure in ran.get("first_failures") or []:
                print(f"  {ran['load']}: {failure}")
        if report["daemon_log"]["errors"]:
            print(*(f"  log: {line}" for line in report["daemon_log"]["last"]), sep="\n")
    if not report["ok"]:
        raise typer.Exit(1)
