"""``kvpubd bench soak``: every load at once against one daemon, for a set time, while a prober
times each reset -> marker and a follower process mirrors every rank from the stream alone.

The loads run in processes of their own (bench_load's machinery): large stores, the same large
prompt stored again (a prefix-cache hit), pipelined small stores, checksums of the whole pool,
snapshots, a replay flood, and clients that die holding stores. The prober resets rank 0 or
every rank (forced) a few times a second and sends SIGHUP now and then. At checkpoints the
loads hold still and the follower's mirror of each rank must equal the daemon's snapshot.

Reported: reset -> marker p50/p99/max, resets that never published, divergences, whether the
daemon lived. The exit status is 1 on a divergence, a lost reset or a dead daemon; latency is
reported, not judged (it depends on the machine)."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any, cast

import numpy as np
import zmq

from kvpubd.tools.bench_load import POLL_MS, LoadControl, LoadSpec, _request_loop, raise_fd_limit
from kvpubd.tools.launcher import DaemonProcess

RANKS = 2
BLOCK_SIZE = 16
NUM_BLOCKS = 40_000  # per rank
BIG_STORE_BLOCKS = 12_500  # 200k tokens: sliced over many loop turns
SMALL_STORES = 200  # pipelined per round
RESET_TIMEOUT_S = 30.0
CHECKPOINT_EVERY_S = 10.0
ORPHAN_GRACE_S = 0.5  # the soak daemon's control.orphan_grace_ms

# The load rank carries the loads' caches; the prober resets rank 0 alone or every rank.
LOAD_RANK = 1
# The prober's resets are forced: they close open requests, whose release then finds nothing.
CLOSED = frozenset({"unknown_request"})


def _tokens(rng: np.random.Generator, blocks: int) -> bytes:
    return rng.integers(1, 1 << 31, size=blocks * BLOCK_SIZE, dtype="<u4").tobytes()


def big_stores(control: LoadControl, spec: LoadSpec) -> None:
    rng = np.random.default_rng(1)

    def requests(n: int) -> list[dict[str, Any]]:
        tokens = _tokens(rng, BIG_STORE_BLOCKS)
        rid = f"big-{n}"
        return [
            {"op": "store", "rank": LOAD_RANK, "request_id": rid, "token_ids": tokens},
            {"op": "release", "request_id": rid},
        ]

    _request_loop(
        control, spec.control_endpoint, requests, "big-stores", reply_timeout=60, tolerated=CLOSED
    )


def cached_stores(control: LoadControl, spec: LoadSpec) -> None:
    """The same large prompt again and again: after the first, a prefix-cache hit."""
    tokens = _tokens(np.random.default_rng(2), BIG_STORE_BLOCKS)

    def requests(n: int) -> list[dict[str, Any]]:
        rid = f"cached-{n}"
        return [
            {"op": "store", "rank": LOAD_RANK, "request_id": rid, "token_ids": tokens},
            {"op": "release", "request_id": rid},
        ]

    _request_loop(
        control,
        spec.control_endpoint,
        requests,
        "cached-stores",
        reply_timeout=60,
        tolerated=CLOSED,
    )


def small_stores(control: LoadControl, spec: LoadSpec) -> None:
    """Rounds of SMALL_STORES one-block stores sent back to back, then their releases."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec.control_endpoint)
    rng = np.random.default_rng(3)
    rounds = failures = 0
    control.set_ready()
    try:
        for n in itertools.count():
            if not control.go.wait(POLL_MS / 1000):
                if control.stop.is_set():
                    return
                continue
            if control.stop.is_set():
                return
            ids = [f"small-{n}-{i}" for i in range(SMALL_STORES)]
            for rid in ids:
                store = {"op": "store", "rank": 0, "request_id": rid, "token_ids": _tokens(rng, 1)}
                sock.send_multipart([b"", _pack(store)])
            for rid in ids:
                sock.send_multipart([b"", _pack({"op": "release", "request_id": rid})])
            with control.ops.get_lock():
                control.ops.value += 1
            answered = 0
            deadline = time.monotonic() + 60
            while answered < 2 * len(ids) and time.monotonic() < deadline:
                if control.stop.is_set():
                    return
                if sock.poll(POLL_MS):
                    sock.recv_multipart()
                    answered += 1
            failures += answered < 2 * len(ids)
            rounds += 1
    finally:
        sock.close()
        ctx.term()
        control.results.put({"load": "small-stores", "rounds": rounds, "failures": failures})


def checksums(control: LoadControl, spec: LoadSpec) -> None:
    ids = list(range(NUM_BLOCKS))
    _request_loop(
        control,
        spec.control_endpoint,
        lambda n: [{"op": "checksum", "rank": LOAD_RANK, "block_ids": ids}],
        "checksums",
        reply_timeout=60,
    )


def snapshots(control: LoadControl, spec: LoadSpec) -> None:
    _request_loop(
        control,
        spec.control_endpoint,
        lambda n: [{"op": "snapshot", "rank": LOAD_RANK}],
        "snapshots",
        reply_timeout=60,
    )


def replay_flood(control: LoadControl, spec: LoadSpec) -> None:
    from kvpubd.tools.bench_load import replay_flood_load

    replay_flood_load(control, spec)


# A client that stores and holds until it is killed.
_HOLDER = """
import sys
from kvpubd.client import ControlClient
client = ControlClient(sys.argv[1], timeout=30)
client.store(sys.argv[2], list(range(int(sys.argv[3]), int(sys.argv[3]) + 64)), rank=0)
print("held", flush=True)
sys.stdin.read()
"""


def dying_clients(control: LoadControl, spec: LoadSpec) -> None:
    """Clients that store on rank 0 and are killed (SIGKILL) holding the store: a process
    spawned per death. On the H200 VM spawning alone lifts an idle daemon's reset p99 from
    1.3 to 9-11 ms, so this load runs only when named."""
    rng = random.Random(4)
    killed = 0
    control.set_ready()
    try:
        for n in itertools.count():
            if control.stop.is_set():
                return
            if not control.go.wait(POLL_MS / 1000):
                continue
            child = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, spec.control_endpoint, f"dies-{n}", str(n * 64)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert child.stdout is not None
            child.stdout.readline()
            with control.ops.get_lock():
                control.ops.value += 1
            time.sleep(rng.uniform(0, 0.3))
            child.kill()
            child.wait()
            killed += 1
    finally:
        control.results.put({"load": "dying-clients", "killed": killed})


def vanishing_clients(control: LoadControl, spec: LoadSpec) -> None:
    """Clients that store on rank 0 and go away without releasing: each round a fresh
    connection stores two prompts and is closed at once, then this process stays away longer
    than the daemon's orphan grace, so the daemon releases them (what a client that dies
    leaves behind, without spawning a process per death: process creation alone stalls this
    host's other processes for milliseconds)."""
    rng = random.Random(5)
    ctx = zmq.Context()
    rounds = failures = 0
    control.set_ready()
    try:
        for n in itertools.count():
            if control.stop.is_set():
                return
            if not control.go.wait(POLL_MS / 1000):
                continue
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(spec.control_endpoint)
            for i in range(2):
                store = {
                    "id": i,
                    "op": "store",
                    "rank": 0,
                    "request_id": f"vanish-{n}-{i}",
                    "token_ids": _tokens(np.random.default_rng((n, i)), 4),
                }
                sock.send_multipart([b"", _pack(store)])
            answered = sum(1 for _ in range(2) if sock.poll(30_000) and sock.recv_multipart())
            failures += answered < 2
            sock.close()  # gone, holding both
            with control.ops.get_lock():
                control.ops.value += 1
            rounds += 1
            time.sleep(ORPHAN_GRACE_S + rng.uniform(0.1, 0.4))
    finally:
        ctx.term()
        control.results.put({"load": "vanishing-clients", "rounds": rounds, "failures": failures})


def _pack(request: dict[str, Any]) -> bytes:
    import msgpack

    return cast(bytes, msgpack.packb(request, use_bin_type=True))


LOADS = {
    "big-stores": big_stores,
    "cached-stores": cached_stores,
    "small-stores": small_stores,
    "checksums": checksums,
    "snapshots": snapshots,
    "replay-flood": replay_flood,
    "vanishing-clients": vanishing_clients,
    "dying-clients": dying_clients,
}
# Run unless --load names it: a process spawned per death stalls the host (see dying_clients).
OPT_IN = ("dying-clients",)


def _follow(endpoints: dict[str, str], conn: Any) -> None:
    """The follower process: a Subscriber mirroring every rank (replay and snapshot repair);
    on "check" it compares each mirror with the daemon's snapshot at the same seq."""
    from kvpubd.client import ControlClient, Subscriber

    with (
        Subscriber(
            endpoints["events"],
            endpoints["replay"],
            control=endpoints["control"],
            ranks=RANKS,
            control_timeout=60,
            replay_timeout=30,
        ) as sub,
        ControlClient(endpoints["control"], timeout=60) as client,
    ):
        while True:
            if conn.poll(0):
                if conn.recv() == "stop":
                    conn.send({})
                    return
                conn.send(
                    {"divergences": [d for r in range(RANKS) for d in _check(sub, client, r)]}
                )
            with contextlib.suppress(TimeoutError):
                sub.receive(0.05)


def _check(sub: Any, client: Any, rank: int, attempts: int = 60) -> list[str]:
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
        expected = Mirror()
        expected.apply(snap.events)
        mirror = sub.mirror(rank)
        have = set() if mirror is None else set(mirror.blocks)
        want = set(expected.blocks)
        if have == want:
            return []
        problem = (
            f"rank {rank} at seq {snap.seq} (mirror at {sub.last_seq(rank)}): "
            f"{len(want - have)} blocks missing, {len(have - want)} extra"
        )
        time.sleep(0.5)
    return [problem]


def run_soak(
    duration_s: float,
    seed: int = 0,
    progress: Any = None,
    loads_run: list[str] | None = None,
    reloads: bool = True,
) -> dict[str, Any]:
    """The soak with ``loads_run`` (default: all of LOADS), SIGHUPs now and then if
    ``reloads``."""
    names = [name for name in LOADS if name not in OPT_IN] if loads_run is None else loads_run
    unknown = [name for name in names if name not in LOADS]
    if unknown:
        raise ValueError(f"unknown load(s) {', '.join(unknown)}; known: {', '.join(LOADS)}")
    from kvpubd.tools.bench import ResetProbe, _start_with_free_ports, _stop_and_report, summary
    from kvpubd.tools.bench_load import LoadControl as Control
    from kvpubd.tools.launcher import free_tcp_ports

    raise_fd_limit(4096)
    overrides: dict[str, dict[str, Any]] = {
        "cache": {
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "uint8",
            "num_blocks": NUM_BLOCKS,
            "data_parallel_size": RANKS,
        },
        "events": {"buffer_steps": 1000},
        "control": {"orphan_grace_ms": int(ORPHAN_GRACE_S * 1000)},
        "service": {"log_level": "warning"},
    }
    daemon: DaemonProcess = _start_with_free_ports(overrides, free_tcp_ports)
    ctx = multiprocessing.get_context("spawn")
    spec = LoadSpec(
        "soak",
        control_endpoint=daemon.control_endpoint,
        replay_endpoint=daemon.replay_endpoint,
        events_endpoint=daemon.events_endpoint,
        metrics_port=int(daemon.settings["metrics"]["port"]),
        flood_processes=1,
    )
    control = Control(ctx.Event(), ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0), ctx.Queue())
    loads = [ctx.Process(target=LOADS[name], args=(control, spec), daemon=True) for name in names]
    commands, follower_end = ctx.Pipe()
    endpoints = {
        "events": daemon.events_endpoint,
        "replay": daemon.replay_endpoint,
        "control": daemon.control_endpoint,
    }
    follower = ctx.Process(target=_follow, args=(endpoints, follower_end), daemon=True)
    probe = ResetProbe(daemon)
    rng = random.Random(seed)
    markers: list[int] = []
    lost = 0
    divergences: list[str] = []
    checkpoints = 0
    sighups = 0
    report: dict[str, Any] = {"loads_run": names}
    try:
        probe.wait_connected()
        follower.start()
        for process in loads:
            process.start()
        control.go.set()
        started = time.monotonic()
        next_checkpoint = started + CHECKPOINT_EVERY_S
        while (now := time.monotonic()) < started + duration_s:
            if now >= next_checkpoint:
                checkpoints += 1
                divergences += _checkpoint(control, probe, commands)
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
        divergences += _checkpoint(control, probe, commands)
    finally:
        control.stop.set()
        control.go.set()
        results = []
        for _ in loads:
            try:
                results.append(control.results.get(timeout=10))
            except Exception:
                break
        for process in [*loads]:
            process.join(10)
            if process.is_alive():
                process.kill()
        if follower.is_alive():
            commands.send("stop")
            if commands.poll(10):
                commands.recv()
            follower.join(10)
            if follower.is_alive():
                follower.kill()
        probe.close()
        report["daemon"] = _stop_and_report(daemon)
        report["loads"] = results
    report.update(
        {
            "duration_s": duration_s,
            "resets": summary(markers),
            "resets_lost": lost,
            "reloads": sighups,
            "checkpoints": checkpoints,
            "divergences": divergences,
        }
    )
    # A load that failed did not load the daemon as meant (a request it got wrong, say).
    report["load_failures"] = sum(int(r.get("failures") or 0) for r in report["loads"])
    report["ok"] = (
        not divergences
        and not lost
        and not report["load_failures"]
        and bool(report["daemon"].get("alive_at_end"))
    )
    return report


def _checkpoint(control: LoadControl, probe: Any, commands: Any) -> list[str]:
    """Loads hold still (what is in flight finishes), the daemon publishes what it captured,
    then the follower compares its mirrors with the snapshots."""
    control.go.clear()
    try:
        time.sleep(1.0)  # in-flight operations of the loads finish (a tool, not a test)
        deadline = time.monotonic() + 60
        while any(r.events_pending for r in probe.client.stats().ranks):
            if time.monotonic() > deadline:
                return ["the daemon never published what it captured"]
            probe.drain_sub(0.01)
        commands.send("check")
        if not commands.poll(180):
            return ["the follower did not answer a checkpoint"]
        return list(commands.recv()["divergences"])
    finally:
        control.go.set()
