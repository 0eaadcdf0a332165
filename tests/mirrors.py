"""Helpers for tests of ``kvpubd.client.subscriber``: both subscriber forms behind one blocking
interface, a recorder for the callbacks, a load generator thread, and the check that a
subscriber's mirror is exactly the daemon's ``snapshot``. Every wait polls with a deadline."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from kvpubd.client import ControlClient, ControlError, Mirror, Received, SnapshotReply, StoreReply
from kvpubd.client.subscriber import AsyncSubscriber, Subscriber
from kvpubd.protocol.wire import AllBlocksCleared, BlockHash, BlockStored
from tests.daemon import Daemon

BLOCK_SIZE = 16
FORMS = ["sync", "async"]


class AsyncDriven:
    """A real ``AsyncSubscriber`` run on a private event loop, driven through the same blocking
    calls as ``Subscriber``, so one test body exercises both forms."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()

        async def make() -> AsyncSubscriber:
            return AsyncSubscriber(*args, **kwargs)

        self.sub = self.loop.run_until_complete(make())

    def receive(self, timeout: float) -> list[Received]:
        return self.loop.run_until_complete(self.sub.receive(timeout))

    def catch_up(self) -> list[Received]:
        return self.loop.run_until_complete(self.sub.catch_up())

    def close(self) -> None:
        self.sub.close()
        self.loop.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sub, name)


AnySubscriber = Subscriber | AsyncDriven


class Record:
    """What the callbacks reported, per rank."""

    def __init__(self) -> None:
        self.batches: dict[int, list[Received]] = defaultdict(list)
        self.gaps: list[tuple[int, int, int]] = []
        self.resyncs: list[tuple[int, int]] = []
        self.restarts: list[tuple[int, str]] = []

    def callbacks(self) -> dict[str, Any]:
        return {
            "on_batch": lambda r: self.batches[r.rank].append(r),
            "on_gap": lambda rank, first, seq: self.gaps.append((rank, first, seq)),
            "on_resync": lambda rank, seq: self.resyncs.append((rank, seq)),
            "on_restart": lambda rank, reason: self.restarts.append((rank, reason)),
        }

    def seqs(self, rank: int = 0) -> list[int]:
        return [b.seq for b in self.batches[rank]]

    def run_seqs(self, rank: int = 0, last: int | None = None) -> list[int]:
        """Every seq of the run from its first batch, the start-up marker (a run's seqs start
        at its origin, not at 0), to ``last`` (default: the last one delivered)."""
        batches = self.batches[rank]
        assert batches and isinstance(batches[0].batch.events[0], AllBlocksCleared)
        return list(range(batches[0].seq, (batches[-1].seq if last is None else last) + 1))


def subscriber(
    form: str, daemon: Daemon, record: Record | None = None, **kwargs: Any
) -> AnySubscriber:
    """A subscriber of ``form`` ("sync"/"async") on ``daemon``, with control unless
    ``control=None`` is passed."""
    kwargs.setdefault("ranks", daemon.ranks)
    kwargs.setdefault("control", daemon.control_endpoint)
    kwargs.setdefault("replay_timeout", 2.0)
    kwargs.setdefault("control_timeout", 2.0)
    if record is not None:
        kwargs.update(record.callbacks())
    args = (daemon.events_endpoint, daemon.replay_endpoint)
    if form == "async":
        return AsyncDriven(*args, **kwargs)
    return Subscriber(*args, **kwargs)


_first_tokens = itertools.count(1_000_000)


def unique_prompt(blocks: int) -> list[int]:
    """Tokens of ``blocks`` full blocks whose hashes no other call's share (in this process):
    the first token differs, and every block hash chains from the first block."""
    return [next(_first_tokens), *range(1, blocks * BLOCK_SIZE)]


_ids = itertools.count()


def store_released(client: ControlClient, tokens: list[int], rank: int | None = None) -> StoreReply:
    request_id = f"r{next(_ids)}"
    reply = client.store(request_id, tokens, rank=rank)
    client.release(request_id)
    return reply


def go_live(sub: AnySubscriber, client: ControlClient, ranks: list[int]) -> None:
    """Catch up, then store fresh one-block prompts on each rank until a batch arrives live
    there: from then on that rank's SUB socket is subscribed."""
    sub.catch_up()
    for rank in ranks:
        deadline = time.monotonic() + 10.0
        while True:
            assert time.monotonic() < deadline, f"rank {rank}: nothing arrived live"
            store_released(client, unique_prompt(1), rank)
            if any(b.rank == rank and not b.replayed for b in sub.receive(0.1)):
                break


# Every block a mirror holds, keyed by (group_idx, hash): group_idx None for the events
# without one (a cache of one implicit group). A hybrid cache's groups share their hashes.
GroupedBlocks = dict[tuple[int | None, BlockHash], BlockStored]


def snapshot_mirror(reply: SnapshotReply) -> Mirror:
    mirror = Mirror()
    mirror.apply(reply.events)
    return mirror


def snapshot_blocks(reply: SnapshotReply) -> dict[BlockHash, BlockStored]:
    """A snapshot's blocks by hash, of a cache without groups (see ``grouped_blocks``)."""
    mirror = snapshot_mirror(reply)
    assert not mirror.group_blocks, "a hybrid cache's snapshot: key it by group (grouped_blocks)"
    return mirror.blocks


def grouped_blocks(mirror: Mirror) -> GroupedBlocks:
    """The mirror's pool blocks, every group's, keyed by (group_idx, hash)."""
    keyed: GroupedBlocks = {(None, h): block for h, block in mirror.blocks.items()}
    for group_idx, blocks in mirror.group_blocks.items():
        keyed.update(((group_idx, h), block) for h, block in blocks.items())
    return keyed


def group_sizes(keys: Iterable[tuple[int | None, BlockHash]]) -> dict[int | None, int]:
    """How many blocks each group holds."""
    sizes: dict[int | None, int] = defaultdict(int)
    for group_idx, _ in keys:
        sizes[group_idx] += 1
    return dict(sizes)


def difference(held: GroupedBlocks, expected: GroupedBlocks) -> str:
    """What a mirror's blocks lack and have beyond the expected ones, per group."""
    return (
        f"mirror has {group_sizes(held)} blocks per group, snapshot {group_sizes(expected)}; "
        f"missing {group_sizes(expected.keys() - held.keys())}, "
        f"extra {group_sizes(held.keys() - expected.keys())}"
    )


def settle(sub: AnySubscriber, client: ControlClient, rank: int) -> SnapshotReply:
    """Take the rank's snapshot (nothing else may be publishing) and bring the subscriber up
    to its seq through replay; returns the snapshot."""
    snap = client.snapshot(rank)
    deadline = time.monotonic() + 10.0
    while (-1 if (seq := sub.last_seq(rank)) is None else seq) < snap.seq:
        assert time.monotonic() < deadline, f"rank {rank}: never reached seq {snap.seq}"
        sub.catch_up()
    return snap


def pump(
    sub: AnySubscriber, until: Callable[[], bool], timeout: float = 20.0, what: str = "it"
) -> int:
    """Receive until ``until()``; a replay or control call that times out (a daemon that is
    down) is retried by the next receive. Returns how many calls timed out."""
    timeouts = 0
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        try:
            sub.receive(0.05)
        except TimeoutError:
            timeouts += 1
    return timeouts


def assert_mirror_is_snapshot(sub: AnySubscriber, client: ControlClient, ranks: list[int]) -> None:
    """Every followed rank's mirror is exactly the daemon's snapshot at the same seq, group by
    group on a hybrid cache."""
    for rank in ranks:
        snap = settle(sub, client, rank)
        assert sub.last_seq(rank) == snap.seq
        assert sub.synced(rank)
        mirror = sub.mirror(rank)
        assert mirror is not None
        held, expected = grouped_blocks(mirror), grouped_blocks(snapshot_mirror(snap))
        assert held == expected, f"rank {rank}: {difference(held, expected)}"


class Loader(threading.Thread):
    """Stores (and releases) unique prompts on ``ranks`` in a loop through its own control
    client until stopped; keeps the token lists of every store the daemon acknowledged. Errors
    and timeouts (a daemon being killed) are counted and the loop goes on."""

    def __init__(
        self, control_endpoint: str, ranks: list[int], blocks: int = 4, timeout: float = 0.5
    ) -> None:
        super().__init__(daemon=True)
        self.endpoint = control_endpoint
        self.ranks = ranks
        self.blocks = blocks
        self.timeout = timeout
        self.acked: list[tuple[int, list[int]]] = []
        self.failures = 0
        self.stop_when_failing = False
        self._halt = threading.Event()
        self._ids = itertools.count()

    def run(self) -> None:
        with ControlClient(self.endpoint, timeout=self.timeout) as client:
            for n in itertools.count():
                if self._halt.is_set():
                    return
                rank = self.ranks[n % len(self.ranks)]
                tokens = unique_prompt(self.blocks)
                request_id = f"load-{n}"
                try:
                    client.store(request_id, tokens, rank=rank)
                except (TimeoutError, ControlError):
                    self.failures += 1
                    if self.stop_when_failing:
                        return
                    continue
                self.acked.append((rank, tokens))
                try:
                    client.release(request_id)
                except (TimeoutError, ControlError):
                    self.failures += 1

    def stop(self) -> None:
        self._halt.set()
        if self.ident is None:  # never started
            return
        self.join(timeout=10.0)
        assert not self.is_alive(), "the load generator did not stop"
