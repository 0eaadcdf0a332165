"""The loads of ``kvpubd bench soak``, each run in a process of its own (bench_load's
machinery: a load works while ``go`` is set and ends on ``stop``): large stores, the same large
prompt stored again (a prefix-cache hit), pipelined small stores, an engine's batches of stores
and releases, checksums of the whole pool, snapshots, a replay flood, a flood of small ops
pipelined deep, and clients that go away or die holding stores."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from typing import Any

import numpy as np
import zmq

from kvpubd.tools.bench_load import LoadControl, LoadSpec, request_loop, rounds, send_request

BLOCK_SIZE = 16
NUM_BLOCKS = 40_000  # per rank
BIG_STORE_BLOCKS = 12_500  # 200k tokens: sliced over many loop turns
SMALL_STORES = 200  # pipelined per round
BATCH_STORES = 16  # stores per batch (a scheduler step's new prompts), 16 blocks each
BATCHES_IN_FLIGHT = 4  # batches pipelined per round
PRIORITY_FLOOD_DEPTH = 64  # stats and pings pipelined per round
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

    request_loop(
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

    request_loop(
        control,
        spec.control_endpoint,
        requests,
        "cached-stores",
        reply_timeout=60,
        tolerated=CLOSED,
    )


def small_stores(control: LoadControl, spec: LoadSpec) -> None:
    """Rounds of SMALL_STORES one-block stores sent back to back, then their releases."""
    rng = np.random.default_rng(3)

    def requests(n: int) -> list[dict[str, Any]]:
        ids = [f"small-{n}-{i}" for i in range(SMALL_STORES)]
        stores = [
            {"op": "store", "rank": 0, "request_id": rid, "token_ids": _tokens(rng, 1)}
            for rid in ids
        ]
        return [*stores, *({"op": "release", "request_id": rid} for rid in ids)]

    request_loop(
        control,
        spec.control_endpoint,
        requests,
        "small-stores",
        reply_timeout=60,
        tolerated=CLOSED,
        pipelined=True,
    )


def batched_stores(control: LoadControl, spec: LoadSpec) -> None:
    """What an engine sends at each scheduler step: a ``batch`` of BATCH_STORES new prompts'
    stores and the releases of the previous step's, pipelined BATCHES_IN_FLIGHT deep."""
    rng = np.random.default_rng(6)
    shared = _tokens(rng, 4)  # a common prefix: some blocks cached, some new

    def requests(n: int) -> list[dict[str, Any]]:
        steps = []
        for step in range(BATCHES_IN_FLIGHT):
            ids = [f"step-{n}-{step}-{i}" for i in range(BATCH_STORES)]
            stores = [
                {"op": "store", "request_id": rid, "token_ids": shared + _tokens(rng, 12)}
                for rid in ids
            ]
            releases = [{"op": "release", "request_id": rid} for rid in previous]
            steps.append({"op": "batch", "rank": 0, "requests": [*stores, *releases]})
            previous[:] = ids
        return steps

    previous: list[str] = []
    request_loop(
        control,
        spec.control_endpoint,
        requests,
        "batched-stores",
        reply_timeout=60,
        tolerated=CLOSED,
        pipelined=True,
    )


def priority_flood(control: LoadControl, spec: LoadSpec) -> None:
    """A client pipelining small ops that go on a worker's priority connection (``stats``,
    ``ping``), far deeper than it takes at once: the rest wait in the client's lane."""
    request_loop(
        control,
        spec.control_endpoint,
        lambda n: [{"op": "stats" if i % 2 else "ping"} for i in range(PRIORITY_FLOOD_DEPTH)],
        "priority-flood",
        reply_timeout=60,
        pipelined=True,
    )


def checksums(control: LoadControl, spec: LoadSpec) -> None:
    ids = list(range(NUM_BLOCKS))
    request_loop(
        control,
        spec.control_endpoint,
        lambda n: [{"op": "checksum", "rank": LOAD_RANK, "block_ids": ids}],
        "checksums",
        reply_timeout=60,
    )


def snapshots(control: LoadControl, spec: LoadSpec) -> None:
    request_loop(
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
        for n in rounds(control):
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
    vanished = failures = 0
    control.set_ready()
    try:
        for n in rounds(control):
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
                send_request(sock, store)
            answered = sum(1 for _ in range(2) if sock.poll(30_000) and sock.recv_multipart())
            failures += answered < 2
            sock.close()  # gone, holding both
            with control.ops.get_lock():
                control.ops.value += 1
            vanished += 1
            time.sleep(ORPHAN_GRACE_S + rng.uniform(0.1, 0.4))
    finally:
        ctx.term()
        control.results.put({"load": "vanishing-clients", "rounds": vanished, "failures": failures})


LOADS = {
    "big-stores": big_stores,
    "cached-stores": cached_stores,
    "small-stores": small_stores,
    "batched-stores": batched_stores,
    "checksums": checksums,
    "snapshots": snapshots,
    "replay-flood": replay_flood,
    "priority-flood": priority_flood,
    "vanishing-clients": vanishing_clients,
    "dying-clients": dying_clients,
}
# Run unless --load names it: a process spawned per death stalls the host (see dying_clients).
OPT_IN = ("dying-clients",)
