"""Subscribers that keep a mirror of one or more ranks' published cache: ``Subscriber``
(blocking) and ``AsyncSubscriber`` (asyncio). Both are I/O shells around one
``kvpubd.client.tracker.StreamTracker``, which decides everything: they read the SUB sockets, feed
the tracker, and carry out what it asks for (replay through a DEALER, control ``ping`` and
``snapshot``, reconnecting a SUB socket) until it asks for nothing more.

``endpoint`` and ``replay_endpoint`` are the daemon's configured base endpoints; each rank's own
endpoint is derived from them as the daemon does. ``control`` (an endpoint or a client) enables
the epoch check and the snapshot resync; without it, history that replay no longer holds is
counted as ``lost`` and the rank's mirror waits for the next ``AllBlocksCleared``.

With ``snapshot_endpoint`` (a publisher serving the snapshot protocol: a kvpubd daemon with
``events.snapshot_endpoint``, or a vLLM engine), each rank is followed by a
``kvpubd.client.bootstrap.SnapshotTracker`` instead: it bootstraps from a snapshot and, on a
gap, a new publisher_id or a silence, bootstraps again. Replay and control play no part then
(passing them too is refused).

``host_medium`` (a daemon with a host tier: its ``cache.host_medium``, ``"CPU"``) keeps the
mirror's host tier apart: events naming that medium go to ``Mirror.host_blocks``. A hybrid
model's KV cache groups need nothing: the mirror keeps each group's blocks apart by itself
(``Mirror.group_blocks``).

A replay, snapshot or control request that gets no answer raises ``TimeoutError``
(``SubscriberTimeout`` or ``ControlTimeout``) from the call that needed it; the request is kept
and retried by the next call, so a caller that waits out a daemon restart just calls again."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio

from kvpubd.client.bootstrap import FetchSnapshot, SnapshotTracker
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
from kvpubd.protocol.endpoints import check_endpoint, rank_endpoint
from kvpubd.protocol.snapshot_wire import SNAPSHOT_REQUEST
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
# Restarts within one call past which the daemon's answers are taken to contradict each other.
MAX_RESTARTS_PER_CALL = 16

SyncContext = zmq.Context[zmq.Socket[bytes]]
ContextT = TypeVar("ContextT", SyncContext, zmq.asyncio.Context)
ControlT = TypeVar("ControlT", ControlClient, AsyncControlClient)


class SubscriberTimeout(TimeoutError):
    """A replay or snapshot did not finish in time (the publisher is down or overloaded);
    retried next call."""


def parse_replay_message(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one replay message, None for the end marker. Works for both framings:
    ``[b"", topic, seq, payload]`` (v026) and ``[b"", seq, payload]`` (legacy)."""
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise ValueError(f"replay message has {len(frames)} frames")
    seq_frame, payload = frames[-2], frames[-1]
    if seq_frame == END_SEQ:
        return None
    return unpack_seq(seq_frame), payload


class ReplayTooLarge(SubscriberTimeout):
    """A replay answer ran past its byte budget (handled as one that did not finish)."""


class ReplayReader:
    """Collects one replay's answer, message by message: ``add(frames)`` until it returns
    True (the end marker came); ``batches`` are then (seq, payload) in the order received.
    Batches published under a topic that ``topic`` does not prefix are left out, as a SUB
    socket would leave them out (legacy framing carries no topic: all are kept)."""

    def __init__(self, topic: bytes = b"", max_bytes: int | None = None) -> None:
        self.topic = topic
        self.batches: list[tuple[int, bytes]] = []
        self.max_bytes = MAX_REPLAY_BYTES if max_bytes is None else max_bytes
        self.received_bytes = 0

    def add(self, frames: list[bytes]) -> bool:
        self.received_bytes += sum(map(len, frames))
        if self.received_bytes > self.max_bytes:
            # Given up: a publisher streaming batches with no end grew the subscriber by a
            # gigabyte in seconds.
            raise ReplayTooLarge(f"a replay answer over {self.max_bytes} bytes: given up")
        try:
            item = parse_replay_message(frames)
        except ValueError:
            return False  # unusable: the hole it leaves is repaired like any other
        if item is None:
            return True
        if len(frames) == 4 and not frames[1].startswith(self.topic):
            return False
        self.batches.append(item)
        return False


# A replay must finish within this many replay timeouts in all, not only without a silence
# that long: a publisher that sends a batch just before each timeout would hold a catch_up
# for ever. The daemon's whole ring streams in a fraction of one timeout.
REPLAY_TOTAL_TIMEOUTS = 6
# Bytes of one replay answer at most: twice a daemon's whole ring (events.buffer_bytes, 512 MiB).
MAX_REPLAY_BYTES = 1 << 30


def _replay_request(start_seq: int) -> list[bytes]:
    return [b"", pack_seq(start_seq)]


def _read_replay(
    sock: zmq.Socket[bytes], start_seq: int, timeout: float, topic: bytes
) -> list[tuple[int, bytes]] | None:
    """Ask ``sock`` (a connected DEALER) for every batch from ``start_seq``; None when the
    answer did not finish within ``timeout`` seconds of silence, or within
    ``REPLAY_TOTAL_TIMEOUTS`` times that in all (a replay that trickles ends too);
    ReplayTooLarge (from the reader) past MAX_REPLAY_BYTES."""
    sock.send_multipart(_replay_request(start_seq))
    reader = ReplayReader(topic)
    deadline = time.monotonic() + REPLAY_TOTAL_TIMEOUTS * timeout
    while True:
        left = min(timeout, deadline - time.monotonic())
        if left <= 0 or not sock.poll(int(left * 1000)):
            return None
        if reader.add(sock.recv_multipart()):
            return reader.batches


def replay(
    endpoint: str,
    start_seq: int,
    *,
    timeout: float = 5.0,
    topic: str = "",
    context: SyncContext | None = None,
) -> list[tuple[int, bytes]]:
    """Ask a replay socket for every retained batch from ``start_seq``: [(seq, payload)].
    Raises SubscriberTimeout when the answer does not finish in time."""
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(check_endpoint(endpoint))
        batches = _read_replay(sock, start_seq, timeout, topic.encode())
    finally:
        sock.close()
    if batches is None:
        raise SubscriberTimeout(f"replay from {endpoint} did not finish")
    return batches


def _check_snapshot_arguments(
    replay_endpoint: str | None, control: object, idle_check: float | None, timeout: float
) -> None:
    """The snapshot protocol repairs by bootstrapping again: replay, control and idle_check
    (which serve the other repair) would be silently unused, so they are refused."""
    given = [
        name
        for name, value in (
            ("replay_endpoint", replay_endpoint),
            ("control", control),
            ("idle_check", idle_check),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"snapshot_endpoint replaces {' and '.join(given)}: a rank that follows the snapshot "
            "protocol bootstraps again instead of replaying (pass one or the other)"
        )
    if not timeout > 0:
        raise ValueError(f"snapshot_timeout: {timeout} is not a positive number of seconds")


class _Base(Generic[ContextT, ControlT]):
    """What both forms share: arguments, sockets, the tracker and the read-only views; the
    forms add only the waiting (blocking or awaited) around the same steps."""

    # The forms differ in these: plain or asyncio ZeroMQ, sync or async control client.
    _context_class: type[ContextT]

    def _new_control(self, endpoint: str, timeout: float) -> ControlT:
        raise NotImplementedError

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        control: str | ControlT | None = None,
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
        context: ContextT | None = None,
        snapshot_endpoint: str | None = None,
        snapshot_timeout: float = 10.0,
        silence_timeout: float = 5.0,
        host_medium: str | None = None,
    ) -> None:
        if snapshot_endpoint:
            check_endpoint(snapshot_endpoint)
            _check_snapshot_arguments(replay_endpoint, control, idle_check, snapshot_timeout)
        if not replay_timeout > 0:
            raise ValueError(
                f"replay_timeout: {replay_timeout} is not a positive number of seconds"
            )
        if idle_check is not None and not idle_check > 0:
            raise ValueError(f"idle_check: {idle_check} is not a positive number of seconds")
        check_endpoint(endpoint)
        if replay_endpoint:
            check_endpoint(replay_endpoint)
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
        self.snapshot_timeout = snapshot_timeout
        self._snapshot_endpoints = (
            {r: rank_endpoint(snapshot_endpoint, r) for r in rank_list} if snapshot_endpoint else {}
        )
        callbacks = Callbacks(on_batch, on_gap, on_resync, on_restart)
        self.tracker: StreamTracker | SnapshotTracker
        if snapshot_endpoint:
            self.tracker = SnapshotTracker(
                rank_list,
                keep_mirror=mirror,
                callbacks=callbacks,
                silence_timeout=silence_timeout,
                host_medium=host_medium,
            )
        else:
            self.tracker = StreamTracker(
                rank_list,
                replay=bool(replay_endpoint),
                control=control is not None,
                keep_mirror=mirror,
                callbacks=callbacks,
                host_medium=host_medium,
            )
        self._heard = dict.fromkeys(rank_list, time.monotonic())
        # Applied and not yet returned: survives a call that raised (timeout) midway.
        self._ready: list[Received] = []
        self._closed = False
        self._own_context = context is None
        self._context: ContextT = context if context is not None else self._context_class()
        self._own_control = isinstance(control, str)
        self._control: ControlT | None = (
            self._new_control(control, control_timeout) if isinstance(control, str) else control
        )
        self._subs = {rank: self._open(zmq.SUB, rank) for rank in self.ranks}
        self._dealers: dict[int, Any] = {}

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

    def _check_restarts(self, before: int | None) -> int:
        """SubscriberError once one call has started over MAX_RESTARTS_PER_CALL times: answers
        that contradict each other for good (a ping and a snapshot of two daemon runs, from a
        buggy daemon or a proxy in front of two) restarted it for ever, never returning.
        Returns the restarts counted before the call's first request (``before``, once set)."""
        restarts = self.tracker.counters().restarts
        if before is None:
            return restarts
        if restarts - before > MAX_RESTARTS_PER_CALL:
            raise SubscriberError(
                f"started over {MAX_RESTARTS_PER_CALL} times in one call: the daemon's answers "
                "contradict each other (are two daemon runs behind one endpoint?)"
            )
        return before

    def synced(self, rank: int = 0) -> bool:
        """False while the rank's mirror misses lost history (until the next reset marker)."""
        return self.tracker.streams[rank].synced

    def last_seq(self, rank: int = 0) -> int | None:
        return self.tracker.streams[rank].last

    def publisher_id(self, rank: int = 0) -> bytes | None:
        """The 16-byte id of the publisher lifetime that the rank's mirror comes from (snapshot
        protocol only; None before the first bootstrap, and without ``snapshot_endpoint``)."""
        tracker = self.tracker
        return tracker.streams[rank].publisher_id if isinstance(tracker, SnapshotTracker) else None

    @property
    def epoch(self) -> int | None:
        return self.tracker.epoch

    # -- the steps both forms take -------------------------------------------------------

    def _open(self, kind: int, rank: int) -> Any:
        """A SUB socket for the rank's events, or a DEALER for its replay."""
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            if self.rcvhwm is not None:
                sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            sock.connect(self._endpoints[rank])
        else:
            sock.setsockopt(zmq.RCVHWM, 0)  # a whole replay must fit
            sock.connect(self._replay_endpoints[rank])
        return sock

    def _dealer(self, rank: int) -> Any:
        sock = self._dealers.get(rank)
        if sock is None:
            sock = self._dealers[rank] = self._open(zmq.DEALER, rank)
        return sock

    @property
    def _replaying(self) -> StreamTracker:
        """The tracker of a subscriber that repairs by replay (no snapshot_endpoint)."""
        assert isinstance(self.tracker, StreamTracker)
        return self.tracker

    @property
    def _bootstrapping(self) -> SnapshotTracker:
        """The tracker of a subscriber that follows the snapshot protocol."""
        assert isinstance(self.tracker, SnapshotTracker)
        return self.tracker

    def _replayed(self, request: Replay, batches: list[tuple[int, bytes]] | None) -> list[Received]:
        """Apply a finished replay; a replay that timed out (None) raises SubscriberTimeout."""
        if batches is None:
            # A fresh socket next time, so a late answer is never taken for the next one.
            self._dealers.pop(request.rank).close()
            endpoint = self._replay_endpoints[request.rank]
            raise SubscriberTimeout(f"replay from {endpoint} did not finish")
        self._heard[request.rank] = time.monotonic()
        return self._replaying.on_replay(request.rank, request.start, batches)

    def _reconnect(self, request: Reconnect) -> list[Received]:
        self._subs[request.rank].close()
        self._subs[request.rank] = self._open(zmq.SUB, request.rank)
        self._replaying.on_reconnected(request.rank)
        return []

    def _controlled(self, request: Ping | Snapshot, reply: Mapping[str, Any]) -> list[Received]:
        if isinstance(request, Ping):
            self._replaying.on_ping(reply)
            return []
        return self._replaying.on_snapshot(request.rank, reply)

    @staticmethod
    def _control_request(request: Ping | Snapshot) -> tuple[str, dict[str, object]]:
        return ("ping", {}) if isinstance(request, Ping) else ("snapshot", {"rank": request.rank})

    def _heard_from(self, ready: Mapping[Any, int]) -> list[int]:
        """The ranks whose SUB socket has messages, noted as heard from now."""
        ranks = [rank for rank in self.ranks if self._subs[rank] in ready]
        for rank in ranks:
            self._heard[rank] = time.monotonic()
        return ranks

    def _poller(self) -> Any:
        poller = zmq.Poller() if self._context_class is zmq.Context else zmq.asyncio.Poller()
        for sock in self._subs.values():
            poller.register(sock, zmq.POLLIN)
        return poller

    def _wait_ms(self, timeout: float) -> int:
        """How long to poll the SUB sockets: ``timeout``, cut short when batches are ready or
        a timed step (a snapshot retry, a silence) comes due first."""
        if self._ready:
            return 0
        if isinstance(self.tracker, SnapshotTracker):
            due = self.tracker.wake_in()
            if due is not None:
                timeout = min(timeout, due)
        return int(timeout * 1000)

    def _timed_steps(self) -> bool:
        """After reading the SUB sockets: what silence asks for (a replay of ranks idle for
        ``idle_check``, a bootstrap of ranks silent for ``silence_timeout``). True when the
        tracker has a request to carry out."""
        if isinstance(self.tracker, SnapshotTracker):
            self.tracker.tick()
            return self.tracker.next_request() is not None
        return bool(self._idle_ranks())

    def _idle_ranks(self) -> list[int]:
        """Ranks silent for ``idle_check`` seconds: replaying from their last seq finds a tail
        that the PUB dropped (nothing later would reveal that gap). Asks the tracker for it."""
        if self.idle_check is None or not self._replay_endpoints:
            return []
        now = time.monotonic()
        idle = [r for r, t in self._heard.items() if now - t >= self.idle_check]
        for rank in idle:
            self._heard[rank] = now
        if idle:
            self._replaying.catch_up(idle)
        return idle

    # -- the snapshot protocol's steps ---------------------------------------------------

    def _snapshot_socket(self, rank: int) -> Any:
        """A fresh REQ socket per attempt: a late reply to an abandoned one is never read."""
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._snapshot_endpoints[rank])
        return sock

    def _snapshot_timed_out(self, request: FetchSnapshot) -> SubscriberTimeout:
        self._bootstrapping.on_snapshot_timeout(request)
        endpoint = self._snapshot_endpoints[request.rank]
        return SubscriberTimeout(
            f"no snapshot from {endpoint} within {self.snapshot_timeout} s (asked again next call)"
        )

    def _bootstrap_stalled(self, progress: list[float]) -> None:
        """For catch_up: SubscriberTimeout once no rank got ready for ``snapshot_timeout``
        seconds (``progress``: [ready ranks, time of the last change], kept by the caller)."""
        now, ready = time.monotonic(), sum(s.synced for s in self.tracker.streams.values())
        if ready > progress[0]:
            progress[:] = [ready, now]
        elif now - progress[1] > self.snapshot_timeout:
            waiting = [r for r, s in self.tracker.streams.items() if not s.synced]
            raise SubscriberTimeout(
                f"rank(s) {waiting} not bootstrapped within {self.snapshot_timeout} s: "
                "no live message, or no usable snapshot (asked again next call)"
            )


class Subscriber(_Base[SyncContext, ControlClient]):
    """Keeps a mirror of ``ranks`` (a count, or a list of rank numbers) of one daemon, or of
    single-rank daemons sharing base endpoints (``cache.data_parallel_start_rank``).

    ``receive(timeout)`` returns the batches applied meanwhile, in seq order per rank;
    ``catch_up()`` also asks replay for anything published since the last seq (with
    ``snapshot_endpoint``: waits until every rank is bootstrapped); iterating yields batches
    forever. ``counters`` / ``rank_counters(r)`` say what happened, and the ``on_*`` callbacks
    report it as it happens. ``rcvhwm`` sets the SUB sockets' receive high-water mark;
    ``idle_check`` (seconds) replays a rank that has been silent that long. ``control`` (an
    endpoint or a ControlClient) enables the epoch check and snapshot resync.
    ``snapshot_endpoint`` follows the snapshot protocol instead (see the module's docstring):
    ``snapshot_timeout`` bounds one snapshot request, ``silence_timeout`` the silence after
    which a ready rank bootstraps again."""

    _context_class = zmq.Context

    def _new_control(self, endpoint: str, timeout: float) -> ControlClient:
        return ControlClient(endpoint, timeout, self._context)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def catch_up(self) -> list[Received]:
        """Replay every rank from its last seq (from 0 at first) and apply what comes; with
        ``snapshot_endpoint``, wait until every rank is bootstrapped (SubscriberTimeout when
        none gets ready for ``snapshot_timeout`` seconds)."""
        if isinstance(self.tracker, SnapshotTracker):
            self._receive(0)  # what is queued already, ready ranks or not
            progress = [-1.0, 0.0]
            while not self.tracker.all_ready():
                self._bootstrap_stalled(progress)
                self._receive(0.05)
            return self._take()
        self.tracker.catch_up()
        self._service()
        return self._take()

    def receive(self, timeout: float) -> list[Received]:
        """Batches applied within ``timeout`` seconds (less if some are ready at once)."""
        self._receive(timeout)
        return self._take()

    def _receive(self, timeout: float) -> None:
        self._service()
        self._drain(dict(self._poller().poll(self._wait_ms(timeout))), service=True)
        if self._timed_steps():
            self._service()

    def _drain(self, ready: Mapping[Any, int], service: bool) -> None:
        """Feed the tracker what the ready SUB sockets hold (a burst per rank); ``service``:
        carry out its requests after each message."""
        for rank in self._heard_from(ready):
            for _ in range(BURST):
                try:
                    frames = self._subs[rank].recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._ready.extend(self.tracker.on_live(rank, frames))
                if service:
                    self._service()

    def __iter__(self) -> Iterator[Received]:
        yield from self.catch_up()
        while True:
            yield from self.receive(0.1)

    def _service(self) -> None:
        """Carry out what the tracker asks until it asks for nothing more."""
        restarts: int | None = None  # counted from the first request on (most calls have none)
        while (request := self.tracker.next_request()) is not None:
            restarts = self._check_restarts(restarts)
            try:
                self._ready.extend(self._perform(request))
            except TimeoutError:
                self.tracker.on_timeout()
                raise

    def _perform(self, request: Request | FetchSnapshot) -> list[Received]:
        if isinstance(request, FetchSnapshot):
            return self._fetch_snapshot(request)
        if isinstance(request, Replay):
            batches = _read_replay(
                self._dealer(request.rank), request.start, self.replay_timeout, self.topic
            )
            return self._replayed(request, batches)
        if isinstance(request, Reconnect):
            return self._reconnect(request)
        assert self._control is not None
        op, fields = self._control_request(request)
        return self._controlled(request, self._control._call(op, **fields))

    def _fetch_snapshot(self, request: FetchSnapshot) -> list[Received]:
        """Ask for the rank's snapshot and wait for it, buffering (through the tracker) what
        every SUB socket receives meanwhile."""
        tracker = self._bootstrapping
        sock = self._snapshot_socket(request.rank)
        try:
            sock.send(SNAPSHOT_REQUEST)
            poller = self._poller()
            poller.register(sock, zmq.POLLIN)
            deadline = time.monotonic() + self.snapshot_timeout
            while tracker.awaiting(request):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._snapshot_timed_out(request)
                ready = dict(poller.poll(max(1, int(left * 1000))))
                if sock in ready:
                    return tracker.on_snapshot(request, sock.recv_multipart())
                self._drain(ready, service=False)
            return []  # a buffer overflow dropped the request
        finally:
            sock.close()


class AsyncSubscriber(_Base[zmq.asyncio.Context, AsyncControlClient]):
    """``Subscriber`` for asyncio: the same arguments and views; ``catch_up`` and ``receive``
    are coroutines and ``async for`` yields batches forever. ``control`` is an endpoint or an
    ``AsyncControlClient``."""

    _context_class = zmq.asyncio.Context

    def _new_control(self, endpoint: str, timeout: float) -> AsyncControlClient:
        return AsyncControlClient(endpoint, timeout, self._context)

    async def __aenter__(self) -> AsyncSubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def catch_up(self) -> list[Received]:
        if isinstance(self.tracker, SnapshotTracker):
            await self._receive(0)
            progress = [-1.0, 0.0]
            while not self.tracker.all_ready():
                self._bootstrap_stalled(progress)
                await self._receive(0.05)
            return self._take()
        self.tracker.catch_up()
        await self._service()
        return self._take()

    async def receive(self, timeout: float) -> list[Received]:
        await self._receive(timeout)
        return self._take()

    async def _receive(self, timeout: float) -> None:
        await self._service()
        await self._drain(dict(await self._poller().poll(self._wait_ms(timeout))), service=True)
        if self._timed_steps():
            await self._service()

    async def _drain(self, ready: Mapping[Any, int], service: bool) -> None:
        for rank in self._heard_from(ready):
            for _ in range(BURST):
                try:
                    frames = await self._subs[rank].recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._ready.extend(self.tracker.on_live(rank, frames))
                if service:
                    await self._service()

    async def __aiter__(self) -> AsyncIterator[Received]:
        for received in await self.catch_up():
            yield received
        while True:
            for received in await self.receive(0.1):
                yield received

    async def _service(self) -> None:
        restarts: int | None = None  # counted from the first request on (most calls have none)
        while (request := self.tracker.next_request()) is not None:
            restarts = self._check_restarts(restarts)
            try:
                self._ready.extend(await self._perform(request))
            except TimeoutError:
                self.tracker.on_timeout()
                raise

    async def _perform(self, request: Request | FetchSnapshot) -> list[Received]:
        if isinstance(request, FetchSnapshot):
            return await self._fetch_snapshot(request)
        if isinstance(request, Replay):
            batches = await self._read_replay(request.rank, request.start)
            return self._replayed(request, batches)
        if isinstance(request, Reconnect):
            return self._reconnect(request)
        assert self._control is not None
        op, fields = self._control_request(request)
        return self._controlled(request, await self._control._call(op, **fields))

    async def _fetch_snapshot(self, request: FetchSnapshot) -> list[Received]:
        """``Subscriber._fetch_snapshot`` awaited: the same request, the same buffering."""
        tracker = self._bootstrapping
        sock = self._snapshot_socket(request.rank)
        try:
            await sock.send(SNAPSHOT_REQUEST)
            poller = self._poller()
            poller.register(sock, zmq.POLLIN)
            deadline = time.monotonic() + self.snapshot_timeout
            while tracker.awaiting(request):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._snapshot_timed_out(request)
                ready = dict(await poller.poll(max(1, int(left * 1000))))
                if sock in ready:
                    return tracker.on_snapshot(request, await sock.recv_multipart())
                await self._drain(ready, service=False)
            return []
        finally:
            sock.close()

    async def _read_replay(self, rank: int, start: int) -> list[tuple[int, bytes]] | None:
        """``_read_replay`` awaited: the same request and the same reader."""
        sock = self._dealer(rank)
        await sock.send_multipart(_replay_request(start))
        reader = ReplayReader(self.topic)
        deadline = time.monotonic() + REPLAY_TOTAL_TIMEOUTS * self.replay_timeout
        while True:
            left = min(self.replay_timeout, deadline - time.monotonic())
            if left <= 0 or not await sock.poll(int(left * 1000)):
                return None
            if reader.add(await sock.recv_multipart()):
                return reader.batches
