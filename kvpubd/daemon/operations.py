"""The control ops: each request routed to the rank pipelines it concerns. Rules that span
ranks live here (request ids are unique across ranks, a reset checks every rank it targets);
everything about one rank lives in its pipeline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import msgspec
import numpy as np

from kvpubd import __version__
from kvpubd.daemon.cache import CacheError
from kvpubd.daemon.checksums import checksum_reply
from kvpubd.daemon.control_server import Reply
from kvpubd.daemon.decoding import decode_in_slices, decode_tokens
from kvpubd.daemon.drain import Drain
from kvpubd.daemon.hooks import MetricsHooks
from kvpubd.daemon.owners import Owner, RequestId, RequestOwners
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.pipeline import RankPipeline
from kvpubd.daemon.rank_link import LinkLost
from kvpubd.daemon.settings import Settings
from kvpubd.daemon.snapshot import Buffer, assemble
from kvpubd.daemon.snapshot import Snapshot as SnapshotData
from kvpubd.protocol.control import (
    REQUEST_TYPES,
    Batch,
    BatchReply,
    Checksum,
    ChecksumReply,
    Computed,
    ComputedReply,
    ControlReply,
    ControlRequest,
    Marker,
    Pause,
    PauseReply,
    Ping,
    PingReply,
    PoolInfo,
    PoolInfoRequest,
    RankEndpoints,
    Release,
    ReleaseReply,
    Request,
    Reset,
    ResetReply,
    Resume,
    Snapshot,
    SnapshotReply,
    Stats,
    StatsReply,
    Store,
    StoreReply,
    error_reply,
    ok_reply,
    ok_reply_head,
    op_of,
)
from kvpubd.protocol.hashing import token_count, tokens_array
from kvpubd.protocol.int_arrays import DECODE_SLICE, IntArray, located

log = logging.getLogger("kvpubd")

# Time a batch's requests may take in one loop turn; its stores after that are queued and run
# a slice per turn (as a large store is), so no batch holds the loop for long. A reset waits
# for the turn it arrives in: with 1 ms here and 512 blocks a turn in the store queue, an
# engine's batches sent back to back held resets to p50 1.9 ms, p99 4.5 ms; with 0.5 ms and
# 256, p50 1.5 ms, p99 3.5 ms (H200 host), at about 1 % of throughput (dev VM).
BATCH_SYNC_S = 0.0005


@dataclass(frozen=True, slots=True)
class Encoded:
    """A reply its handler encodes itself, streamed across loop turns (a snapshot, a
    checksum): sent as it settles."""

    reply: Pending[bytes] | Pending[Buffer]


# What a handler answers: the reply, the reply to come, or one it encodes itself.
Answer = ControlReply | Pending[StoreReply] | Pending[ReleaseReply] | Encoded
HandlerT = TypeVar("HandlerT", bound=Callable[..., Answer])
T = TypeVar("T")
# The handler of each request type: (operations, request, the client that sent it).
_HANDLERS: dict[type[ControlRequest], Callable[..., Answer]] = {}


def handles(*request_types: type[ControlRequest]) -> Callable[[HandlerT], HandlerT]:
    """Register an Operations method as the handler of ``request_types``."""

    def register(handler: HandlerT) -> HandlerT:
        for request_type in request_types:
            assert request_type not in _HANDLERS, request_type
            _HANDLERS[request_type] = handler
        return handler

    return register


class Operations:
    def __init__(
        self,
        pipelines: Sequence[RankPipeline],
        settings: Settings,
        metrics: MetricsHooks,
        epoch: int,
        drain: Drain,
    ) -> None:
        self.pipelines = pipelines
        self.settings = settings
        self.epoch = epoch
        self.drain = drain
        self._metrics = metrics
        control = settings.control
        self.owners = RequestOwners(
            self._release_orphan,
            control.orphan_grace_ms / 1000 if control.release_orphans else None,
        )
        # Set while a batch has used its time in this loop turn: its later stores are queued.
        self._queue_stores = False
        # Requests' jobs under way: the loop holds a task only weakly, and a job's reply comes
        # from its done callback, so nothing else may hold it.
        self._jobs: set[asyncio.Future[Any]] = set()

    def handle(
        self,
        request: Request,
        owner: Owner | None = None,
        frame: bytes = b"",
        route: tuple[bytes, ...] = (),
    ) -> Reply:
        """The reply to one parsed request from ``owner`` (the client, where it can be told:
        its open requests are released when it goes away); a refusal or a bug is answered,
        never raised. Work that takes several loop turns is answered later. ``frame`` and
        ``route`` (the request as received, its reply's route) are not needed here."""
        error_code: str | None = None
        try:
            answer = _HANDLERS[type(request)](self, request, owner)
            if isinstance(answer, ControlReply):
                return ok_reply(request.id, answer)
            if isinstance(answer, Encoded):
                return answer.reply
            return self._later(request, answer)
        except CacheError as exc:
            error_code = exc.code
            return error_reply(request.id, exc.code, exc.message)
        except Exception as exc:  # a bug: answer it, keep serving
            error_code = "internal"
            log.exception("control: %s failed", op_of(request))
            return error_reply(request.id, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            self._metrics.control(op_of(request), error_code)

    def _later(
        self, request: Request, pending: Pending[StoreReply] | Pending[ReleaseReply]
    ) -> Pending[bytes]:
        """The reply to a request whose op finishes on a later loop turn, made the moment
        it finishes."""

        def answer(reply: ControlReply) -> bytes:
            return ok_reply(request.id, reply)

        return self._settled(request, pending.map(answer))

    def _settled(self, request: Request, pending: Pending[bytes]) -> Pending[bytes]:
        """The reply to come, or the error reply for the way ``pending`` failed."""
        return settled_reply(request, pending)

    def _pipeline(self, rank: int | None) -> RankPipeline:
        """The pipeline of ``rank``; None names the first rank served."""
        pipelines = self.pipelines
        first = pipelines[0].rank
        if rank is None:
            return pipelines[0]
        if not first <= rank < first + len(pipelines):
            served = f"{first}" if len(pipelines) == 1 else f"{first}..{pipelines[-1].rank}"
            raise CacheError("bad_request", f"rank: {rank} is not served (ranks: {served})")
        return pipelines[rank - first]

    @handles(Ping)
    def ping(self, request: Ping, owner: Owner | None) -> PingReply:
        endpoints = [
            RankEndpoints(
                p.rank,
                p.publisher.endpoint,
                p.publisher.replay_endpoint,
                p.publisher.transport.snapshot_endpoint,
                p.publisher.history.publisher_id or b"",
            )
            for p in self.pipelines
        ]
        return PingReply(__version__, self.epoch, len(self.pipelines), endpoints)

    @handles(Stats)
    def stats(self, request: Stats, owner: Owner | None) -> StatsReply:
        return StatsReply(self.epoch, self.drain.paused, [p.stats() for p in self.pipelines])

    @handles(Pause, Resume)
    def pause(self, request: Pause | Resume, owner: Owner | None) -> PauseReply:
        if isinstance(request, Pause):
            self.drain.pause()
        else:
            self.drain.resume()
        return PauseReply(self.drain.paused)

    @handles(Store)
    def store(self, request: Store, owner: Owner | None) -> StoreReply | Pending[StoreReply]:
        pipeline = self._pipeline(request.rank)
        limit = self.settings.control.max_tokens_per_request
        try:
            token_ids = located(request.token_ids)
        except ValueError:  # parse_request refused it already
            raise CacheError("bad_request", "token_ids: not a list of integers") from None
        count = token_count(token_ids)
        if count > limit:
            raise CacheError("too_large", f"token_ids: {count} tokens; the limit is {limit}")
        blocks = count // self.settings.cache.block_size
        block_limit = self.settings.control.max_blocks_per_store
        if blocks > block_limit:
            raise CacheError(
                "too_large",
                f"token_ids: {blocks} full blocks; the limit is {block_limit} "
                "(control.max_blocks_per_store)",
            )
        # Request ids are unique across ranks (release names no rank).
        if any(p.will_be_open(request.request_id) for p in self.pipelines):
            raise CacheError("duplicate_request", f"request {request.request_id!r} is already open")
        tokens: np.ndarray | IntArray
        if isinstance(token_ids, bytes):
            try:
                tokens = tokens_array(token_ids)
            except ValueError as exc:
                raise CacheError("bad_request", f"token_ids: {exc}") from None
        elif count <= DECODE_SLICE:  # one slice: no need to wait for a later loop turn
            tokens = decode_tokens(token_ids)
        else:
            tokens = token_ids
        # A longer list is decoded a slice per loop turn by the rank's store queue.
        stored = pipeline.store(request, tokens, queued=self._queue_stores)
        self.owners.claim(owner, request.request_id)
        if isinstance(stored, Pending):
            request_id = request.request_id

            def opened_nothing(_: object, error: BaseException | None) -> None:
                if error is not None:
                    self.owners.drop(request_id)

            stored.then(opened_nothing)
        return stored

    @handles(Release)
    def release(
        self, request: Release, owner: Owner | None
    ) -> ReleaseReply | Pending[ReleaseReply]:
        self.owners.drop(request.request_id)
        for pipeline in self.pipelines:
            if pipeline.has_request(request.request_id):
                return pipeline.release(request.request_id)
        raise CacheError("unknown_request", f"request {request.request_id!r} is not open")

    @handles(Computed)
    def computed(self, request: Computed, owner: Owner | None) -> ComputedReply:
        for pipeline in self.pipelines:
            if pipeline.has_request(request.request_id):
                return pipeline.computed(request.request_id, request.num_computed_tokens)
        raise CacheError("unknown_request", f"request {request.request_id!r} is not open")

    def _release_orphan(self, request_id: RequestId) -> None:
        """Release a request whose client went away (see owners)."""
        for pipeline in self.pipelines:
            if pipeline.has_request(request_id):
                try:
                    pipeline.release(request_id)
                except CacheError as exc:  # closed meanwhile: nothing left to release
                    log.debug("release of orphan %r: %s", request_id, exc.message)
                return

    @handles(Batch)
    def batch(self, request: Batch, owner: Owner | None) -> Encoded:
        """Each request handled as if sent alone, in order; answered once all are."""
        started = time.perf_counter()
        replies: list[Reply] = []
        try:
            for entry in request.requests:
                if time.perf_counter() - started > BATCH_SYNC_S:
                    self._queue_stores = True
                replies.append(self._batch_entry(request, entry, owner))
        finally:
            self._queue_stores = False
        head = ok_reply_head(request.id, BatchReply([]))
        head += msgpack.Packer().pack_array_header(len(replies))
        return Encoded(_joined(head, replies))

    def _batch_entry(self, batch: Batch, entry: Store | Release, owner: Owner | None) -> Reply:
        if isinstance(entry, Store) and batch.rank is not None:
            if entry.rank is None:
                entry = msgspec.structs.replace(entry, rank=batch.rank)
            elif entry.rank != batch.rank:
                self._metrics.control("store", "bad_request")
                return error_reply(
                    entry.id, "bad_request", f"rank: {entry.rank}, in a batch of rank {batch.rank}"
                )
        return self.handle(entry, owner)

    @handles(Reset)
    def reset(self, request: Reset, owner: Owner | None) -> ResetReply:
        targets = self.pipelines if request.rank is None else [self._pipeline(request.rank)]
        if not request.force:
            busy = [p for p in targets if p.open_requests]
            if busy:
                open_requests = sum(p.open_requests for p in busy)
                raise CacheError(
                    "busy",
                    f"{open_requests} open request(s) pin blocks on rank(s) "
                    f"{', '.join(str(p.rank) for p in busy)}; release them or pass force",
                )
        started = time.perf_counter()
        markers = [Marker(p.rank, p.reset(request.tier)) for p in targets]
        elapsed = time.perf_counter() - started
        self._metrics.reset_done(elapsed)
        log.info(
            "reset rank(s) %s in %.0f us: markers %s",
            ", ".join(str(p.rank) for p in targets),
            elapsed * 1e6,
            ", ".join(f"{m.rank}:{m.seq}" for m in markers),
        )
        return ResetReply(markers)

    @handles(Snapshot)
    def snapshot(self, request: Snapshot, owner: Owner | None) -> Encoded:
        """Answered once the rank's snapshot job is done and its reply put together, both a
        slice per loop turn: a snapshot never holds the loop."""
        pipeline = self._pipeline(request.rank)
        job = pipeline.snapshot().result
        reply = self._job(self._snapshot_reply(request, pipeline.rank, job))
        return Encoded(Pending.of_future(reply))

    async def _snapshot_reply(
        self, request: Snapshot, rank: int, job: asyncio.Future[SnapshotData]
    ) -> Buffer:
        try:
            snapshot = await asyncio.shield(job)
            while snapshot.freed:  # retired before this woke up: the newer build
                snapshot = await asyncio.shield(self._pipeline(rank).snapshot().result)
        except Exception as exc:
            log.debug("snapshot of rank %d failed: %r", rank, exc)
            error = error_reply(request.id, "internal", f"snapshot failed: {exc!r}")
            return memoryview(error)
        head = ok_reply_head(request.id, SnapshotReply(rank, snapshot.seq, self.epoch, []))
        events = msgpack.Packer().pack_array_header(snapshot.count)
        return await assemble([head + events, *snapshot.bodies])

    @handles(PoolInfoRequest)
    def pool_info(self, request: PoolInfoRequest, owner: Owner | None) -> PoolInfo:
        return self._pipeline(request.rank).pool_info()

    @handles(Checksum)
    def checksum(self, request: Checksum, owner: Owner | None) -> Encoded:
        """Answered once the ids are decoded and every slice of them is checksummed, one
        slice per loop turn."""
        pipeline = self._pipeline(request.rank)
        pipeline.check_owned("checksum")
        num_blocks = pipeline.cache.pool.num_blocks
        block_ids = located(request.block_ids)
        if not isinstance(block_ids, IntArray):  # parse_request refused it already
            raise CacheError("bad_request", "block_ids: expected a list of integers")
        if len(block_ids) > num_blocks:
            raise CacheError("too_large", f"block_ids: at most {num_blocks} ids")
        job = self._job(self._checksum(request, block_ids, pipeline))
        return Encoded(self._settled(request, Pending.of_future(job)))

    def _job(self, work: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """``work`` as a task held until it is done (see _jobs)."""
        job = asyncio.ensure_future(work)
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return job

    async def _checksum(
        self, request: Checksum, block_ids: IntArray, pipeline: RankPipeline
    ) -> bytes:
        pool = pipeline.cache.pool
        ids = await decode_in_slices(block_ids.decoder("block_ids", 0, pool.num_blocks - 1))
        head = ok_reply_head(request.id, ChecksumReply(pipeline.rank, []))
        return await checksum_reply(head, len(ids), pool.checksum_steps(ids))


def settled_reply(request: Request, pending: Pending[Any]) -> Pending[Any]:
    """The reply ``pending`` resolves to, or the error reply for the way it failed: a cache
    error's code, ``unavailable`` for a rank worker gone before it answered, ``internal`` for
    work stopped at shutdown or a bug."""
    reply: Pending[Any] = Pending()

    def settle(encoded: Any, exc: BaseException | None) -> None:
        if exc is None:
            assert encoded is not None
            reply.resolve(encoded)
        else:
            reply.resolve(failure_reply(request, exc))

    pending.then(settle)
    return reply


def failure_reply(request: Request | Store | Release, exc: BaseException) -> bytes:
    """The error reply for work that failed with ``exc`` (see settled_reply)."""
    if isinstance(exc, asyncio.CancelledError):
        return error_reply(request.id, "internal", "stopped before it finished")
    if isinstance(exc, LinkLost):
        return error_reply(request.id, "unavailable", str(exc))
    if isinstance(exc, CacheError):
        return error_reply(request.id, exc.code, exc.message)
    log.error("control: %s failed: %r", op_of(request), exc)
    return error_reply(request.id, "internal", f"{type(exc).__name__}: {exc}")


def _joined(head: bytes, replies: list[Reply]) -> Pending[bytes]:
    """``head`` and every reply's bytes, once the last one came."""
    joined: Pending[bytes] = Pending()
    parts: list[bytes | None] = [r if isinstance(r, bytes) else None for r in replies]
    waiting = [len([p for p in parts if p is None])]

    def finish() -> None:
        joined.resolve(head + b"".join(p for p in parts if p is not None))

    def arrived(index: int) -> Callable[[bytes | memoryview | None, BaseException | None], None]:
        def settle(value: bytes | memoryview | None, error: BaseException | None) -> None:
            parts[index] = bytes(value) if value is not None else b""
            waiting[0] -= 1
            if not waiting[0]:
                finish()

        return settle

    for index, reply in enumerate(replies):
        if not isinstance(reply, bytes):
            reply.then(arrived(index))
    if not waiting[0]:
        finish()
    return joined


# Every request type has its handler (checked once, at import).
if set(_HANDLERS) != set(REQUEST_TYPES):
    raise ImportError(f"control ops without a handler: {set(REQUEST_TYPES) - set(_HANDLERS)}")
