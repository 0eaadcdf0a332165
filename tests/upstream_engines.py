"""Real engine publishers for the upstream tests, and what stands between them and a follower.

``Engine``: one rank of vLLM's or SGLang's own ``ZmqEventPublisher`` (their kv_events.py,
unmodified, loaded on its own) on ipc endpoints; ``start()`` again is a restarted engine (seqs
from 0, same endpoints). ``Relay``: a thread between an engine's PUB socket and a follower that
forwards live messages and drops the seqs it is told to (the replay socket stays the engine's).
``Collector``: runs a follower on a task and keeps what it gives out.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpubd.client.subscriber import replay
from kvpubd.protocol import wire
from kvpubd.tools import vllm_source
from kvpubd.upstream.follower import EngineFollower, FollowedBatch
from tests import sglang_source

ENGINES = ("vllm", "sglang")
WAIT_S = 20.0  # a deadline for what must happen, never a pause


def engine_module(flavour: str) -> types.ModuleType:
    """The engine's kv_events module; skips the test when its file is not there."""
    if flavour == "vllm":
        path = vllm_source.kv_events_path()
        if not path.is_file():
            pytest.skip("vLLM's kv_events.py not extracted (kvpubd bench vllm-extract WHEEL)")
        return vllm_source.load_kv_events(path)
    path = sglang_source.kv_events_path()
    if not path.is_file():
        pytest.skip("SGLang's kv_events.py not extracted (python -m tests.sglang_source WHEEL)")
    return sglang_source.load_kv_events(path)


class Engine:
    """One engine rank publishing through its own publisher. Batch ``key`` holds one
    BlockStored whose hash and tokens are derived from ``key`` (``expected(key)``: its
    canonical form)."""

    def __init__(
        self,
        flavour: str,
        directory: Path,
        buffer_steps: int = 1000,
        hwm: int = 100_000,
        block_size: int = 2,
    ) -> None:
        self.flavour = flavour
        self.hwm = hwm
        self.block_size = block_size
        self.kv = engine_module(flavour)
        self.endpoint = f"ipc://{directory}/{flavour}-pub"
        self.replay_endpoint = f"ipc://{directory}/{flavour}-replay"
        self.buffer_steps = buffer_steps
        self.publisher: Any = None
        self.published = 0  # batches of the running publisher (its next seq)

    def start(self) -> Engine:
        rank = {"data_parallel_rank" if self.flavour == "vllm" else "attn_dp_rank": 0}
        self.publisher = self.kv.ZmqEventPublisher(
            **rank,
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            buffer_steps=self.buffer_steps,
            hwm=self.hwm,
        )
        self.published = 0
        return self

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()
            self.publisher = None

    def block_hash(self, key: int) -> int:
        # SGLang's hashes are signed 64-bit: its stream carries negative ones.
        return -(key + 1) if self.flavour == "sglang" else key * 7 + 1

    def tokens(self, key: int) -> list[int]:
        return [key % 50_000, *range(7, 6 + self.block_size)]

    def publish(self, key: int) -> None:
        tokens = self.tokens(key)
        if self.flavour == "vllm":
            event = self.kv.BlockStored(
                block_hashes=[self.block_hash(key)],
                parent_block_hash=None,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=1,
                session_id="dropped",
            )
        else:  # medium and lora_name left unset, as SGLang sends its GPU stores
            event = self.kv.BlockStored(
                block_hashes=[self.block_hash(key)],
                parent_block_hash=None,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=None,
                cache_salt="salt",
                session_id="dropped",
            )
        self._send(self.kv.KVEventBatch(ts=time.time(), events=[event]))

    def publish_events(self, events: list[Any]) -> int:
        """One batch of the engine's own event objects (its module's types); returns its seq."""
        seq = self.published
        self._send(self.kv.KVEventBatch(ts=time.time(), events=events))
        return seq

    def publish_junk(self) -> None:
        """A batch the engine's publisher sends as it sends any: events that are no events."""
        self._send(self.kv.EventBatch(ts=time.time(), events=[{"not": "an event"}]))

    def _send(self, batch: Any) -> None:
        self.publisher.publish(batch)
        self.published += 1

    def expected(self, key: int) -> wire.BlockStored:
        return wire.BlockStored(
            block_hashes=[self.block_hash(key)],
            parent_block_hash=None,
            token_ids=self.tokens(key),
            block_size=self.block_size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=1 if self.flavour == "vllm" else None,
            cache_salt="salt" if self.flavour == "sglang" else None,
        )

    def wait_sent(self, through_seq: int) -> None:
        """Until the publisher has sent seq ``through_seq`` (its replay socket holds it)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            held = replay(self.replay_endpoint, through_seq, timeout=WAIT_S)
            if held and held[0][0] == through_seq:
                return
            assert time.monotonic() < deadline, f"seq {through_seq} never sent"


class Relay:
    """Forwards an engine's live messages to its own XPUB endpoint, once a subscriber has
    subscribed there, except those ``drop(seq)`` names (kept in ``dropped``). ``close_pub()``
    takes the XPUB socket away (its subscribers see the connection lost) and ``open_pub()``
    binds it again, as a restarted engine's PUB would be."""

    def __init__(self, upstream: str, directory: Path) -> None:
        self.endpoint = f"ipc://{directory}/relay-pub"
        self.drop: Callable[[int], bool] = lambda seq: False
        self.received: list[int] = []
        self.dropped: list[int] = []
        self.subscribed = threading.Event()
        self._commands: queue.Queue[str] = queue.Queue()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub: zmq.Socket[bytes] | None = None
        self._open()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.bind(self.endpoint)
        self.subscribed.clear()

    def _run(self) -> None:
        while (command := self._next_command()) != "stop":
            if command == "close":
                assert self._pub is not None
                self._pub.close(linger=0)
                self._pub = None
            elif command == "open":
                self._open()
            # The first byte of a subscription message is 1.
            if self._pub is not None and self._pub.poll(0) and self._pub.recv()[:1] == b"\x01":
                self.subscribed.set()
            if not self._sub.poll(10):
                continue
            frames = self._sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            self.received.append(seq)
            if self._pub is None or not self.subscribed.is_set() or self.drop(seq):
                self.dropped.append(seq)
            else:
                self._pub.send_multipart(frames)
        for sock in (self._sub, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _next_command(self) -> str:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return ""

    def close_pub(self) -> None:
        self.subscribed.clear()
        self._commands.put("close")

    def open_pub(self) -> None:
        self.subscribed.clear()  # set again by the subscription to the new socket
        self._commands.put("open")

    def stop(self) -> None:
        self._commands.put("stop")
        self._thread.join(WAIT_S)


class Collector:
    """Runs ``follower`` on a task, keeping every batch it gives out; between
    ``stop_taking()`` and ``take()`` it takes none (the follower waits on it)."""

    def __init__(self, follower: EngineFollower) -> None:
        self.follower = follower
        self.batches: list[FollowedBatch] = []
        self._taking = asyncio.Event()
        self._taking.set()
        self._task = asyncio.create_task(follower.run(self._keep))

    async def _keep(self, batch: FollowedBatch) -> None:
        await self._taking.wait()
        self.batches.append(batch)

    def stop_taking(self) -> None:
        self._taking.clear()

    def take(self) -> None:
        self._taking.set()

    async def until(self, condition: Callable[[], bool], what: str, within: float = WAIT_S) -> None:
        deadline = time.monotonic() + within
        while not condition():
            if self._task.done():
                self._task.result()  # the follower's failure, raised here
            assert time.monotonic() < deadline, f"{what}: not within {within} s"
            await asyncio.sleep(0.005)  # a poll of the condition, not a wait for it

    async def seen(self, condition: Callable[[], bool], within: float) -> bool:
        try:
            await self.until(condition, "", within)
        except AssertionError:
            return False
        return True

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.follower.close()


async def publish_until(
    engine: Engine, collector: Collector, condition: Callable[[], bool], first_key: int
) -> int:
    """Publish batches ``first_key``, ``first_key + 1``, ... one at a time until ``condition``
    holds (what a subscriber that is still joining needs); returns the next key."""
    key = first_key
    deadline = time.monotonic() + WAIT_S
    while True:
        engine.publish(key)
        key += 1
        if await collector.seen(condition, 0.02):
            return key
        assert time.monotonic() < deadline, "the follower never received a batch"
