"""Follows one rank of an unmodified engine's KV-event publisher (asyncio).

A SUB socket takes the engine's live batches ``[topic, seq, payload]``; a DEALER asks its replay
ROUTER for what the SUB socket missed. Batches come out in seq order, decoded into kvpubd's
canonical events, each with the ``Condition`` met just before it:

- a forward gap (seq past the next expected) is asked of replay, and the batches it returns are
  given out in order (``REPLAYED``); what replay cannot return is given up (``LOST`` on the next
  batch given out). The request starts at the last batch taken, not the one after: its payload
  must come back unchanged, else the engine restarted meanwhile and its seqs passed ours.
- a seq at or below the last one taken means the engine restarted (its seqs start again at 0):
  ``RESTART``, and the new engine's history is taken from seq 0, through replay where needed.
  After the SUB socket lost its connection (a socket monitor says so), the next batch is
  checked the same way even when its seq follows on: a restarted engine whose new seqs reached
  exactly ours would otherwise pass for the old one.
- a payload that does not decode is counted (``counters.malformed``) and skipped (``LOST`` on
  the next batch: its events are missing).

With ``idle_check`` (seconds), a SUB socket silent that long asks replay for anything after
the last batch taken: the tail of a burst that ZeroMQ dropped is revealed by no later batch.
Live batches that such a catch-up gave out already are then skipped (``counters.duplicates``).

The first batch expected is ``start_seq`` (0: the engine's whole history; a follower that joins
late repairs the start through replay, or reports it lost).

Memory is bounded without a queue of our own: batches are read only as fast as the consumer
takes them, so a flooding engine fills the SUB socket's receive high-water mark (``rcvhwm``)
and ZeroMQ drops the rest, which come back as gaps (repaired or counted as lost). A replay
answer is bounded the same way (``max_replay_batches``) and every message by
``max_payload_bytes`` (ZeroMQ disconnects a peer that sends more).
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvpubd.protocol.wire import Event, split_live
from kvpubd.upstream.flavours import (
    DECODE_SLICE_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    Flavour,
    FlavourDecoder,
    UpstreamBatch,
    UpstreamPayloadError,
)
from kvpubd.upstream.replay import ReplayClient
from kvpubd.upstream.throttled_log import ThrottledLog

# Messages read from the SUB socket per round of the loop at most.
BURST = 256

log = logging.getLogger(__name__)


class Condition(enum.Flag):
    NONE = 0
    REPLAYED = enum.auto()  # this batch came from the replay socket (it filled a gap)
    LOST = enum.auto()  # batches before this one are missing for good (lost, or undecodable)
    RESTART = enum.auto()  # the engine restarted before this batch: all before it is void
    # With RESTART: a new engine for certain (its connection was lost first, or its replay
    # returned another batch where ours was), not only seqs that went back.
    NEW_ENGINE = enum.auto()


@dataclass(frozen=True)
class FollowedBatch:
    seq: int
    ts: float
    events: list[Event]
    rank: int | None  # as the engine stamped the batch
    condition: Condition
    missing_before: int  # batches right before this one whose events are missing (LOST)


@dataclass
class FollowerCounters:
    live: int = 0  # batches given out as the SUB socket received them
    replayed: int = 0  # batches given out from replay answers
    gaps: int = 0  # forward gaps met
    lost: int = 0  # batches given up: neither received nor replayed
    restarts: int = 0
    malformed: int = 0  # messages or payloads that did not decode (skipped)
    replays_cut_short: int = 0  # replay answers that fell silent or ran too long
    duplicates: int = 0  # live batches a catch-up (idle_check) had given out already
    replays_repeated: int = 0  # answers with batches dropped on the way, asked for again
    reconnects: int = 0  # connections to the engine's PUB socket lost (and made again)
    decoded_bytes: int = 0  # of payloads (a large one's events: as each slice is decoded)


OnBatch = Callable[[FollowedBatch], Awaitable[None] | None]


class EngineFollower:
    """Follows the engine rank whose PUB socket is at ``endpoint`` (and replay ROUTER at
    ``replay_endpoint``; without one every gap is lost). Iterate with ``async for`` or hand
    each batch to a callback with ``run``."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        flavour: Flavour = "vllm",
        decoder: FlavourDecoder | None = None,
        topic: str = "",
        start_seq: int = 0,
        rcvhwm: int = 10_000,
        idle_check: float | None = None,
        replay_timeout: float = 2.0,
        max_replay_batches: int = 20_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.decoder = decoder or FlavourDecoder(flavour, max_payload_bytes=max_payload_bytes)
        self.counters = FollowerCounters()
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._endpoint, self._topic = endpoint, topic
        self._rcvhwm, self._max_payload_bytes = rcvhwm, max_payload_bytes
        self._open_sub()
        self._disconnected = False  # since the last batch taken: check the next one
        self._replay = (
            ReplayClient(
                self._context,
                replay_endpoint,
                topic=topic.encode(),
                timeout=replay_timeout,
                max_batches=max_replay_batches,
                max_message_bytes=max_payload_bytes,
            )
            if replay_endpoint
            else None
        )
        self._first_seq = start_seq  # expected while nothing is taken (0 after a restart)
        self._last = -1  # the last seq taken
        self._last_payload: bytes | None = None  # its payload (None: lost, or none yet)
        self._pending = Condition.NONE  # for the next batch given out
        self._missing = 0
        self._closed = False
        self._malformed_log = ThrottledLog(log)
        self._idle_ms = int(idle_check * 1000) if idle_check and self._replay else None
        # Live seqs a catch-up gave out already: (after, through]; None: no catch-up pending.
        self._caught_up: tuple[int, int] | None = None

    @property
    def last_seq(self) -> int | None:
        return self._last if self._last >= 0 else None

    @property
    def more_ready(self) -> bool:
        """The engine's next batch is received already (its consumer may wait to act)."""
        return bool(zmq.zmq_poll(self._sub_ready, 0))

    def __aiter__(self) -> AsyncIterator[FollowedBatch]:
        return self._follow()

    async def run(self, on_batch: OnBatch) -> None:
        """Hand every batch to ``on_batch`` (awaited if it is a coroutine), until cancelled."""
        async for batch in self:
            result = on_batch(batch)
            if inspect.isawaitable(result):
                await result

    def close(self) -> None:
        """Close the sockets (cancel whatever iterates first)."""
        if self._closed:
            return
        self._closed = True
        self._close_sub()
        if self._replay is not None:
            self._replay.close()
        if self._own_context:
            self._context.term()

    async def __aenter__(self) -> EngineFollower:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- the sequencing -----------------------------------------------------------------

    async def _follow(self) -> AsyncIterator[FollowedBatch]:
        while True:
            ready = dict(await self._poller.poll(self._idle_ms))
            # The monitor first: a disconnection is reported before anything the socket
            # receives from the engine it reconnects to.
            while await self._monitor.poll(0):
                await self._monitor.recv_multipart()
                self._disconnected = True
                self._reconnect()
            if not ready:
                async for batch in self._catch_up():
                    yield batch
            if self._sub not in ready:
                continue
            # What the socket holds, read without a round of the loop each (a saturated
            # engine's batches come far faster than asyncio hands out futures); the monitor
            # is looked at before each, as above.
            for _ in range(BURST):
                if zmq.zmq_poll(self._monitor_ready, 0):
                    break  # reported on the next round, before anything after it
                try:
                    frames = self._sub_now.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    seq, payload = split_live(frames)
                except ValueError as exc:
                    self._malformed(f"a message that is no batch: {exc}")  # nothing to repair by
                    continue
                async for batch in self._take(seq, payload):
                    yield batch

    def _open_sub(self) -> None:
        """The SUB socket on the engine's PUB, its monitor and the pollers of both."""
        sub = self._sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_payload_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic.encode())
        sub.connect(self._endpoint)
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        # The same sockets, read without the loop (see _follow).
        self._sub_now: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        self._monitor_now: zmq.Socket[bytes] = zmq.Socket.shadow(self._monitor.underlying)
        # Asked once per engine batch: zmq_poll itself costs a third of a socket's poll() or
        # of reading its EVENTS (microseconds each, a tenth of what relaying a batch costs).
        self._sub_ready = [(self._sub_now, zmq.POLLIN)]
        self._monitor_ready = [(self._monitor_now, zmq.POLLIN)]
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(sub, zmq.POLLIN)

    def _close_sub(self) -> None:
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)

    def _reconnect(self) -> None:
        """A new SUB socket. ZeroMQ reconnects by itself after a connection error, but not
        after a protocol error: a message over ``max_payload_bytes`` closed the connection
        for good, and the engine was never heard again. A new socket, not a disconnect and
        connect: libzmq aborts the process when a connection ends under a message it has
        begun to read (polling reads a SUB socket's next message ahead). What the old socket
        still held is a gap, repaired as any."""
        self.counters.reconnects += 1
        self._close_sub()
        self._open_sub()

    def _next_seq(self) -> int:
        return self._last + 1 if self._last >= 0 else self._first_seq

    async def _catch_up(self) -> AsyncIterator[FollowedBatch]:
        after, restarts = self._last, self.counters.restarts
        async for batch in self._fill(None):
            yield batch
        if self.counters.restarts != restarts:
            after = -1  # the new engine's history was given out from its seq 0
        if self._last > after:
            self._caught_up = (after, self._last)

    async def _take(self, seq: int, payload: bytes) -> AsyncIterator[FollowedBatch]:
        if self._caught_up is not None:
            after, through = self._caught_up
            if after < seq <= through:
                self.counters.duplicates += 1
                return
            self._caught_up = None
        if self._last >= 0 and seq <= self._last:
            self._restarted(new_engine=self._disconnected)
        if seq > self._next_seq():
            self.counters.gaps += 1
            async for batch in self._fill(seq):
                yield batch
        elif self._disconnected and self._last_payload is not None and self._replay is not None:
            # Asks replay for our last batch only: a restart is found as in a gap's repair.
            async for batch in self._fill(seq):
                yield batch
        self._disconnected = False
        taken = await self._accept(seq, payload, Condition.NONE)
        if taken is not None:
            yield taken

    async def _fill(self, stop: int | None) -> AsyncIterator[FollowedBatch]:
        """Give out the batches from the next expected seq up to ``stop`` (excluded; None: all
        there are) that replay returns; lose the rest.

        An engine's ring holds consecutive seqs, so only where an answer starts can it show
        that batches are gone for good. A seq missing after one that came was dropped on the
        way (the engines' replay ROUTER sends its whole answer at once and drops past its
        send high-water mark, 1000, while we read), as is a tail after which the answer fell
        silent: those are asked for again, as long as each answer brings something new."""
        if self._replay is None:
            if stop is not None:
                self._lose(stop - self._next_seq())
            return
        while True:
            verify = self._last_payload is not None
            ask = self._last if verify else self._next_seq()
            before = self._last
            restarted = answered = dropped = False
            async for seq, payload in self._replay.batches(ask):
                if verify and seq == ask and not answered:
                    answered = True
                    restarted = payload != self._last_payload
                    continue
                first, answered = not answered, True
                if (
                    restarted
                    or dropped
                    or seq < self._next_seq()
                    or (stop is not None and seq >= stop)
                ):
                    continue  # read to the end all the same: the socket serves the next request
                if seq > self._next_seq():
                    if not first:
                        dropped = True  # on the way: asked for again below
                        continue
                    self._lose(seq - self._next_seq())  # the ring has moved past them
                batch = await self._accept(seq, payload, Condition.REPLAYED)
                if batch is not None:
                    yield batch
            outcome = self._replay.outcome
            self.counters.malformed += outcome.malformed
            self.counters.replays_cut_short += int(not outcome.finished)
            if stop is None and verify and self._disconnected and outcome.finished and not answered:
                # A silence after a lost connection, and the engine holds nothing from our last
                # batch on (its ring always holds its newest): it restarted and has published
                # fewer batches than before, none of which reached us live.
                restarted = True
            if restarted:
                # Our last batch came back different: the engine restarted and its new seqs
                # passed ours. Its history is taken again from its start.
                self._restarted()
                async for batch in self._fill(stop):
                    yield batch
                return
            wanted = stop is None or self._next_seq() < stop  # batches still to give out
            if (dropped or not outcome.finished) and self._last > before and wanted:
                self.counters.replays_repeated += 1
                continue
            if stop is not None and wanted:
                self._lose(stop - self._next_seq())
            return

    async def _accept(self, seq: int, payload: bytes, condition: Condition) -> FollowedBatch | None:
        self._last, self._last_payload = seq, payload
        try:
            decoded = await self._decoded(payload)
        except UpstreamPayloadError as exc:
            self._malformed(f"batch {seq} does not decode: {exc}")
            self._pending |= Condition.LOST
            self._missing += 1
            return None
        # Identity checks, not Flag operators: those are Python code, a few per batch.
        if condition is Condition.REPLAYED:
            self.counters.replayed += 1
        else:
            self.counters.live += 1
        pending = self._pending
        if pending is not Condition.NONE:
            condition |= pending
            self._pending = Condition.NONE
        batch = FollowedBatch(
            seq, decoded.ts, decoded.events, decoded.rank, condition, self._missing
        )
        self._missing = 0
        return batch

    async def _decoded(self, payload: bytes) -> UpstreamBatch:
        """The payload decoded, a slice per loop turn when it is large (a megabyte in one
        piece held the loop 2 to 7 ms, and a reset with it)."""
        counters = self.counters
        if len(payload) <= DECODE_SLICE_BYTES:
            decoded = self.decoder.decode(payload)
            counters.decoded_bytes += len(payload)
            return decoded
        for step in self.decoder.decode_stepwise(payload):
            if isinstance(step, UpstreamBatch):
                return step
            counters.decoded_bytes += step
            await asyncio.sleep(0)
        raise AssertionError("decode_stepwise ends with the batch")

    def _malformed(self, why: str) -> None:
        """Counted, and logged (at most one line every few seconds)."""
        self.counters.malformed += 1
        self._malformed_log.warning("upstream: skipped %.200s", why)

    def _lose(self, count: int) -> None:
        if count <= 0:
            return
        self.counters.lost += count
        self._pending |= Condition.LOST
        self._missing += count
        self._last, self._last_payload = self._next_seq() + count - 1, None

    def _restarted(self, new_engine: bool = True) -> None:
        """The engine started again: what was lost before no longer matters."""
        self.counters.restarts += 1
        self._first_seq, self._last, self._last_payload = 0, -1, None
        self._pending = Condition.RESTART | (Condition.NEW_ENGINE if new_engine else Condition.NONE)
        self._missing = 0
