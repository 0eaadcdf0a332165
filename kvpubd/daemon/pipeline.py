"""One data-parallel rank, end to end: its cache (pool + index + open requests), its event sink
and its publisher, with the rules of every operation on that rank.

Every operation validates first and mutates after, so a refused request changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from kvpubd.daemon.cache import CacheError, RankCache
from kvpubd.daemon.hooks import MetricsHooks
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.pool import pool_segment_name
from kvpubd.daemon.published import FrozenView, PublishedRecord
from kvpubd.daemon.publisher import RESTART_OVERLAP, Publisher, seq_origin
from kvpubd.daemon.reaper import Reaper
from kvpubd.daemon.seq_state import SeqState, open_seq_state
from kvpubd.daemon.sink import EventSink
from kvpubd.daemon.snapshot import SnapshotJob
from kvpubd.daemon.stores import QUEUED_REQUESTS, SYNC_BLOCKS, StoreQueue, StoreResult
from kvpubd.protocol.config import Settings, rank_endpoint
from kvpubd.protocol.wire import BlockStored

# Blocks captured (stored or removed) that go out as a batch at once, not at the next tick: a
# reset must publish everything captured before its marker, so this bounds what it encodes
# first (under heavy load the ticks fall far apart). A batch's fixed costs spread over this
# many blocks are a few hundredths of a microsecond each.
FLUSH_BLOCKS = 1024


class RankPipeline:
    def __init__(
        self,
        rank: int,
        settings: Settings,
        context: zmq.Context,
        metrics: MetricsHooks,
        reaper: Reaper,
        drain_paused: Callable[[], bool] = lambda: False,
    ) -> None:
        events = settings.events
        self.rank = rank
        self._drain_paused = drain_paused
        self._metrics = metrics
        self._reaper = reaper
        self._flush_on_reset = events.flush_on_reset
        endpoint = rank_endpoint(events.endpoint, rank)
        self._seq_state: SeqState | None = None
        last_seq: int | None = None
        if events.seq_origin == "continue":
            self._seq_state = open_seq_state(events.seq_state_dir, rank, endpoint)
            if self._seq_state is not None:
                last_seq = self._seq_state.loaded.last_seq
        first_seq = seq_origin(events.seq_origin, last_seq)
        # Sockets first: a failed bind leaves nothing but sockets, which the context closes.
        try:
            self.publisher = Publisher(
                context,
                endpoint=endpoint,
                replay_endpoint=rank_endpoint(events.replay_endpoint, rank)
                if events.replay_endpoint
                else "",
                topic=events.topic,
                wire_format=events.wire_format,
                rank=rank,
                buffer_steps=events.buffer_steps,
                max_replays=events.max_replays,
                hwm=events.hwm,
                replay_framing=events.replay_framing,
                linger_ms=settings.service.linger_ms,
                first_seq=first_seq,
                heartbeat_ms=events.heartbeat_ms,
                # Only where this run continues another's seqs (nothing lies below a first run).
                overlap=RESTART_OVERLAP if last_seq is not None and first_seq else 0,
                record_seq=self._seq_state.record if self._seq_state is not None else None,
            )
        except BaseException:
            if self._seq_state is not None:
                self._seq_state.close()
            raise
        self.sink = EventSink(
            block_size=settings.cache.block_size,
            medium=settings.medium,
            max_events_per_tick=events.max_events_per_tick,
        )
        try:
            self.cache = RankCache(
                settings.cache,
                self.sink,
                events.hash_format,
                rank,
                pool_name=pool_segment_name(settings.control.endpoint, rank),
            )
        except BaseException:
            # Never handed to the service, so never closed by it: its ipc socket files
            # would outlive a failed start and look like a running daemon to clients.
            self.publisher.close()
            if self._seq_state is not None:
                self._seq_state.close()
            raise
        self.resets = 0
        self._stores = StoreQueue(
            self.cache, QUEUED_REQUESTS * settings.control.max_tokens_per_request
        )
        self._wire_format = events.wire_format
        self._snapshot: SnapshotJob | None = None
        # Replays of history the ring no longer holds start from a snapshot batch.
        if events.replay_snapshot:
            self.publisher.lost_history = self.snapshot

    # -- publishing ---------------------------------------------------------------------------

    def start(self) -> int | None:
        """Publish the startup marker, the run's first seq: subscribers forget what an earlier
        run published (and see a forward jump in seq, with the clock origin)."""
        self.sink.cleared()
        return self.flush()

    def flush(self, new_tick: bool = False) -> int | None:
        """Publish everything captured as one batch; returns its seq, or None if nothing was.
        ``new_tick``: this is the periodic drain, which starts a fresh capture budget."""
        events = self.sink.drain(new_tick)
        if not events:
            return None
        seq = self.publisher.publish(events)
        self._metrics.published(self.rank, events)
        return seq

    # -- operations ---------------------------------------------------------------------------

    def has_request(self, request_id: str | int) -> bool:
        """Open, or still being stored."""
        return request_id in self.cache.leases or self._stores.holds(request_id)

    @property
    def open_requests(self) -> int:
        return len(self.cache.leases)

    def store(
        self,
        request_id: str | int,
        tokens: np.ndarray,
        lora_id: int | None,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> dict[str, Any] | Pending[dict[str, Any]]:
        """The store's reply fields, or those to come for a store done in slices (a large
        one, or any behind one)."""
        if self._stores.busy or len(tokens) // self.cache.block_size > SYNC_BLOCKS:
            stored = self._stores.submit(request_id, tokens, lora_id, lora_name, cache_salt)
            return stored.map(self._store_reply)
        return self._store_reply(
            self.cache.store(request_id, tokens, lora_id, lora_name, cache_salt)
        )

    def _store_reply(self, result: StoreResult) -> dict[str, Any]:
        # Right after the store's capture (also for one done in slices): while the drain is
        # paused, nothing goes out before a reset or a resume.
        if self.sink.pending_blocks >= FLUSH_BLOCKS and not self._drain_paused():
            self.flush()
        block_ids, cached = result
        return {"rank": self.rank, "block_ids": block_ids, "num_cached_tokens": cached}

    def release(self, request_id: str | int) -> dict[str, Any] | Pending[dict[str, Any]]:
        """The release's reply fields; for a store still under way (a large one, or one
        queued behind it), those to come once it is done, answered right after the store: a
        client that sends store and release back to back never leaves blocks pinned."""
        store = self._stores.result_of(request_id)
        if store is None:
            return self._released(request_id)
        released: Pending[dict[str, Any]] = Pending()

        def after_store(_: StoreResult | None, error: BaseException | None) -> None:
            if isinstance(error, asyncio.CancelledError):
                released.fail(error)
                return
            try:
                # A store that failed opened nothing: the release finds nothing open.
                released.resolve(self._released(request_id))
            except CacheError as exc:
                released.fail(exc)

        store.then(after_store)
        return released

    def _released(self, request_id: str | int) -> dict[str, Any]:
        return {"rank": self.rank, "released": self.cache.release(request_id)}

    def reset(self) -> int | None:
        """Clear the cache and publish the marker at once, after everything captured before
        it; returns the marker's seq (None with ``flush_on_reset`` off). What costs O(blocks)
        — zeroing freed blocks, freeing the old index — waits until the reply is out."""
        retired = self.cache.clear()
        published = self.sink.cleared()
        self.resets += 1
        seq = self.flush() if self._flush_on_reset else None
        # Runs after the current loop callback, the one that sends the reply.
        asyncio.get_running_loop().call_soon(self.cache.pool.scrub_pending)
        self._reaper.retire(retired, published)
        return seq

    def snapshot(self) -> SnapshotJob:
        """The job building the published blocks (one-block stores, parents first) at the
        current seq. Requests share it: one build per published seq, however many ask."""
        job = self._snapshot
        if job is not None and not job.result.done():
            return job
        if (
            job is not None
            and job.seq == self.publisher.last_seq
            and not self.sink.pending_count
            and not job.result.cancelled()
            and job.result.exception() is None
        ):
            return job
        self._snapshot = SnapshotJob(self, self._wire_format)
        return self._snapshot

    # What a snapshot job reads.

    def freeze_published(self) -> tuple[int, FrozenView] | None:
        # Publish what is captured first, so the view is exactly the state at its seq.
        self.flush()
        record = self.sink.published
        view = record.freeze(self._removed_block_event)
        if view is None:
            record.compact_some()
            return None
        return self.publisher.last_seq, view

    def current_record(self) -> PublishedRecord:
        return self.sink.published

    def block_events(self, block_ids: list[int]) -> list[BlockStored]:
        return self.cache.block_events(block_ids)

    def _removed_block_event(self, block_id: int) -> BlockStored:
        return self.cache.block_events([block_id])[0]

    def compact(self) -> None:
        """One slice of housekeeping on the published record (the drain loop calls it)."""
        record = self.sink.published
        if record.needs_compaction:
            record.compact_some()

    def checksum(self, block_ids: list[int]) -> list[int]:
        pool = self.cache.pool
        if len(block_ids) > pool.num_blocks:
            raise CacheError("too_large", f"block_ids: at most {pool.num_blocks} ids")
        bad = [b for b in block_ids if b >= pool.num_blocks]
        if bad:
            raise CacheError(
                "bad_request", f"block_ids: {bad[0]} is not a block (pool has {pool.num_blocks})"
            )
        return pool.checksum(block_ids)

    def pool_info(self) -> dict[str, Any]:
        return self.cache.pool.info()

    def stats(self) -> dict[str, Any]:
        pool = self.cache.pool
        publisher = self.publisher
        return {
            "rank": self.rank,
            "first_seq": publisher.first_seq,
            "seq": publisher.last_seq,
            "batches_published": publisher.batches,
            "events_published": publisher.events,
            "dropped_stored_blocks": self.sink.dropped_stored_blocks,
            "resets": self.resets,
            "replay_requests": publisher.replay_requests,
            "replays_refused": publisher.replays_refused,
            "blocks_capacity": pool.num_blocks,
            "blocks_used": pool.used_count,
            "blocks_free": pool.free_count,
            "blocks_cached": len(self.cache.index),
            "blocks_pinned": self.cache.pinned_blocks,
            "blocks_published": len(self.sink.published),
            "requests_open": len(self.cache.leases),
            "events_pending": self.sink.pending_count,
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
        }

    def close(self) -> None:
        self._stores.close()
        if self._snapshot is not None:
            self._snapshot.cancel()
        self.publisher.close()
        if self._seq_state is not None:
            self._seq_state.close()
        self.cache.pool.close()
