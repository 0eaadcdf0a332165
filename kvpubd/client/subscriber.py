"""Subscribers that keep a mirror of one or more ranks' published cache: ``Subscriber``
(blocking) and ``AsyncSubscriber`` (asyncio). Both are I/O shells around one
``kvpubd.client.tracker.StreamTracker``, which decides everything: they read the SUB sockets, feed
the tracker, and carry out what it asks for (replay through a DEALER, control ``ping`` and
``snapshot``, reconnecting a SUB socket) until it asks for nothing more.

``endpoint`` and ``replay_endpoint`` are the daemon's configured base endpoints; each rank's own
endpoint is derived from them as the daemon does. ``control`` (an endpoint or a client) enables
the epoch check and the snapshot resync; without it, history that replay no longer holds is
counted as ``lost`` and the rank's mirror waits for the next ``AllBlocksCleared``.

A replay or control request that gets no answer raises ``TimeoutError`` (``SubscriberTimeout``
or ``ControlTimeout``) from the call that needed it; the request is kept and retried by the next
call, so a caller that waits out a daemon restart just calls again."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import zmq
import zmq.asyncio

from kvpubd.client.control import AsyncControlClient, ControlClient
from kvpubd.client.mirror import Mirror
from kvpubd.client.tracker import (
    Callbacks,
    Counters,
    Ping,
    Received,
    Reconnect,
    Replay,
    Request,
    Snapshot,
    StreamTracker,
    SubscriberError,
)
from kvpubd.protocol.config import rank_endpoint
from kvpubd.protocol.wire import END_SEQ, pack_seq, unpack_seq

__all__ = [
    "AsyncSubscriber",
    "Counters",
    "Subscriber",
    "SubscriberError",
    "SubscriberTimeout",
    "replay",
]

# Live messages read per rank per receive() call before the other ranks get a turn.
BURST = 1000


class SubscriberTimeout(TimeoutError):
    """A replay did not finish in time (the daemon is down or overloaded); retried next call."""


def parse_replay_message(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay message, None for the end marker. Works for both framings:
    ``[b"", topic, seq, payload]`` (v026) and ``[b"", seq, payload]`` (legacy)."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise ValueError(f"replay message has {len(frames)} frames")
    seq_frame, payload = frames[-2], frames[-1]
    if seq_frame == END_SEQ:
        return None
    return unpack_seq(seq_frame), payload


def replay(
    endpoint: str, start_seq: int, *, timeout: float = 5.0, context: zmq.Context | None = None
) -> list[tuple[int, bytes]]:
    """Ask a replay socket for every retained batch from ``start_seq``: [(seq, payload)]."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"replay from {endpoint} did not finish")
            frames = sock.recv_multipart()
            # [b"", topic, seq, payload] (v026) or [b"", seq, payload] (legacy)
            seq_frame, payload = frames[-2], frames[-1]
            if seq_frame == END_SEQ:
                return batches
            batches.append((unpack_seq(seq_frame), payload))
    finally:
        sock.close()


class _Base:
    """What both forms share: arguments, the tracker, and the read-only views."""

    # The forms differ in these two: plain or asyncio ZeroMQ, sync or async control client.
    _context_class: Any = zmq.Context
    _control_class: Any = ControlClient

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        control: Any = None,
        ranks: int | Sequence[int] = 1,
        topic: str = "",
        replay_timeout: float = 5.0,
        control_timeout: float = 5.0,
        rcvhwm: int | None = None,
        idle_check: float | None = None,
        mirror: bool = True,
        on_batch: Callable[[Received], None] | None = None,
        on_gap: Callable[[int, int, int], None] | None = None,
        on_resync: Callable[[int, int], None] | None = None,
        on_restart: Callable[[int, str], None] | None = None,
        context: Any = None,
    ) -> None:
        if not replay_timeout > 0:
            raise ValueError(
                f"replay_timeout: {replay_timeout} is not a positive number of seconds"
            )
        if idle_check is not None and not idle_check > 0:
            raise ValueError(f"idle_check: {idle_check} is not a positive number of seconds")
        rank_list = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
        self.ranks = rank_list
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.rcvhwm = rcvhwm
        self.idle_check = idle_check
        self._endpoints = {r: rank_endpoint(endpoint, r) for r in rank_list}
        self._replay_endpoints = (
            {r: rank_endpoint(replay_endpoint, r) for r in rank_list} if replay_endpoint else {}
        )
        self.tracker = StreamTracker(
            rank_list,
            replay=bool(replay_endpoint),
            control=control is not None,
            keep_mirror=mirror,
            callbacks=Callbacks(on_batch, on_gap, on_resync, on_restart),
        )
        self._heard = dict.fromkeys(rank_list, time.monotonic())
        # Applied and not yet returned: survives a call that raised (timeout) midway.
        self._ready: list[Received] = []
        self._closed = False
        self._own_context = context is None
        self._context = context or self._context_class()
        self._own_control = isinstance(control, str)
        self._control = (
            self._control_class(control, control_timeout, self._context)
            if isinstance(control, str)
            else control
        )
        self._subs = {rank: self._open_sub(rank) for rank in self.ranks}
        self._dealers: dict[int, Any] = {}

    def _open_sub(self, rank: int) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in [*self._subs.values(), *self._dealers.values()]:
            sock.close()
        self._subs.clear()
        self._dealers.clear()
        if self._own_control and self._control is not None:
            self._control.close()
        if self._own_context:
            self._context.term()

    def _take(self) -> list[Received]:
        out, self._ready = self._ready, []
        return out

    @property
    def counters(self) -> Counters:
        """The counters summed over every rank followed."""
        return self.tracker.counters()

    def rank_counters(self, rank: int = 0) -> Counters:
        return self.tracker.streams[rank].counters

    def mirror(self, rank: int = 0) -> Mirror | None:
        """The rank's cache as published (None when built with ``mirror=False``)."""
        return self.tracker.streams[rank].mirror

    def synced(self, rank: int = 0) -> bool:
        """False while the rank's mirror misses lost history (until the next reset marker)."""
        return self.tracker.streams[rank].synced

    def last_seq(self, rank: int = 0) -> int | None:
        return self.tracker.streams[rank].last

    @property
    def epoch(self) -> int | None:
        return self.tracker.epoch

    def _configure_sub(self, sock: zmq.Socket, rank: int) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        if self.rcvhwm is not None:
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(self._endpoints[rank])

    def _configure_dealer(self, sock: zmq.Socket, rank: int) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # a whole replay must fit
        sock.connect(self._replay_endpoints[rank])

    def _idle_ranks(self) -> list[int]:
        """Ranks silent for ``idle_check`` seconds: replaying from their last seq finds a tail
        that the PUB dropped (nothing later would reveal that gap)."""
        if self.idle_check is None or not self._replay_endpoints:
            return []
        now = time.monotonic()
        idle = [r for r, t in self._heard.items() if now - t >= self.idle_check]
        for rank in idle:
            self._heard[rank] = now
        return idle


class Subscriber(_Base):
    """Keeps a mirror of ``ranks`` (a count, or a list of rank numbers) of one daemon.

    ``receive(timeout)`` returns the batches applied meanwhile, in seq order per rank;
    ``catch_up()`` also asks replay for anything published since the last seq; iterating
    yields batches forever. ``counters`` / ``rank_counters(r)`` say what happened, and the
    ``on_*`` callbacks report it as it happens. ``rcvhwm`` sets the SUB sockets' receive
    high-water mark; ``idle_check`` (seconds) replays a rank that has been silent that long.
    ``control`` (an endpoint or a ControlClient) enables the epoch check and snapshot resync."""

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def catch_up(self) -> list[Received]:
        """Replay every rank from its last seq (from 0 at first) and apply what comes."""
        self.tracker.catch_up()
        self._service()
        return self._take()

    def receive(self, timeout: float) -> list[Received]:
        """Batches applied within ``timeout`` seconds (less if some are ready at once)."""
        self._service()
        poller = zmq.Poller()
        for sock in self._subs.values():
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(0 if self._ready else int(timeout * 1000)))
        tracker = self.tracker
        for rank in self.ranks:
            if self._subs[rank] not in ready:
                continue
            self._heard[rank] = time.monotonic()
            for _ in range(BURST):
                try:
                    frames = self._subs[rank].recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._ready.extend(tracker.on_live(rank, frames))
                self._service()
        idle = self._idle_ranks()
        if idle:
            tracker.catch_up(idle)
            self._service()
        return self._take()

    def __iter__(self) -> Iterator[Received]:
        yield from self.catch_up()
        while True:
            yield from self.receive(0.1)

    # -- carrying out the tracker's requests ---------------------------------------------

    def _service(self) -> None:
        """Carry out what the tracker asks until it asks for nothing more."""
        tracker = self.tracker
        while (request := tracker.next_request()) is not None:
            try:
                self._ready.extend(self._perform(request))
            except TimeoutError:
                tracker.on_timeout()
                raise

    def _perform(self, request: Request) -> list[Received]:
        tracker = self.tracker
        if isinstance(request, Replay):
            batches = self._replay(request.rank, request.start)
            self._heard[request.rank] = time.monotonic()
            return tracker.on_replay(request.rank, request.start, batches)
        if isinstance(request, Reconnect):
            self._subs[request.rank].close()
            self._subs[request.rank] = self._open_sub(request.rank)
            tracker.on_reconnected(request.rank)
            return []
        assert self._control is not None
        if isinstance(request, Ping):
            tracker.on_ping(self._control.call("ping"))
            return []
        assert isinstance(request, Snapshot)
        return tracker.on_snapshot(request.rank, self._control.call("snapshot", rank=request.rank))

    def _open_sub(self, rank: int) -> zmq.Socket:
        sock = self._context.socket(zmq.SUB)
        self._configure_sub(sock, rank)
        return sock

    def _replay(self, rank: int, start: int) -> list[tuple[int, bytes]]:
        sock = self._dealers.get(rank)
        if sock is None:
            sock = self._dealers[rank] = self._context.socket(zmq.DEALER)
            self._configure_dealer(sock, rank)
        sock.send_multipart([b"", pack_seq(start)])
        batches: list[tuple[int, bytes]] = []
        while True:
            if not sock.poll(int(self.replay_timeout * 1000)):
                # A fresh socket next time, so a late answer is never taken for the next one.
                self._dealers.pop(rank).close()
                endpoint = self._replay_endpoints[rank]
                raise SubscriberTimeout(f"replay from {endpoint} did not finish")
            try:
                item = parse_replay_message(sock.recv_multipart())
            except ValueError:
                continue  # unusable: the hole it leaves is repaired like any other
            if item is None:
                return batches
            batches.append(item)


class AsyncSubscriber(_Base):
    """``Subscriber`` for asyncio: the same arguments and views; ``catch_up`` and ``receive``
    are coroutines and ``async for`` yields batches forever. ``control`` is an endpoint or an
    object with a coroutine ``call(op, **fields)`` (like ``AsyncControlClient``)."""

    _context_class = zmq.asyncio.Context
    _control_class = AsyncControlClient

    async def __aenter__(self) -> AsyncSubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def catch_up(self) -> list[Received]:
        self.tracker.catch_up()
        await self._service()
        return self._take()

    async def receive(self, timeout: float) -> list[Received]:
        await self._service()
        poller = zmq.asyncio.Poller()
        for sock in self._subs.values():
            poller.register(sock, zmq.POLLIN)
        ready = dict(await poller.poll(0 if self._ready else int(timeout * 1000)))
        tracker = self.tracker
        for rank in self.ranks:
            if self._subs[rank] not in ready:
                continue
            self._heard[rank] = time.monotonic()
            for _ in range(BURST):
                try:
                    frames = await self._subs[rank].recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._ready.extend(tracker.on_live(rank, frames))
                await self._service()
        idle = self._idle_ranks()
        if idle:
            tracker.catch_up(idle)
            await self._service()
        return self._take()

    async def __aiter__(self) -> AsyncIterator[Received]:
        for received in await self.catch_up():
            yield received
        while True:
            for received in await self.receive(0.1):
                yield received

    async def _service(self) -> None:
        tracker = self.tracker
        while (request := tracker.next_request()) is not None:
            try:
                self._ready.extend(await self._perform(request))
            except TimeoutError:
                tracker.on_timeout()
                raise

    async def _perform(self, request: Request) -> list[Received]:
        tracker = self.tracker
        if isinstance(request, Replay):
            batches = await self._replay(request.rank, request.start)
            self._heard[request.rank] = time.monotonic()
            return tracker.on_replay(request.rank, request.start, batches)
        if isinstance(request, Reconnect):
            self._subs[request.rank].close()
            self._subs[request.rank] = self._open_sub(request.rank)
            tracker.on_reconnected(request.rank)
            return []
        assert self._control is not None
        if isinstance(request, Ping):
            tracker.on_ping(await self._control.call("ping"))
            return []
        assert isinstance(request, Snapshot)
        reply = await self._control.call("snapshot", rank=request.rank)
        return tracker.on_snapshot(request.rank, reply)

    def _open_sub(self, rank: int) -> zmq.asyncio.Socket:
        sock = self._context.socket(zmq.SUB)
        self._configure_sub(sock, rank)
        return sock

    async def _replay(self, rank: int, start: int) -> list[tuple[int, bytes]]:
        sock = self._dealers.get(rank)
        if sock is None:
            sock = self._dealers[rank] = self._context.socket(zmq.DEALER)
            self._configure_dealer(sock, rank)
        await sock.send_multipart([b"", pack_seq(start)])
        batches: list[tuple[int, bytes]] = []
        while True:
            if not await sock.poll(int(self.replay_timeout * 1000)):
                self._dealers.pop(rank).close()
                endpoint = self._replay_endpoints[rank]
                raise SubscriberTimeout(f"replay from {endpoint} did not finish")
            try:
                item = parse_replay_message(await sock.recv_multipart())
            except ValueError:
                continue
            if item is None:
                return batches
            batches.append(item)
