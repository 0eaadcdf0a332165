"""One data-parallel rank, end to end: its cache (pool + index + open requests), its event sink
and its publisher, with the rules of every operation on that rank.

Every operation validates first and mutates after, so a refused request changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from typing import Any

import msgspec
import numpy as np
import zmq

from kvpubd.daemon.cache import CacheError, RankCache, StoreResult, UnpinParts
from kvpubd.daemon.drain import Drain
from kvpubd.daemon.encoded import reply_ids
from kvpubd.daemon.engine_reset import EngineResetCaller
from kvpubd.daemon.groups import pool_group_tag
from kvpubd.daemon.history import RESTART_OVERLAP, History, seq_origin
from kvpubd.daemon.hooks import MetricsHooks
from kvpubd.daemon.pending import Pending
from kvpubd.daemon.pool import SCRUB_SLICE_BYTES, pool_segment_name
from kvpubd.daemon.published import FrozenView, PublishedRecord
from kvpubd.daemon.publisher import Publisher
from kvpubd.daemon.reaper import QUIET_AFTER_RESET_S, Reaper
from kvpubd.daemon.relay import Relay
from kvpubd.daemon.seq_state import SeqState, open_seq_state
from kvpubd.daemon.settings import CacheConfig, Settings
from kvpubd.daemon.sink import EventSink, GroupTag
from kvpubd.daemon.snapshot import SnapshotJob
from kvpubd.daemon.stores import QUEUED_REQUESTS, SYNC_BLOCKS, StoreQueue
from kvpubd.daemon.transports import Transport, TransportSetup, create_transport
from kvpubd.protocol.control import (
    ComputedReply,
    GroupPoolInfo,
    GroupStats,
    HostTierInfo,
    PoolInfo,
    RankStats,
    ReleaseReply,
    ResetTier,
    Store,
    StoreReply,
)
from kvpubd.protocol.endpoints import engine_rank_endpoint, rank_endpoint
from kvpubd.protocol.int_arrays import IntArray
from kvpubd.protocol.wire import MAX_SEQ, MAX_SIGNED_SEQ, BlockStored
from kvpubd.upstream.flavours import FlavourDecoder
from kvpubd.upstream.follower import Condition, EngineFollower

log = logging.getLogger(__name__)

# Blocks captured (stored or removed) that go out as a batch at once, not at the next tick: a
# reset must publish everything captured before its marker, so this bounds what it encodes
# first (under heavy load the ticks fall far apart). A batch's fixed costs spread over this
# many blocks are a few hundredths of a microsecond each.
FLUSH_BLOCKS = 1024
# Housekeeping of the published records per drain tick (see compact).
COMPACT_BUDGET_S = 0.001
# Engine events handled (upstream mode) between loop turns at most: about 1 ms of decoding and
# relaying on the H200 host (vLLM reports each evicted block in an event of its own).
TURN_EVENTS = 512
# Host tier blocks whose removal or store a reset left to publish, captured per loop turn
# (about 1 us each: a reset behind them waits about half a millisecond).
BACKLOG_BLOCKS = 512


# The snapshot protocol's heartbeat: an idle rank publishes at least once a second.
SNAPSHOT_HEARTBEAT_MS = 1000


def _heartbeat_ms(configured: int, serves_snapshots: bool) -> int:
    """events.heartbeat_ms, at most SNAPSHOT_HEARTBEAT_MS while snapshots are served (its
    consumers take 5 s of silence for a dead publisher)."""
    if not serves_snapshots:
        return configured
    return min(configured, SNAPSHOT_HEARTBEAT_MS) if configured else SNAPSHOT_HEARTBEAT_MS


class RankPipeline:
    def __init__(
        self,
        rank: int,
        settings: Settings,
        context: zmq.Context[zmq.Socket[bytes]],
        metrics: MetricsHooks,
        reaper: Reaper,
        drain: Drain,
    ) -> None:
        events = settings.events
        self.rank = rank
        self._drain = drain
        self._metrics = metrics
        self._reaper = reaper
        self._flush_on_reset = events.flush_on_reset
        self._seq_state: SeqState | None = None
        last_seq: int | None = None
        if events.seq_origin == "continue":
            self._seq_state = open_seq_state(
                events.seq_state_dir, rank, rank_endpoint(events.endpoint, rank)
            )
            if self._seq_state is not None:
                last_seq = self._seq_state.loaded.last_seq
        serves_snapshots = bool(events.snapshot_endpoint)
        first_seq = seq_origin(
            events.seq_origin, last_seq, MAX_SIGNED_SEQ if serves_snapshots else MAX_SEQ
        )
        history = History(
            wire_format=events.wire_format,
            rank=rank,
            buffer_steps=events.buffer_steps,
            buffer_bytes=events.buffer_bytes,
            first_seq=first_seq,
            heartbeat_ms=_heartbeat_ms(events.heartbeat_ms, serves_snapshots),
            # Only where this run continues another's seqs (nothing lies below a first run).
            overlap=RESTART_OVERLAP if last_seq is not None and first_seq else 0,
            record_seq=self._seq_state.record if self._seq_state is not None else None,
            # Replays of history the ring no longer holds start from a snapshot batch.
            lost_history=self.snapshot if events.replay_snapshot else None,
            # The snapshot protocol's identity of this run of this rank: new at every start.
            publisher_id=uuid.uuid4().bytes if serves_snapshots else None,
        )
        # The transport first: a failed bind leaves nothing but sockets, which the context
        # closes.
        try:
            self.publisher: Publisher[Transport] = Publisher(
                history,
                create_transport(
                    TransportSetup(rank, settings, history, context, snapshots=self.snapshot)
                ),
            )
        except BaseException:
            if self._seq_state is not None:
                self._seq_state.close()
            raise
        self.sink = EventSink(
            block_size=settings.cache.block_size,
            medium=settings.medium,
            max_events_per_tick=events.max_events_per_tick,
            host_medium=settings.cache.host_medium if settings.cache.host_blocks else None,
            group=pool_group_tag(settings.cache),
        )
        upstream = settings.upstream
        try:
            self.cache = RankCache(
                # Upstream mode: the engine owns the pool; the cache is a placeholder.
                _no_pool(settings.cache) if upstream.on else settings.cache,
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
        self._upstream = upstream
        self.relay: Relay | None = None
        self._follower: EngineFollower | None = None
        self._following: asyncio.Task[None] | None = None
        self._engine_reset = (
            EngineResetCaller(upstream.reset_url) if upstream.on and upstream.reset_url else None
        )
        if upstream.on:
            self.relay = Relay(
                self.sink,
                events.hash_format,
                self._engine_cleared,
                reaper.retire,
                clears_per_block=upstream.flavour == "trtllm",
                clear_timeout=upstream.clear_timeout_ms / 1000,
                max_blocks=upstream.max_blocks,
            )
        self._stores = StoreQueue(
            self.cache,
            QUEUED_REQUESTS * settings.control.max_tokens_per_request,
            on_captured=self._flush_if_full,
        )
        self._max_open_requests = settings.control.max_open_requests
        self._wire_format = events.wire_format
        self._snapshot: SnapshotJob | None = None
        self._scrub: asyncio.Task[None] | None = None
        self.scrub_delay_s = QUIET_AFTER_RESET_S  # before a reset's scrub starts (tests: 0)
        self._backlog: asyncio.Task[None] | None = None

    # -- publishing ---------------------------------------------------------------------------

    def start(self) -> int | None:
        """Publish the startup marker, the run's first seq: subscribers forget what an earlier
        run published (and see a forward jump in seq, with the clock origin)."""
        self.sink.cleared()
        seq = self.flush()
        if self.relay is not None:
            self._following = asyncio.create_task(self._keep_following(), name="kvpubd upstream")
        return seq

    # -- upstream mode ------------------------------------------------------------------------

    async def _keep_following(self) -> None:
        """Follow the engine; should following fail (a bug), log it, forget what the engine
        published (subscribers get the marker) and follow it again from its start."""
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("rank %d: following the engine failed; starting over", self.rank)
                self._engine_cleared()
                self.flush()
                await asyncio.sleep(1.0)  # a bug that fails at once does not spin the loop

    async def _follow(self) -> None:
        """Republish the engine's batches as they come: at once when the engine has sent no
        more, else once FLUSH_BLOCKS are captured (a saturated engine's batches go out
        several to one of ours, encoded and sent once)."""
        relay, upstream, flavour = self.relay, self._upstream, self._upstream.flavour
        assert relay is not None and flavour
        replay = upstream.replay_endpoint
        self._follower = follower = EngineFollower(
            engine_rank_endpoint(upstream.endpoint, self.rank),
            engine_rank_endpoint(replay, self.rank) if replay else None,
            decoder=FlavourDecoder(
                flavour,
                default_medium=upstream.medium,
                tokens_encoded=True,
                max_payload_bytes=upstream.max_payload_bytes,
            ),
            topic=upstream.topic,
            rcvhwm=upstream.rcvhwm,
            max_payload_bytes=upstream.max_payload_bytes,
            idle_check=upstream.idle_check_ms / 1000 or None,
        )
        since_turn = 0  # engine events handled since the last loop turn
        try:
            async for batch in follower:
                if batch.condition:
                    if batch.condition & Condition.NEW_ENGINE:
                        relay.restart("the engine restarted")
                    elif batch.condition & Condition.RESTART:
                        relay.restart("the engine's seqs went back (restarted)", new_engine=False)
                    elif batch.condition & Condition.LOST:
                        lost = f"{batch.missing_before} engine batch(es) lost"
                        relay.restart(lost, new_engine=False)
                events = batch.events
                for start in range(0, len(events), TURN_EVENTS):
                    part = events[start : start + TURN_EVENTS]
                    if since_turn and since_turn + len(part) > TURN_EVENTS:
                        # A turn first: never more than TURN_EVENTS engine events in one (a
                        # large batch, thousands of evictions, goes a slice at a time).
                        self._flush_if_full()
                        since_turn = 0
                        await asyncio.sleep(0)
                    # Asked only while fencing: a poll of the socket per batch otherwise.
                    relay.apply(part, caught_up=not relay.fencing or not follower.more_ready)
                    since_turn += len(part)
                while self._drain.paused:  # read no more than goes out
                    await asyncio.sleep(0.01)
                flush = not follower.more_ready or self.sink.pending_blocks >= FLUSH_BLOCKS
                if flush:
                    self.flush()
                # The follower hands over a burst of batches with no turn of its own, and a
                # reset must not wait behind all of them: a turn per flush, and one at least
                # every TURN_EVENTS (batches that publish nothing, as while a reset drops the
                # engine's events before its clear, are never flushed; see above for one
                # large batch).
                if flush or since_turn >= TURN_EVENTS:
                    since_turn = 0
                    await asyncio.sleep(0)
        finally:
            follower.close()

    def _engine_cleared(self) -> None:
        """The engine's own AllBlocksCleared (or a restart): the marker, and nothing kept."""
        assert self.relay is not None
        self._reaper.retire(*self.sink.cleared())
        self.relay.clear()

    def check_owned(self, op: str) -> None:
        """CacheError ``upstream`` for an op on the pool while the engine owns it."""
        if self.relay is not None:
            raise CacheError(
                "upstream",
                f"{op}: this daemon follows an engine (upstream mode), which owns its blocks",
            )

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

    def will_be_open(self, request_id: str | int) -> bool:
        """Open, or still being stored with no release queued behind: a store of this id
        now would be a duplicate."""
        return request_id in self.cache.leases or self._stores.opens(request_id)

    @property
    def open_requests(self) -> int:
        return len(self.cache.leases)

    def store(
        self, request: Store, tokens: np.ndarray | IntArray, queued: bool = False
    ) -> StoreReply | Pending[StoreReply]:
        """The store's reply, or the one to come for a store done in slices (a large one, a
        long token list still to decode, any behind queued work, or one ``queued`` by its
        caller). ``tokens``: the request's, decoded (or located, to decode a slice per loop
        turn)."""
        self.check_owned("store")
        opened = len(self.cache.leases) + self._stores.stores_queued
        if opened >= self._max_open_requests:
            raise CacheError(
                "too_many_requests",
                f"{opened} requests are open on rank {self.rank}, the most it takes "
                "(control.max_open_requests): release some first",
            )
        if (
            queued
            or self.cache.copies_async  # its reply waits for its copies, in order
            or self._stores.busy
            or isinstance(tokens, IntArray)
            or len(tokens) // self.cache.block_size * self.cache.block_units > SYNC_BLOCKS
        ):
            return self._stores.submit(request, tokens).map(self._store_reply)
        return self._store_reply(self.cache.store(request, tokens))

    def _flush_if_full(self) -> None:
        # Right after a capture (also a slice of one done in slices): while the drain is
        # paused, nothing goes out before a reset or a resume.
        if self.sink.pending_blocks >= FLUSH_BLOCKS and not self._drain.paused:
            self.flush()

    def _store_reply(self, result: StoreResult) -> StoreReply:
        self._flush_if_full()
        block_ids, cached, groups = result
        return StoreReply(self.rank, reply_ids(block_ids), cached, groups)

    def release(self, request_id: str | int) -> ReleaseReply | Pending[ReleaseReply]:
        """The release's reply; for a store still under way or queued, those to come
        once it is done, answered right after it: a client that sends store and release back
        to back never leaves blocks pinned. An open request is closed at once (a reset right
        behind it is not refused busy); its blocks are unpinned before any later store of the
        rank runs, a slice per loop turn when there are many."""
        if self._stores.holds(request_id):
            return self._stores.submit_release(request_id).map(self._release_reply)
        lease = self.cache.end_lease(request_id)
        self._unpin(lease.parts())
        return self._release_reply(lease.size)

    def computed(self, request_id: str | int, computed_tokens: int) -> ComputedReply:
        """Let go of what fell out of the request's sliding windows (see RankCache)."""
        if self._stores.holds(request_id):
            raise CacheError(
                "busy",
                f"request {request_id!r} is still being stored; send computed after its reply",
            )
        return ComputedReply(
            self.rank, self._unpin(self.cache.let_window_go(request_id, computed_tokens))
        )

    def _unpin(self, parts: UnpinParts) -> int:
        """Unpin blocks of a closed request (or out of its window), before any later store of
        the rank runs: now, or a slice per loop turn behind queued work or when there are
        many. Returns how many."""
        count = sum(len(blocks) for _, blocks in parts)
        if self._stores.busy or count > SYNC_BLOCKS:
            self._stores.submit_unpin(parts)
        else:
            for group, blocks in parts:
                self.cache.unpin(blocks, group)
        return count

    def _release_reply(self, released: int) -> ReleaseReply:
        return ReleaseReply(self.rank, released)

    def reset(self, tier: ResetTier = "all") -> int | None:
        """Clear the cache (every tier, or the pool alone: ``tier`` "gpu") and publish the
        marker at once, after everything captured before it; returns the marker's seq (None
        with ``flush_on_reset`` off). What costs O(blocks) — zeroing freed blocks, freeing the
        old index, publishing what the host tier's readers need after the marker — waits
        until the reply is out."""
        every_tier = tier == "all"
        retired = self.cache.clear(every_tier)
        published = self.sink.cleared(every_tier)
        if self.relay is not None:
            # Queued for the engine's thread, called once the marker is out (this step): the
            # engine's events from before its clear are void.
            called = self._engine_reset is not None and self._engine_reset.call()
            self.relay.clear(fence=True, engine_called=called)
        self.resets += 1
        seq = self.flush() if self._flush_on_reset else None
        self._scrub_freed()
        self._reaper.retire(retired, *published)
        if self.cache.host is not None and (self._backlog is None or self._backlog.done()):
            self._backlog = asyncio.create_task(self._publish_backlog(), name="kvpubd backlog")
        return seq

    async def _publish_backlog(self) -> None:
        """What resets left the host tier to publish, BACKLOG_BLOCKS per loop turn from the
        next one on (the reply goes out first), each slice after what was captured before
        it; out at once in batches of FLUSH_BLOCKS, or with the next tick."""
        while True:
            await asyncio.sleep(0)
            more = self.cache.publish_backlog(BACKLOG_BLOCKS)
            self._flush_if_full()
            if not more:
                return

    def _scrub_freed(self) -> None:
        """Zero the blocks the reset freed, a slice per loop turn, once ``scrub_delay_s`` has
        passed (the reply and the marker leave first; a block handed out before the scrub
        reaches it is zeroed then); already running, the scrub takes in what this reset
        freed."""
        if self._scrub is None or self._scrub.done():
            self._scrub = asyncio.create_task(self._scrub_slices(), name="kvpubd scrub")

    async def _scrub_slices(self) -> None:
        # Every group's pool, one after the other (one slice per loop turn in all).
        wait = self.scrub_delay_s
        for pool in [self.cache.pool, *(group.pool for group in self.cache.groups)]:
            while True:
                await asyncio.sleep(wait)
                wait = 0
                if pool.scrub_some(SCRUB_SLICE_BYTES):
                    break

    def snapshot(self) -> SnapshotJob:
        """The job building the published blocks (one-block stores, parents first) at the
        current seq. Requests share it: one build per published state, however many ask (a
        finished build stands for later seqs while only empty batches, heartbeats, went out)."""
        job = self._snapshot
        if job is not None and not job.result.done():
            return job
        history = self.publisher.history
        if (
            job is not None
            and not job.result.cancelled()
            and job.result.exception() is None
            and job.seq >= history.last_event_seq
            and not self.sink.pending_count
        ):
            if job.seq < history.last_seq:
                job.advance_to(history.last_seq)
            return job
        self._retire_snapshot()
        self._snapshot = SnapshotJob(self, self._wire_format)
        return self._snapshot

    def _retire_snapshot(self) -> None:
        """Let go of the finished snapshot no request can use any more, its chunks freed a
        slice per loop turn by the reaper (in one go they would hold a reset back)."""
        job, self._snapshot = self._snapshot, None
        result = job.result if job is not None else None
        built = result is not None and result.done() and not result.cancelled()
        if built and result is not None and result.exception() is None:
            self._reaper.retire(result.result())
        self.publisher.history.forget_snapshot_batch()

    # What a snapshot job reads.

    def freeze_published(self) -> tuple[int, list[FrozenView[Any]]] | None:
        # Publish what is captured first, so the views are exactly the state at its seq.
        self.flush()
        views: list[FrozenView[Any]] = []
        for tier, record in enumerate(self.current_records()):
            view = record.freeze(functools.partial(self._removed_block_event, tier))
            if view is None:
                for made in views:
                    made.close()
                record.compact_some(retire=self._reaper.retire)
                return None
            views.append(view)
        return self.publisher.last_seq, views

    def current_records(self) -> list[PublishedRecord[Any]]:
        """The published records: the pool's, then the host tier's, then those of a hybrid
        cache's other groups (upstream mode: the relay's alone)."""
        if self.relay is not None:
            return list(self.relay.records)
        sink = self.sink
        records = [sink.published]
        if self.cache.host is not None:
            records.append(sink.host_published)
        return records + [lane.published for lane in sink.lanes]

    def block_events(self, tier: int, block_ids: list[Any]) -> list[BlockStored]:
        """The stores of the blocks of record ``tier`` (see current_records): its ids are
        slot numbers, or the relay's block keys."""
        if self.relay is not None:
            return self.relay.block_events(block_ids)
        if tier == 0:
            return self.cache.block_events(block_ids)
        if self.cache.host is not None:
            if tier == 1:
                return self.cache.host_block_events(block_ids)
            tier -= 1
        return self.cache.groups[tier - 1].block_events(block_ids, self.sink.medium)

    def _removed_block_event(self, tier: int, block_id: int) -> BlockStored:
        """The block's store, kept past its removal: its tokens copied out of the slot."""
        event = self.block_events(tier, [block_id])[0]
        if self.relay is None:  # the relay's are a list of their own already
            event.token_ids = np.array(event.token_ids)  # type: ignore[assignment]
        return event

    def compact(self) -> None:
        """One slice of housekeeping (the drain loop calls it): on the published records, and
        letting go of a finished snapshot that no request can use any more."""
        # Slices until done or COMPACT_BUDGET_S is spent: a relay stores up to a million
        # blocks a second, whose log entries must go as fast (a few tens of ns each when
        # marked stale), yet no slice may hold a reset back for long.
        deadline = time.perf_counter() + COMPACT_BUDGET_S
        for record in self.current_records():
            while record.needs_compaction and time.perf_counter() < deadline:
                record.compact_some(retire=self._reaper.retire)
        job = self._snapshot
        if (
            job is not None
            and job.result.done()
            and job.seq < self.publisher.history.last_event_seq
        ):
            # Events went out since it was built: every later request builds anew, so its
            # chunks (hundreds of MiB at a million blocks) need not wait for that. Replies
            # still being sent hold their own references.
            self._retire_snapshot()

    def pool_info(self) -> PoolInfo:
        self.check_owned("pool_info")
        info = self.cache.pool.info(self.rank)
        if self.cache.groups:
            return self._group_pool_info(info)
        host = self.cache.host
        if host is None:
            return info
        shm = host.pool.info(self.rank)
        assert shm.name is not None
        tier = HostTierInfo(name=shm.name, shape=shm.shape, dtype=shm.dtype, medium=host.medium)
        return msgspec.structs.replace(info, host=tier)

    def _group_pool_info(self, info: PoolInfo) -> PoolInfo:
        """The pool info of a hybrid cache: the pool's group's, with every group's pool."""
        tag = self.sink.pool_lane.tag
        assert tag is not None
        pools = [
            _group_pool(group.pool.info(self.rank), group.lane.tag) for group in self.cache.groups
        ]
        pools.insert(tag.idx, _group_pool(info, tag))
        return msgspec.structs.replace(info, groups=pools)

    def stats(self) -> RankStats:
        pool = self.cache.pool
        history, transport = self.publisher.history, self.publisher.transport
        return RankStats(
            rank=self.rank,
            first_seq=history.first_seq,
            seq=history.last_seq,
            batches_published=history.batches,
            events_published=history.events,
            dropped_stored_blocks=self.sink.dropped_stored_blocks,
            resets=self.resets,
            replay_requests=transport.replay_requests,
            replays_refused=transport.replays_refused,
            blocks_capacity=pool.num_blocks,
            blocks_used=pool.used_count,
            blocks_free=pool.free_count,
            # Upstream mode: the engine's blocks, as the relay holds and published them.
            blocks_cached=len(self.relay) if self.relay is not None else len(self.cache.index),
            blocks_pinned=self.cache.pinned_blocks,
            blocks_published=len(self.current_records()[0]),
            requests_open=len(self.cache.leases),
            events_pending=self.sink.pending_count,
            endpoint=transport.endpoint,
            replay_endpoint=transport.replay_endpoint,
            publisher_id=history.publisher_id or b"",
            snapshot_endpoint=transport.snapshot_endpoint,
            snapshot_requests=transport.snapshot_requests,
            snapshots_unavailable=transport.snapshots_unavailable,
            events_by_type=self._metrics.event_counts(self.rank),
            **self._host_stats(),
            **self._upstream_stats(),
            groups=self._group_stats(),
        )

    def _upstream_stats(self) -> dict[str, int]:
        relay, follower = self.relay, self._follower
        if relay is None:
            return {}
        counters = follower.counters if follower is not None else None
        return {
            "upstream_batches": counters.live + counters.replayed if counters else 0,
            "upstream_replayed": counters.replayed if counters else 0,
            "upstream_lost": counters.lost if counters else 0,
            "upstream_restarts": counters.restarts if counters else 0,
            "upstream_malformed": counters.malformed if counters else 0,
            "upstream_dropped_by_reset": relay.dropped_by_reset,
            "upstream_fences_timed_out": relay.fences_timed_out,
            "upstream_duplicate_blocks": relay.duplicates,
            "upstream_unknown_removals": relay.unknown_removals,
            "upstream_skipped_blocks": relay.non_dense_blocks + relay.over_limit + relay.orphans,
        }

    def _group_stats(self) -> list[GroupStats]:
        cache, sink = self.cache, self.sink
        tag = sink.pool_lane.tag
        if tag is None:
            return []
        # Every group of a store with a partial block holds a tail block.
        stats = [
            GroupStats(
                group_idx=group.lane.tag.idx,
                kv_cache_spec_kind=group.spec.kind,
                blocks_capacity=group.pool.num_blocks,
                blocks_free=group.pool.free_count,
                blocks_cached=len(group.index),
                blocks_pinned=group.pinned_blocks + cache.tail_blocks,
                blocks_published=len(group.lane.published),
            )
            for group in cache.groups
            if group.lane.tag is not None
        ]
        own = GroupStats(
            group_idx=tag.idx,
            kv_cache_spec_kind=tag.kind,
            blocks_capacity=cache.pool.num_blocks,
            blocks_free=cache.pool.free_count,
            blocks_cached=len(cache.index),
            blocks_pinned=cache.pinned_blocks,
            blocks_published=len(sink.published),
        )
        stats.insert(tag.idx, own)
        return stats

    def _host_stats(self) -> dict[str, int]:
        host = self.cache.host
        if host is None:
            return {}
        return {
            "host_blocks_capacity": host.capacity,
            "host_blocks_cached": len(host),
            "host_blocks_held": host.held,
        }

    def close(self, linger_ms: int | None = None) -> None:
        """``linger_ms``: what queued events get at most (None: service.linger_ms)."""
        self._stores.close()
        for task in (self._scrub, self._backlog, self._following):
            if task is not None:
                task.cancel()
        if self._snapshot is not None:
            self._snapshot.cancel()
        self.publisher.close(linger_ms)
        if self._engine_reset is not None:
            self._engine_reset.close()
        if self._seq_state is not None:
            self._seq_state.close()
        self.cache.close()


def _group_pool(info: PoolInfo, tag: GroupTag | None) -> GroupPoolInfo:
    assert tag is not None
    return GroupPoolInfo(
        group_idx=tag.idx,
        kv_cache_spec_kind=tag.kind,
        sliding_window=tag.sliding_window,
        kind=info.kind,
        shape=info.shape,
        dtype=info.dtype,
        block_bytes=info.block_bytes,
        name=info.name,
        handle=info.handle,
        device=info.device,
        offset=info.offset,
    )


def _no_pool(cache: CacheConfig) -> CacheConfig:
    """The cache of a rank in upstream mode: one block, no groups, no host tier."""
    return cache.model_copy(
        update={
            "num_blocks": 1,
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_dim": 1,
            "dtype": "uint8",
            "groups": [],
            "host_blocks": 0,
            "device": "cpu",
            "rank_devices": [],
        }
    )
