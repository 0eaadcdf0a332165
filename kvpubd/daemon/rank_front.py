"""The control ops of a service of rank processes: each request answered here or forwarded,
as it came, to the worker of the rank it concerns.

What spans ranks is decided here, as ``Operations`` decides it in one process: request ids are
unique across ranks (this side knows which rank holds each open request), a ``reset`` of
several ranks checks all of them before any is reset and then resets them in parallel, one
worker each; ``stats``, ``pause`` and ``resume`` go to every rank and come back as one reply;
``ping`` is answered from what each worker said when it started. Everything about one rank
(``store``, ``release``, ``snapshot``, ``pool_info``, ``checksum``) is the worker's: it
checks the request again and answers it, and its reply goes back to the client unchanged.

A rank whose worker is not running (it died and is being started again) answers
``unavailable``; so does a reset that targets it, or a worker that answers no ping (hung, until
the watchdog kills it), which then resets no rank."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq

from kvpubd import __version__
from kvpubd.daemon.cache import CacheError
from kvpubd.daemon.control_server import Reply, Route
from kvpubd.daemon.hooks import MetricsHooks
from kvpubd.daemon.operations import failure_reply, settled_reply
from kvpubd.daemon.owners import Owner, RequestId, RequestOwners
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.rank_link import Conn, LinkLost, RankLink
from kvpubd.daemon.settings import Settings
from kvpubd.protocol.control import (
    Batch,
    BatchReply,
    Checksum,
    Computed,
    ControlReply,
    Marker,
    Pause,
    PauseReply,
    Ping,
    PingReply,
    PoolInfoRequest,
    RankEndpoints,
    RankStats,
    Release,
    Request,
    Reset,
    ResetReply,
    Resume,
    Snapshot,
    Stats,
    StatsReply,
    Store,
    error_reply,
    ok_reply,
    ok_reply_head,
    op_of,
)

log = logging.getLogger("kvpubd")

R = TypeVar("R", bound=ControlReply)
# Requests forwarded to one worker and not answered yet, past which more are refused ``busy``
# (resets excepted): a client that pipelines without reading must not grow this process.
MAX_IN_FLIGHT = 4096
# ... and request bytes: 4096 stores of the largest size would be 16 GiB queued here.
MAX_BYTES_IN_FLIGHT = 256 << 20
# Replies passed on as their bytes below this size; larger ones (snapshots, checksums) go on
# without a copy.
COPY_BELOW = 64 << 10

_encoder = msgspec.msgpack.Encoder()


class _Replies(msgspec.Struct):
    replies: list[msgspec.Raw]


_replies_decoder = msgspec.msgpack.Decoder(_Replies)


class _Status(msgspec.Struct):
    ok: bool
    error: dict[str, Any] | None = None


_status_decoder = msgspec.msgpack.Decoder(_Status)
_any_decoder = msgspec.msgpack.Decoder()


def reply_error(frame: bytes | memoryview) -> str | None:
    """The error code of a reply, None for an ok one. Only error replies are decoded: an ok
    reply names itself in its first entry (``ok_reply`` writes ``ok`` first)."""
    head = bytes(frame[:8])
    ok_at = 1 if head and 0x80 <= head[0] <= 0x8F else 3
    if head[ok_at : ok_at + 3] == b"\xa2ok" and head[ok_at + 3 : ok_at + 4] == b"\xc3":
        return None
    try:
        status = _status_decoder.decode(frame)
    except msgspec.DecodeError:
        return "internal"
    if status.ok:
        return None
    code = (status.error or {}).get("code")
    return code if isinstance(code, str) else "internal"


def decode_ok(frame: zmq.Frame, reply_type: type[R]) -> R:
    """A worker's reply as ``reply_type``; CacheError with the worker's code if it refused."""
    reply = _any_decoder.decode(frame.buffer)
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        error = reply.get("error", {}) if isinstance(reply, dict) else {}
        raise CacheError(str(error.get("code", "internal")), str(error.get("message", reply)))
    return reply_type.parse(reply)


# Ops a client with nothing on its way to a worker sends on the priority connection (see
# rank_link): small, and what must not wait behind other clients' stores. A reset goes on the
# reset connection, where no other client's small ops are ahead of it.
PRIORITY_OPS = (Reset, Stats, Pause, Resume, Ping)
# A client's requests on the priority (or reset) connection at once; more wait here (see
# _send), so that one client's flood of small ops cannot queue far ahead of another's.
PRIORITY_DEPTH = 8


def conn_of(request: Request) -> Conn:
    """The connection a request goes on when its client has nothing on its way."""
    if isinstance(request, Reset):
        return Conn.RESET
    return Conn.PRIORITY if isinstance(request, PRIORITY_OPS) else Conn.BULK


@dataclass
class _Held:
    """A request waiting in its client's lane: where it goes, what it is, its reply to come,
    and the connection it goes on when nothing of its client is on its way (``conn_of``)."""

    link: RankLink
    body: bytes
    reply: Pending[zmq.Frame]
    conn: Conn


@dataclass
class _Lane:
    """The connection one client's requests to one worker are on, while any is on its way,
    and the requests of that client waiting here for those to be answered."""

    conn: Conn
    in_flight: int = 0
    held: list[_Held] = field(default_factory=list)


@dataclass
class _OpenRequest:
    rank: int
    # Stored, as far as this side knows: the worker answered the store ok. A store still on
    # its way counts as open (a reset must not miss it) but a forced reset cannot close it.
    confirmed: bool = False
    # Its client went away while the store was on its way: released once it is answered.
    orphaned: bool = False
    # What waits for the store's answer (a release sent meanwhile), run once it came (or it
    # never will: its worker died).
    waiting: list[Callable[[], None]] = field(default_factory=list)
    # The connection the store came on (its lane's): a release on the same one follows it in
    # order anyway, and need not wait.
    route: Route | None = None


class RankFront:
    """``links(rank)``: the rank's link to its worker, None while it is not running."""

    def __init__(
        self,
        settings: Settings,
        links: Callable[[int], RankLink | None],
        metrics: MetricsHooks,
        epoch: int,
        silent: Callable[[int], float | None] = lambda rank: None,
    ) -> None:
        self._settings = settings
        self._ranks: Sequence[int] = settings.cache.ranks
        self._links = links
        # How long a rank's worker has answered no ping, where that is long enough to call it
        # hung (None: it answers): a reset that would wait on it resets nothing.
        self._silent = silent
        self._metrics = metrics
        self.epoch = epoch
        self.paused = False
        # What each worker said at its last start (ping), by rank.
        self.endpoints: dict[int, RankEndpoints] = {}
        self._open: dict[RequestId, _OpenRequest] = {}
        # Open requests per rank, kept with _open: a reset's busy check must not walk them all.
        self._open_count: dict[int, int] = dict.fromkeys(self._ranks, 0)
        self._lanes: dict[tuple[Route, int], _Lane] = {}
        # Requests (and their bytes) held in lanes, by rank: counted against the in-flight caps.
        self._held: dict[int, list[int]] = {rank: [0, 0] for rank in self._ranks}
        self._route: Route | None = None  # of the request being handled (None: the service)
        self._conn = Conn.PRIORITY  # where it goes when its client has nothing on its way
        control = settings.control
        self.owners = RequestOwners(
            self._release_orphan,
            control.orphan_grace_ms / 1000 if control.release_orphans else None,
        )
        self._handlers: dict[type, Callable[[Any, Owner | None, bytes], Reply]] = {
            Ping: self._ping,
            Stats: self._stats,
            Pause: self._pause,
            Resume: self._pause,
            Store: self._store,
            Release: self._release,
            Computed: self._computed,
            Reset: self._reset,
            Snapshot: self._forward_to_rank,
            PoolInfoRequest: self._forward_to_rank,
            Checksum: self._forward_to_rank,
            Batch: self._batch,
        }

    # -- the control server's handler --------------------------------------------------------

    def handle(
        self, request: Request, owner: Owner | None = None, frame: bytes = b"", route: Route = ()
    ) -> Reply:
        op = op_of(request)
        self._route, self._conn = route, conn_of(request)
        try:
            reply = self._handlers[type(request)](request, owner, frame)
        except CacheError as exc:
            self._metrics.control(op, exc.code)
            return error_reply(request.id, exc.code, exc.message)
        except Exception as exc:  # a bug: answer it, keep serving
            log.exception("control: %s failed", op)
            self._metrics.control(op, "internal")
            return error_reply(request.id, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            self._route, self._conn = None, Conn.PRIORITY
        if isinstance(reply, bytes):
            self._metrics.control(op, reply_error(reply))
        else:
            reply.then(lambda value, _: self._metrics.control(op, _code_of(value)))
        return reply

    # -- what the service tells it -----------------------------------------------------------

    def worker_started(self, rank: int, endpoints: RankEndpoints) -> None:
        self.endpoints[rank] = endpoints

    def worker_lost(self, rank: int) -> None:
        """The rank's worker died: its open requests died with it (a new worker starts with
        an empty cache, its first batch AllBlocksCleared)."""
        for request_id in [i for i, entry in self._open.items() if entry.rank == rank]:
            self._forget(request_id)
            self.owners.drop(request_id)

    def open_requests(self, rank: int) -> int:
        return self._open_count[rank]

    def _forget(self, request_id: RequestId) -> _OpenRequest | None:
        """Take ``request_id`` out of the open requests (None if it was not open)."""
        entry = self._open.pop(request_id, None)
        if entry is not None:
            self._open_count[entry.rank] -= 1
        return entry

    @staticmethod
    def _run_waiting(entry: _OpenRequest) -> None:
        waiting, entry.waiting = entry.waiting, []
        for then in waiting:
            then()

    # -- ops answered here -------------------------------------------------------------------

    def _ping(self, request: Ping, owner: Owner | None, frame: bytes) -> bytes:
        endpoints = [self.endpoints[r] for r in self._ranks if r in self.endpoints]
        return ok_reply(request.id, PingReply(__version__, self.epoch, len(self._ranks), endpoints))

    def _stats(self, request: Stats, owner: Owner | None, frame: bytes) -> Reply:
        self._check_rooms()
        replies = self._to_all([(rank, _encoder.encode(Stats())) for rank in self._ranks])

        def merge(frames: list[zmq.Frame]) -> bytes:
            ranks: list[RankStats] = []
            for reply in frames:
                ranks += decode_ok(reply, StatsReply).ranks
            return ok_reply(request.id, StatsReply(self.epoch, self.paused, ranks))

        return self._answer(request, replies.map(merge))

    def _pause(self, request: Pause | Resume, owner: Owner | None, frame: bytes) -> Reply:
        self._check_rooms()
        body = _encoder.encode(Pause() if isinstance(request, Pause) else Resume())
        replies = self._to_all([(rank, body) for rank in self._ranks])  # all ranks, or none
        self.paused = isinstance(request, Pause)
        log.info("periodic drain %s on every rank", "paused" if self.paused else "resumed")
        return self._answer(
            request, replies.map(lambda _: ok_reply(request.id, PauseReply(self.paused)))
        )

    def apply_pause(self, rank: int) -> Pending[zmq.Frame] | None:
        """For a worker just started: pause it if the service is paused."""
        if not self.paused:
            return None
        return self._link(rank).request(_encoder.encode(Pause()))

    # -- ops of one rank ---------------------------------------------------------------------

    def _store(self, request: Store, owner: Owner | None, frame: bytes) -> Reply:
        request_id = request.request_id
        entry = self._open_store(request_id, self._rank(request.rank), owner)
        reply = self._forward(self._link(entry.rank), frame)

        def settle(value: bytes | memoryview | None, _: BaseException | None) -> None:
            self._settle_store(request_id, entry, bytes(value) if value is not None else None)

        reply.then(settle)
        return self._answer(request, reply)

    def _release(self, request: Release, owner: Owner | None, frame: bytes) -> Reply:
        entry = self._open.get(request.request_id)
        if entry is None or not self._must_wait(entry):
            rank = self._close_request(request.request_id)
            return self._answer(request, self._forward(self._link(rank), frame))
        # Its store is still on its way, maybe held in its client's lane behind that client's
        # other requests: sent at once from another connection, the release reached the worker
        # first (unknown_request) and the store then pinned its blocks for good. It goes once
        # the store is answered.
        released: Pending[bytes | memoryview] = Pending()

        def release() -> None:
            try:
                rank = self._close_request(request.request_id)
                forwarded = self._forward(self._link(rank), frame)
            except CacheError as exc:
                released.fail(exc)
                return
            forwarded.then(released.settle_as)

        entry.waiting.append(release)
        return self._answer(request, released)

    def _computed(self, request: Computed, owner: Owner | None, frame: bytes) -> Reply:
        entry = self._open.get(request.request_id)
        if entry is None:
            raise CacheError("unknown_request", f"request {request.request_id!r} is not open")
        return self._answer(request, self._forward(self._link(entry.rank), frame))

    def _open_store(self, request_id: RequestId, rank: int, owner: Owner | None) -> _OpenRequest:
        """The open request a store to ``rank`` makes (CacheError: a duplicate, the rank's
        worker down or full), claimed by ``owner``."""
        if request_id in self._open:
            raise CacheError("duplicate_request", f"request {request_id!r} is already open")
        self._check_room(self._link(rank))
        entry = self._open[request_id] = _OpenRequest(rank, route=self._route)
        self._open_count[rank] += 1
        self.owners.claim(owner, request_id)
        return entry

    def _close_request(self, request_id: RequestId) -> int:
        """The rank a released request is open on (CacheError ``unknown_request``)."""
        self.owners.drop(request_id)
        entry = self._forget(request_id)
        if entry is None:
            raise CacheError("unknown_request", f"request {request_id!r} is not open")
        return entry.rank

    def _release_orphan(self, request_id: RequestId) -> None:
        """Release a request whose client went away. Not before its store was answered: held
        in its client's lane, the store reached the worker after a release sent at once, and
        its blocks stayed pinned for good (this side had forgotten the request)."""
        entry = self._open.get(request_id)
        if entry is None:
            return
        if not entry.confirmed:
            entry.orphaned = True  # see _settle_store
            return
        self._forget(request_id)
        link = self._links(entry.rank)
        if link is not None:
            link.request(_encoder.encode(Release(request_id=request_id)))

    def _forward_to_rank(
        self, request: Snapshot | PoolInfoRequest | Checksum, owner: Owner | None, frame: bytes
    ) -> Reply:
        link = self._link(self._rank(request.rank))
        self._check_room(link)
        return self._answer(request, self._forward(link, frame))

    # -- batch -------------------------------------------------------------------------------

    def _batch(self, request: Batch, owner: Owner | None, frame: bytes) -> Reply:
        """Each request to the worker of its rank (the batch whole where they all go to one),
        checked here as it would be alone; the replies put back in the batch's order."""
        replies: list[bytes | None] = []  # an entry's reply made here, None for a worker's
        by_rank: dict[int, list[tuple[int, Store | Release, _OpenRequest | None]]] = {}
        # Per rank, the stores still on their way from another connection that a release of
        # this batch closes: its part goes once they are answered (see _release; a store of
        # this batch came on this connection, so it never waits for one).
        awaited: dict[int, list[_OpenRequest]] = {}
        for index, entry in enumerate(request.requests):
            if isinstance(entry, Release):
                store = self._open.get(entry.request_id)
                if store is not None and self._must_wait(store):
                    awaited.setdefault(store.rank, []).append(store)
            try:
                rank, opened = self._batch_route(request, entry, owner)
            except CacheError as exc:
                replies.append(error_reply(entry.id, exc.code, exc.message))
                continue
            replies.append(None)
            by_rank.setdefault(rank, []).append((index, entry, opened))
        # All to one worker, none refused here: the frame goes on as it came.
        whole = len(by_rank) == 1 and all(r is None for r in replies)
        sent: list[tuple[list[tuple[int, Store | Release, _OpenRequest | None]], Pending[Any]]]
        sent = []
        for rank, entries in by_rank.items():
            link = self._links(rank)
            assert link is not None  # checked by _batch_route
            body = frame if whole else _encoder.encode(Batch(requests=[e for _, e, _ in entries]))
            sent.append((entries, self._send_after(awaited.get(rank, []), link, body)))
        # Each worker's part settles on its own: a worker that dies fails its entries only
        # (``unavailable``), and the stores another worker carried out stay open, answered
        # (the whole batch failed once, and those stayed pinned with no request to release).
        answered: Pending[bytes] = Pending()
        left = [len(sent)]

        def part_settled(
            entries: list[tuple[int, Store | Release, _OpenRequest | None]],
            frame: zmq.Frame | None,
            error: BaseException | None,
        ) -> None:
            if error is None:
                assert frame is not None
                try:
                    parts = [bytes(part) for part in decode_ok_raw(frame)]
                except CacheError as exc:  # the worker refused its part whole
                    error = exc
            if error is not None:
                parts = [failure_reply(entry, error) for _, entry, _ in entries]
            for (index, entry, opened), part in zip(entries, parts, strict=True):
                replies[index] = part
                if opened is not None:
                    self._settle_store(entry.request_id, opened, part)
            left[0] -= 1
            if not left[0]:
                finish()

        def finish() -> None:
            head = ok_reply_head(request.id, BatchReply([]))
            answered.resolve(
                b"".join([head, _array_header(len(replies)), *(r or b"" for r in replies)])
            )

        for entries, pending in sent:
            pending.then(functools.partial(part_settled, entries))
        if not sent:  # every entry refused here
            finish()
        return self._answer(request, answered)

    def _batch_route(
        self, batch: Batch, entry: Store | Release, owner: Owner | None
    ) -> tuple[int, _OpenRequest | None]:
        """The rank a batch's entry goes to, and the open request a store makes (CacheError
        for what is refused here, as it would be alone)."""
        if isinstance(entry, Release):
            rank = self._close_request(entry.request_id)
            self._link(rank)
            return rank, None
        rank = self._rank(entry.rank if entry.rank is not None else batch.rank)
        if batch.rank is not None and entry.rank is not None and entry.rank != batch.rank:
            raise CacheError("bad_request", f"rank: {entry.rank}, in a batch of rank {batch.rank}")
        return rank, self._open_store(entry.request_id, rank, owner)

    def _settle_store(
        self, request_id: RequestId, opened: _OpenRequest, reply: bytes | None
    ) -> None:
        """A store's reply came (None: it never will): confirmed open, or forgotten; then what
        waited for it goes (called once per store, also when the request was closed
        meanwhile)."""
        if self._open.get(request_id) is opened:
            if reply is not None and reply_error(reply) is None:
                opened.confirmed = True
                if opened.orphaned:
                    self._release_orphan(request_id)
            else:
                self._forget(request_id)
                self.owners.drop(request_id)
        self._run_waiting(opened)

    # -- reset -------------------------------------------------------------------------------

    def _reset(self, request: Reset, owner: Owner | None, frame: bytes) -> Reply:
        targets = list(self._ranks) if request.rank is None else [self._rank(request.rank)]
        links = [self._link(rank) for rank in targets]  # unavailable: nothing is reset
        for rank in targets:
            if (silent_s := self._silent(rank)) is not None:
                # It would reset the others and then wait until the watchdog kills this one.
                raise CacheError(
                    "unavailable",
                    f"rank {rank}'s worker answered no ping for {silent_s:.1f} s: "
                    "nothing was reset",
                )
        if not request.force:
            busy = [(rank, n) for rank in targets if (n := self.open_requests(rank))]
            if busy:
                raise CacheError(
                    "busy",
                    f"{sum(n for _, n in busy)} open request(s) pin blocks on rank(s) "
                    f"{', '.join(str(rank) for rank, _ in busy)}; release them or pass force",
                )
        # Checked here against every request this side forwarded (a superset of what the
        # workers hold): each worker resets at once, none refuses.
        started = time.perf_counter()
        # Every worker's outcome, not the first failure: a worker that dies (or hangs until the
        # watchdog kills it) before it answers leaves the others reset, and the reply says so.
        replies = _outcomes(
            [
                self._send(link, _encoder.encode(Reset(rank=rank, force=True, tier=request.tier)))
                for rank, link in zip(targets, links, strict=True)
            ]
        )
        for request_id, entry in list(self._open.items()):
            if entry.rank in targets and entry.confirmed:
                self._forget(request_id)

        def merge(outcomes: list[tuple[zmq.Frame | None, BaseException | None]]) -> bytes:
            markers: list[Marker] = []
            failed: list[BaseException] = []
            for reply, error in outcomes:
                if error is not None:
                    failed.append(error)
                else:
                    assert reply is not None
                    markers += decode_ok(reply, ResetReply).markers
            if failed:
                done = ", ".join(f"rank {m.rank} (marker seq {m.seq})" for m in markers)
                why = f"{failed[0]}: not reset; reset: {done or 'none'}"
                return failure_reply(
                    request, LinkLost(why) if isinstance(failed[0], LinkLost) else failed[0]
                )
            elapsed = time.perf_counter() - started
            self._metrics.reset_done(elapsed)
            log.info(
                "reset rank(s) %s in %.0f us: markers %s",
                ", ".join(map(str, targets)),
                elapsed * 1e6,
                ", ".join(f"{m.rank}:{m.seq}" for m in markers),
            )
            return ok_reply(request.id, ResetReply(markers))

        return self._answer(request, replies.map(merge))

    # -- plumbing ----------------------------------------------------------------------------

    def _rank(self, rank: int | None) -> int:
        """The rank named; None names the first rank served."""
        ranks = self._ranks
        if rank is None:
            return ranks[0]
        if rank not in ranks:
            served = f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}..{ranks[-1]}"
            raise CacheError("bad_request", f"rank: {rank} is not served (ranks: {served})")
        return rank

    def _link(self, rank: int) -> RankLink:
        link = self._links(rank)
        if link is None:
            raise CacheError("unavailable", f"rank {rank} is restarting: retry shortly")
        return link

    def _check_room(self, link: RankLink) -> None:
        held, held_bytes = self._held[link.rank]
        requests, size = link.in_flight + held, link.bytes_in_flight + held_bytes
        if requests >= MAX_IN_FLIGHT or size >= MAX_BYTES_IN_FLIGHT:
            raise CacheError(
                "busy",
                f"rank {link.rank} has {requests} requests ({size >> 20} MiB) in flight: "
                "read their replies first",
            )

    def _check_rooms(self) -> None:
        """A client's op to every rank: refused ``busy`` where any rank is full."""
        if self._route is not None:
            for rank in self._ranks:
                self._check_room(self._link(rank))

    def _send(self, link: RankLink, body: bytes) -> Pending[zmq.Frame]:
        """Send on the connection the current client's requests to this worker are on, if
        any is on its way (one client's requests are never reordered); else on the reset
        connection for a reset, the priority one for its other small ops, the bulk one for
        the rest (``conn_of``). The service's own requests (no client) go on the priority one.

        The priority and reset connections carry nothing long nor deep: a request for another
        connection (a store, say) behind the client's ops on one of them, or more than
        PRIORITY_DEPTH of them, waits here until they are answered (see _answered). A store
        once went on the priority connection, where another client's reset waited behind a
        whole flood of stores."""
        route = self._route
        if route is None:
            return link.request(body, Conn.PRIORITY)
        key = (route, link.rank)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(self._conn)
        elif lane.held or (
            lane.conn != Conn.BULK and (self._conn != lane.conn or lane.in_flight >= PRIORITY_DEPTH)
        ):
            reply: Pending[zmq.Frame] = Pending()
            lane.held.append(_Held(link, body, reply, self._conn))
            held = self._held[link.rank]
            held[0] += 1
            held[1] += len(body)
            return reply
        return self._request(key, lane, link, body)

    def _request(
        self, key: tuple[Route, int], lane: _Lane, link: RankLink, body: bytes
    ) -> Pending[zmq.Frame]:
        lane.in_flight += 1
        reply = link.request(body, lane.conn)
        reply.then(lambda _, __: self._answered(key, lane))
        return reply

    def _answered(self, key: tuple[Route, int], lane: _Lane) -> None:
        """One of a lane's requests was answered: once none is on its way, what it held goes
        on, on the connection of the request at its head. Small ops (or resets) at its head go
        on theirs, PRIORITY_DEPTH at most and only as far as the same connection's run goes,
        the rest waiting for their turn again (a reset held behind the client's own stats once
        went on the bulk connection, behind every other client's stores); a request for the
        bulk connection at its head takes the lane, and all it held, there. A lane with
        nothing on its way or held is done."""
        lane.in_flight -= 1
        if lane.in_flight:
            return
        if not lane.held:
            if self._lanes.get(key) is lane:
                del self._lanes[key]
            return
        held = lane.held
        if held[0].link.closed:  # the worker died: all it held fails now, not round by round
            lane.held = []
            if self._lanes.get(key) is lane:
                del self._lanes[key]
            lost = LinkLost(f"rank {held[0].link.rank}'s worker is not running")
            for entry in held:
                self._unhold(entry)
                entry.reply.fail(lost)
            return
        lane.conn = held[0].conn
        if lane.conn == Conn.BULK:
            going, lane.held = held, []
        else:
            run = 1
            while run < min(len(held), PRIORITY_DEPTH) and held[run].conn == lane.conn:
                run += 1
            going, lane.held = held[:run], held[run:]
        for entry in going:
            self._unhold(entry)
            self._request(key, lane, entry.link, entry.body).then(entry.reply.settle_as)

    def _unhold(self, entry: _Held) -> None:
        counts = self._held[entry.link.rank]
        counts[0] -= 1
        counts[1] -= len(entry.body)

    def _must_wait(self, store: _OpenRequest) -> bool:
        """Whether a release of ``store`` now must wait for its answer: it is on its way, from
        another connection than the release's (on the same one, the lane keeps their order:
        an engine's pipelined steps release the last step's stores at once)."""
        return not store.confirmed and store.route != self._route

    def _send_after(
        self, stores: list[_OpenRequest], link: RankLink, frame: bytes
    ) -> Pending[zmq.Frame]:
        """``frame`` sent to ``link`` once every one of ``stores`` is answered."""
        if not stores:
            return self._send(link, frame)
        reply: Pending[zmq.Frame] = Pending()
        left = [len(stores)]

        def one_answered() -> None:
            left[0] -= 1
            if not left[0]:
                self._send(link, frame).then(reply.settle_as)

        for store in stores:
            store.waiting.append(one_answered)
        return reply

    def _forward(self, link: RankLink, frame: bytes) -> Pending[bytes | memoryview]:
        return self._send(link, frame).map(_reply_bytes)

    def _to_all(self, requests: list[tuple[int, bytes]]) -> Pending[list[zmq.Frame]]:
        """Each request to its rank's worker; nothing is sent unless every worker runs."""
        links = [self._link(rank) for rank, _ in requests]
        return _gather(
            [self._send(link, body) for link, (_, body) in zip(links, requests, strict=True)]
        )

    def _answer(self, request: Request, reply: Pending[Any]) -> Pending[bytes | memoryview]:
        """The reply to come, or the error reply for the way ``reply`` failed."""
        return settled_reply(request, reply)


def decode_ok_raw(frame: zmq.Frame) -> list[msgspec.Raw]:
    """A worker's batch reply: each request's reply, as its bytes."""
    if reply_error(frame.buffer) is not None:
        decode_ok(frame, BatchReply)  # raises its error
    return _replies_decoder.decode(frame.buffer).replies


def _array_header(length: int) -> bytes:
    if length < 16:
        return bytes([0x90 | length])
    return b"\xdc" + length.to_bytes(2, "big")


def _reply_bytes(frame: zmq.Frame) -> bytes | memoryview:
    return frame.bytes if len(frame) < COPY_BELOW else frame.buffer


def _code_of(reply: bytes | memoryview | None) -> str | None:
    return "internal" if reply is None else reply_error(reply)


def _outcomes(
    replies: list[Pending[zmq.Frame]],
) -> Pending[list[tuple[zmq.Frame | None, BaseException | None]]]:
    """Every request's outcome, in order (its reply or its failure), once all settled."""
    settled: Pending[list[tuple[zmq.Frame | None, BaseException | None]]] = Pending()
    outcomes: list[tuple[zmq.Frame | None, BaseException | None]] = [(None, None)] * len(replies)
    left = [len(replies)]

    def arrived(index: int) -> Callable[[zmq.Frame | None, BaseException | None], None]:
        def settle(value: zmq.Frame | None, error: BaseException | None) -> None:
            outcomes[index] = (value, error)
            left[0] -= 1
            if not left[0]:
                settled.resolve(outcomes)

        return settle

    if not replies:
        settled.resolve([])
    for index, reply in enumerate(replies):
        reply.then(arrived(index))
    return settled


def _gather(replies: list[Pending[zmq.Frame]]) -> Pending[list[zmq.Frame]]:
    """Every reply, in order, once all came; the first failure otherwise."""
    gathered: Pending[list[zmq.Frame]] = Pending()
    values: list[zmq.Frame | None] = [None] * len(replies)
    left = [len(replies)]

    def arrived(index: int) -> Callable[[zmq.Frame | None, BaseException | None], None]:
        def settle(value: zmq.Frame | None, error: BaseException | None) -> None:
            if error is not None:
                gathered.fail(error)
                return
            values[index] = value
            left[0] -= 1
            if not left[0]:
                gathered.resolve([v for v in values if v is not None])

        return settle

    if not replies:
        gathered.resolve([])
    for index, reply in enumerate(replies):
        reply.then(arrived(index))
    return gathered
