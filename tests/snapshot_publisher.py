"""A small publisher of the snapshot protocol, written from the protocol's text alone, for
tests of the subscribers: a PUB socket (``[topic, seq, payload]``, the payload
``[ts, events, rank, publisher_id]``) and a ROUTER answering ``b"snapshot"`` with
``[seq, publisher_id, chunk...]``, on real ZeroMQ sockets. Its thread owns the sockets; the
test drives it through ``call``, which runs a step there and waits for it."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import zmq

from kvpubd.protocol.endpoints import rank_endpoint
from kvpubd.protocol.wire import BlockHash, BlockRemoved, BlockStored, Event, pack_seq

T = TypeVar("T")
CHUNK_BLOCKS = 3  # blocks per snapshot chunk: a few chunks for a few blocks


def block(number: int, parent: int | None = None) -> BlockStored:
    return BlockStored([number], parent, [number] * 4, 4, None, "GPU", None)


class SnapshotPublisher:
    """One rank's publisher. ``heartbeat``: seconds of idleness before an empty batch (None:
    none). ``with_publisher_id=False`` publishes 3-element batches (no snapshots served).
    ``unavailable``: how many requests get -2; ``answering``: False ignores requests;
    ``publish_during_snapshot``: batches published between taking a snapshot and replying."""

    def __init__(
        self,
        events: str,
        snapshot: str,
        *,
        rank: int = 0,
        first_seq: int = 1000,
        heartbeat: float | None = 0.05,
        with_publisher_id: bool = True,
    ) -> None:
        self.events = rank_endpoint(events, rank)
        self.snapshot = rank_endpoint(snapshot, rank)
        self.rank = rank
        self.heartbeat = heartbeat
        self.with_publisher_id = with_publisher_id
        self.unavailable = 0
        self.answering = True
        self.publish_during_snapshot = 0
        self.requests = 0
        self.seq = first_seq - 1  # the last seq published
        self.publisher_id = os.urandom(16)
        self.state: dict[BlockHash, BlockStored] = {}  # one-block stores, parents first
        self._context = zmq.Context()
        self._steps: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]]] = queue.Queue()
        self._stop = threading.Event()
        self._bind()
        self._thread = threading.Thread(target=self._run, name="snapshot-publisher", daemon=True)
        self._thread.start()

    # -- driven from the test --------------------------------------------------------------

    def call(self, step: Callable[[], T]) -> T:
        """Run ``step`` on the publisher's thread; its result (or exception)."""
        done: queue.Queue[Any] = queue.Queue()
        self._steps.put((step, done))
        result = done.get(timeout=10)
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]

    def store(self, *blocks: BlockStored) -> int:
        """Publish one batch storing ``blocks``; returns its seq."""
        return self.call(lambda: self._publish(list(blocks)))

    def remove(self, *numbers: int) -> int:
        return self.call(lambda: self._publish([BlockRemoved(list(numbers), None)]))

    def skip(self) -> None:
        """Lose one seq: the next batch leaves a gap."""
        self.call(lambda: setattr(self, "seq", self.seq + 1))

    def restart(self, first_seq: int | None = None) -> bytes:
        """A new lifetime on the same endpoints: a new publisher_id, an empty cache; its seqs
        continue the old ones' unless ``first_seq`` says otherwise. Returns the new id."""

        def step() -> bytes:
            self._pub.close()
            self._router.close()
            self.state.clear()
            self.publisher_id = os.urandom(16)
            if first_seq is not None:
                self.seq = first_seq - 1
            self._bind()
            return self.publisher_id

        return self.call(step)

    def set(self, **values: Any) -> None:
        def step() -> None:
            for name, value in values.items():
                setattr(self, name, value)

        self.call(step)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._context.destroy(linger=0)

    # -- the publisher's thread ------------------------------------------------------------

    def _bind(self) -> None:
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.events)
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(self.snapshot)
        self._published_at = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._router.poll(5):
                self._answer(self._router.recv_multipart())
            while not self._steps.empty():
                step, done = self._steps.get()
                try:
                    done.put(step())
                except Exception as exc:
                    done.put(exc)
            idle = time.monotonic() - self._published_at
            if self.heartbeat is not None and idle >= self.heartbeat:
                self._publish([])
        self._pub.close()
        self._router.close()

    def _payload(self, events: list[Event]) -> bytes:
        batch: tuple[Any, ...] = (time.time(), events, self.rank)
        if self.with_publisher_id:
            batch = (*batch, self.publisher_id)
        return msgspec.msgpack.encode(batch)

    def _publish(self, events: list[Event]) -> int:
        for event in events:
            if isinstance(event, BlockStored):
                (number,) = event.block_hashes  # one-block stores: the state is the stores
                self.state[number] = event
            elif isinstance(event, BlockRemoved):
                for number in event.block_hashes:
                    del self.state[number]
        self.seq += 1
        self._pub.send_multipart([b"", pack_seq(self.seq), self._payload(events)])
        self._published_at = time.monotonic()
        return self.seq

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1:] != [b"", b"snapshot"] or not self.answering:
            return
        self.requests += 1
        identity = frames[0]
        if self.unavailable:
            self.unavailable -= 1
            reply = [(-2).to_bytes(8, "big", signed=True), self.publisher_id]
        else:
            stores = list(self.state.values())
            chunks = [
                msgspec.msgpack.encode((time.time(), stores[i : i + CHUNK_BLOCKS], self.rank))
                for i in range(0, len(stores), CHUNK_BLOCKS)
            ]
            reply = [self.seq.to_bytes(8, "big", signed=True), self.publisher_id, *chunks]
            # Batches published after the snapshot was taken reach the subscriber before the
            # reply: it must buffer them and apply them on top.
            for _ in range(self.publish_during_snapshot):
                self._publish([block(900_000 + self.seq)])
        self._router.send_multipart([identity, b"", *reply])
