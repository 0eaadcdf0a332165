"""The control ops: each request routed to the rank pipelines it concerns. Rules that span
ranks live here (request ids are unique across ranks, a reset checks every rank it targets);
everything about one rank lives in its pipeline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

from kvpubd import __version__
from kvpubd.daemon.cache import CacheError
from kvpubd.daemon.checksums import checksum_reply
from kvpubd.daemon.control_server import Reply
from kvpubd.daemon.decoding import decode_in_slices, decode_tokens
from kvpubd.daemon.encoded import ok_reply as encoded_ok_reply
from kvpubd.daemon.hooks import MetricsHooks
from kvpubd.daemon.owners import Owner, RequestId, RequestOwners
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.pipeline import RankPipeline
from kvpubd.daemon.snapshot import Buffer, assemble
from kvpubd.daemon.snapshot import Snapshot as SnapshotData
from kvpubd.protocol.config import Settings
from kvpubd.protocol.control import (
    Checksum,
    Pause,
    Ping,
    PoolInfo,
    Release,
    Request,
    Reset,
    Resume,
    Snapshot,
    Stats,
    Store,
    error_reply,
    ok_reply,
)
from kvpubd.protocol.hashing import token_count, tokens_array
from kvpubd.protocol.int_arrays import DECODE_SLICE, IntArray

log = logging.getLogger("kvpubd")


class Operations:
    def __init__(
        self,
        pipelines: Sequence[RankPipeline],
        settings: Settings,
        metrics: MetricsHooks,
        epoch: int,
    ) -> None:
        self.pipelines = pipelines
        self.settings = settings
        self.epoch = epoch
        self.paused = False
        self._metrics = metrics
        control = settings.control
        self.owners = RequestOwners(
            self._release_orphan,
            control.orphan_grace_ms / 1000 if control.release_orphans else None,
        )
        self._ops: dict[type, Callable[[Any], dict[str, Any] | Pending[dict[str, Any]]]] = {
            Ping: self.ping,
            Stats: self.stats,
            Store: self.store,
            Release: self.release,
            Reset: self.reset,
            Pause: self.pause,
            Resume: self.pause,
            PoolInfo: self.pool_info,
        }

    def handle(self, request: Request, owner: Owner | None = None) -> Reply:
        """The reply to one parsed request from ``owner`` (the client, where it can be told:
        its open requests are released when it goes away); a refusal or a bug is answered,
        never raised. A snapshot is answered later, through a future."""
        error_code: str | None = None
        try:
            if isinstance(request, Snapshot):
                return self.snapshot(request)
            if isinstance(request, Checksum):
                return self.checksum(request)
            if isinstance(request, Store):
                result = self.store(request, owner)
            else:
                result = self._ops[type(request)](request)
            if isinstance(result, Pending):
                return self._later(request, result)
            return ok_reply(request.id, **result)
        except CacheError as exc:
            error_code = exc.code
            return error_reply(request.id, exc.code, exc.message)
        except Exception as exc:  # a bug: answer it, keep serving
            error_code = "internal"
            log.exception("control: %s failed", request.op)
            return error_reply(request.id, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            self._metrics.control(request.op, error_code)

    def _later(self, request: Request, pending: Pending[dict[str, Any]]) -> Pending[bytes]:
        """The reply to a request whose op finishes on a later loop turn, made the moment
        it finishes."""

        def answer(fields: dict[str, Any]) -> bytes:
            return encoded_ok_reply(request.id, fields)

        return self._settled(request, pending.map(answer))

    def _settled(self, request: Request, pending: Pending[bytes]) -> Pending[bytes]:
        """The reply to come, or the error reply for the way ``pending`` failed."""
        reply: Pending[bytes] = Pending()

        def settle(encoded: bytes | None, exc: BaseException | None) -> None:
            if exc is None:
                assert encoded is not None
                reply.resolve(encoded)
            elif isinstance(exc, asyncio.CancelledError):
                reply.resolve(error_reply(request.id, "internal", "stopped before it finished"))
            elif isinstance(exc, CacheError):
                reply.resolve(error_reply(request.id, exc.code, exc.message))
            else:
                log.error("control: %s failed: %r", request.op, exc)
                reply.resolve(error_reply(request.id, "internal", f"{type(exc).__name__}: {exc}"))

        pending.then(settle)
        return reply

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

    def ping(self, request: Ping) -> dict[str, Any]:
        return {
            "version": __version__,
            "epoch": self.epoch,
            "ranks": len(self.pipelines),
            "endpoints": [
                {
                    "rank": p.rank,
                    "events": p.publisher.endpoint,
                    "replay": p.publisher.replay_endpoint,
                }
                for p in self.pipelines
            ],
        }

    def stats(self, request: Stats) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "paused": self.paused,
            "ranks": [p.stats() for p in self.pipelines],
        }

    def pause(self, request: Pause | Resume) -> dict[str, Any]:
        self.paused = isinstance(request, Pause)
        log.info("periodic drain %s", "paused" if self.paused else "resumed")
        return {"paused": self.paused}

    def store(
        self, request: Store, owner: Owner | None = None
    ) -> dict[str, Any] | Pending[dict[str, Any]]:
        pipeline = self._pipeline(request.rank)
        limit = self.settings.control.max_tokens_per_request
        count = token_count(request.token_ids)
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
        if any(p.has_request(request.request_id) for p in self.pipelines):
            raise CacheError("duplicate_request", f"request {request.request_id!r} is already open")
        tokens: np.ndarray | IntArray
        if isinstance(request.token_ids, bytes):
            try:
                tokens = tokens_array(request.token_ids)
            except ValueError as exc:
                raise CacheError("bad_request", f"token_ids: {exc}") from None
        elif count <= DECODE_SLICE:  # one slice: no need to wait for a later loop turn
            tokens = decode_tokens(request.token_ids)
        else:
            tokens = request.token_ids
        # A longer list is decoded a slice per loop turn by the rank's store queue.
        stored = pipeline.store(
            request.request_id, tokens, request.lora_id, request.lora_name, request.cache_salt
        )
        self.owners.claim(owner, request.request_id)
        if isinstance(stored, Pending):
            request_id = request.request_id

            def opened_nothing(_: object, error: BaseException | None) -> None:
                if error is not None:
                    self.owners.drop(request_id)

            stored.then(opened_nothing)
        return stored

    def release(self, request: Release) -> dict[str, Any] | Pending[dict[str, Any]]:
        self.owners.drop(request.request_id)
        for pipeline in self.pipelines:
            if pipeline.has_request(request.request_id):
                return pipeline.release(request.request_id)
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

    def reset(self, request: Reset) -> dict[str, Any]:
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
        markers = [{"rank": p.rank, "seq": p.reset()} for p in targets]
        elapsed = time.perf_counter() - started
        self._metrics.reset_done(elapsed)
        log.info(
            "reset rank(s) %s in %.0f us: markers %s",
            ", ".join(str(p.rank) for p in targets),
            elapsed * 1e6,
            ", ".join(f"{m['rank']}:{m['seq']}" for m in markers),
        )
        return {"markers": markers}

    def snapshot(self, request: Snapshot) -> Pending[Buffer]:
        """Answered once the rank's snapshot job is done and its reply put together, both a
        slice per loop turn: a snapshot never holds the loop."""
        pipeline = self._pipeline(request.rank)
        job = pipeline.snapshot().result
        reply = asyncio.ensure_future(self._snapshot_reply(request, pipeline.rank, job))
        return Pending.of_future(reply)

    async def _snapshot_reply(
        self, request: Snapshot, rank: int, job: asyncio.Future[SnapshotData]
    ) -> Buffer:
        try:
            snapshot = await asyncio.shield(job)
        except Exception as exc:
            log.debug("snapshot of rank %d failed: %r", rank, exc)
            error = error_reply(request.id, "internal", f"snapshot failed: {exc!r}")
            return memoryview(error)
        packer = msgpack.Packer(use_bin_type=True)
        head = {"ok": True, "id": request.id, "rank": rank, "seq": snapshot.seq}
        parts = [packer.pack_map_header(len(head) + 2)]
        for key, value in (*head.items(), ("epoch", self.epoch)):
            parts += (packer.pack(key), packer.pack(value))
        parts += (packer.pack("events"), packer.pack_array_header(snapshot.count))
        return await assemble([b"".join(parts), *snapshot.chunks])

    def pool_info(self, request: PoolInfo) -> dict[str, Any]:
        pipeline = self._pipeline(request.rank)
        return {"rank": pipeline.rank, **pipeline.pool_info()}

    def checksum(self, request: Checksum) -> Pending[bytes]:
        """Answered once the ids are decoded and every slice of them is checksummed, one
        slice per loop turn."""
        pipeline = self._pipeline(request.rank)
        num_blocks = pipeline.cache.pool.num_blocks
        if len(request.block_ids) > num_blocks:
            raise CacheError("too_large", f"block_ids: at most {num_blocks} ids")
        job = asyncio.ensure_future(self._checksum(request, pipeline))
        return self._settled(request, Pending.of_future(job))

    async def _checksum(self, request: Checksum, pipeline: RankPipeline) -> bytes:
        pool = pipeline.cache.pool
        ids = await decode_in_slices(request.block_ids.decoder("block_ids", 0, pool.num_blocks - 1))
        head = {"ok": True, "id": request.id, "rank": pipeline.rank}
        return await checksum_reply(head, len(ids), pool.checksum_steps(ids))
