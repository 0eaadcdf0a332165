"""Upstream mode in this process: the loop keeps turning while the daemon works through a burst
of the engine's batches, so a reset never waits behind all of them (the follower hands over up
to a burst of batches with no turn of its own)."""

from __future__ import annotations

import itertools
import time
from functools import partial
from pathlib import Path

import msgspec
import pytest
import zmq

from kvpubd.daemon.pipeline import TURN_EVENTS
from kvpubd.protocol.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    decode_batch,
    pack_seq,
)
from tests.inprocess import BOUND_S, InProcess, in_process

# (batches, events per batch): a burst of batches as a saturated vLLM sends them (one-block
# removals, as it reports evictions), and a few batches of thousands of evictions each.
BURSTS = [(200, 64), (3, 2000)]


class Engine:
    """A PUB socket publishing vLLM's wire (live frames [topic, seq, payload], map form)."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pub.bind(endpoint)
        self._seq = itertools.count()

    def publish(self, events: list[Event]) -> None:
        payload = msgspec.msgpack.encode(EventBatch(time.time(), events, 0))
        self.pub.send_multipart([b"", pack_seq(next(self._seq)), payload])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.context.term()


def store(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, [1, 2], 2, None, "GPU", None)


def relayed_or_past(daemon: InProcess, deadline: float) -> bool:
    return bool(daemon.sub.poll(0)) or time.monotonic() > deadline


async def until_relayed(daemon: InProcess, engine: Engine, block_hash: int) -> None:
    """Publish the engine's clear and a store until the store comes out on kvpubd's stream
    (the follower's SUB socket is joined from then on)."""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        engine.publish([AllBlocksCleared(), store(block_hash)])
        await daemon.turns_until(partial(relayed_or_past, daemon, time.monotonic() + 0.05))
        while daemon.sub.poll(0):
            events = decode_batch(daemon.sub.recv_multipart()[2]).events
            if any(isinstance(e, BlockStored) and e.block_hashes == [block_hash] for e in events):
                return
    raise AssertionError("the engine's store never came out on kvpubd's stream")


@pytest.mark.parametrize(("batches", "events_per_batch"), BURSTS)
async def test_a_burst_of_batches_that_publish_nothing_still_gives_the_loop_turns(
    tmp_path: Path, batches: int, events_per_batch: int
) -> None:
    """After a reset the engine's events are dropped until its own clear: nothing is captured,
    so nothing is flushed. A burst of such batches, all received before the loop runs again:
    the loop turns at least every TURN_EVENTS of them, also inside a batch of thousands
    (without it, once per burst of up to 256 batches or per batch, tens of milliseconds on
    the H200 host)."""
    endpoint = f"ipc://{tmp_path}/engine"
    engine = Engine(endpoint)
    upstream = {"flavour": "vllm", "endpoint": endpoint, "replay_endpoint": ""}
    try:
        async with in_process(tmp_path, 64, upstream=upstream) as daemon:
            await until_relayed(daemon, engine, 7)
            await daemon.call("reset")  # the engine's events are dropped until its clear
            relay = daemon.pipeline.relay
            assert relay is not None
            dropped = relay.dropped_by_reset
            # A second subscriber in this thread: once it holds the whole burst, so does the
            # daemon's (the loop does not run meanwhile).
            watcher = engine.context.socket(zmq.SUB)
            watcher.setsockopt(zmq.SUBSCRIBE, b"")
            watcher.connect(endpoint)
            probes = 0
            while not watcher.poll(10):  # joined once a probe batch reaches it
                probes += 1
                engine.publish([BlockRemoved([10_000 + probes], "GPU", 0)])
            while watcher.poll(0):
                watcher.recv_multipart()
            for batch in range(batches):
                removals = range(batch * events_per_batch, (batch + 1) * events_per_batch)
                engine.publish([BlockRemoved([h], "GPU", 0) for h in removals])
            for _ in range(batches):
                assert watcher.poll(int(BOUND_S * 1000))
                watcher.recv_multipart()
            watcher.close(linger=0)
            target = dropped + probes + batches * events_per_batch
            samples = await daemon.per_turn(
                lambda: relay.dropped_by_reset, lambda: relay.dropped_by_reset >= target
            )
            per_turn = [after - before for before, after in itertools.pairwise(samples)]
            assert max(per_turn) <= TURN_EVENTS, per_turn
            assert relay.dropped_by_reset == target  # all dropped (fenced), none relayed
    finally:
        engine.close()


async def test_a_fence_does_not_time_out_while_the_engines_batches_wait_unread(
    tmp_path: Path,
) -> None:
    """A reset while kvpubd has a backlog of the engine's batches (received, not yet worked
    through) longer than ``clear_timeout_ms``, the engine's clear behind them. The fence timed
    out at the first of them, and the stores the engine made before its clear went out after
    the marker. It times out only once nothing received waits: the clear ends it."""
    endpoint = f"ipc://{tmp_path}/engine"
    engine = Engine(endpoint)
    timeout_s = 0.05
    upstream = {
        "flavour": "vllm",
        "endpoint": endpoint,
        "replay_endpoint": "",
        "clear_timeout_ms": int(timeout_s * 1000),
    }
    try:
        async with in_process(tmp_path, 64, upstream=upstream) as daemon:
            await until_relayed(daemon, engine, 7)
            watcher = engine.context.socket(zmq.SUB)  # has what the daemon's SUB socket has
            watcher.setsockopt(zmq.SUBSCRIBE, b"")
            watcher.connect(endpoint)
            probes = 0
            while not watcher.poll(10):
                probes += 1
                engine.publish([BlockRemoved([10_000 + probes], "GPU", 0)])
            while watcher.poll(0):
                watcher.recv_multipart()
            while daemon.sub.poll(0):
                daemon.sub.recv_multipart()
            before_clear = range(100, 2_100)
            for start in range(before_clear.start, before_clear.stop, 100):
                engine.publish([store(h) for h in range(start, start + 100)])
            assert isinstance(daemon.send("reset"), bytes)  # its marker is out
            engine.publish([AllBlocksCleared(), store(99_999)])
            for _ in range(len(before_clear) // 100 + 1):
                assert watcher.poll(int(BOUND_S * 1000))
                watcher.recv_multipart()
            watcher.close(linger=0)
            time.sleep(2 * timeout_s)  # past the fence's timeout before any of them is read
            published: list[Event] = []
            deadline = time.monotonic() + BOUND_S
            while not any(
                isinstance(e, BlockStored) and e.block_hashes == [99_999] for e in published
            ):
                assert time.monotonic() < deadline, "the store after the engine's clear"
                await daemon.turns_until(partial(relayed_or_past, daemon, deadline))
                while daemon.sub.poll(0):
                    published += decode_batch(daemon.sub.recv_multipart()[2]).events
            leaked = [
                h
                for e in published
                if isinstance(e, BlockStored)
                for h in e.block_hashes
                if h in before_clear
            ]
            assert not leaked, f"{len(leaked)} blocks from before the engine's clear"
    finally:
        engine.close()
