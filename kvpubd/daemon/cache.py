"""One rank's KV cache: block pool + radix index + open requests, reporting to its sink.

Every operation validates first and mutates after, so a refused request changes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpubd.daemon.encoded import EncodedArray
from kvpubd.daemon.groups import GroupLease, GroupPlan, SecondaryGroup
from kvpubd.daemon.host_tier import HostTier
from kvpubd.daemon.pool import BlockPool, create_pool, rank_device
from kvpubd.daemon.radix import ROOT, RadixIndex
from kvpubd.daemon.settings import CacheConfig
from kvpubd.daemon.sink import EventSink, StoreKeys, one_block_stores, store_keys, stored_event
from kvpubd.daemon.tier_copy import Fence
from kvpubd.protocol.control import GroupBlocks, Store
from kvpubd.protocol.hashing import TOKEN_DTYPE, HashFormat, chain_digests, root_key, wire_hasher
from kvpubd.protocol.wire import BlockHash, BlockStored

RequestId = str | int


class CacheError(Exception):
    """A refused operation; ``code`` is the control protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# Pinned blocks per group: (0 for the pool's group, 1.. the others', block ids).
UnpinParts = list[tuple[int, list[int]]]


@dataclass(slots=True)
class Lease:
    """The blocks an open request pins: its full blocks (cached) and its partial tail block,
    in the pool's group, and in each other group of a hybrid cache."""

    blocks: list[int]
    tail_block: int | None
    groups: list[GroupLease] = field(default_factory=list)

    @property
    def size(self) -> int:
        held = len(self.blocks) + (self.tail_block is not None)
        return held + sum(len(g.blocks) + (g.tail_block is not None) for g in self.groups)

    def parts(self) -> UnpinParts:
        """The pinned blocks to unpin, per group: (0 for the pool's, 1.. the others, ids)."""
        return [(0, self.blocks)] + [(n, g.blocks) for n, g in enumerate(self.groups, 1)]


BlockIds = list[int] | EncodedArray
# The reply's block ids, cached tokens and, on a hybrid cache, every group's blocks.
StoreResult = tuple[BlockIds, int, list[GroupBlocks] | None]


@dataclass(slots=True)
class StorePlan:
    """A store under way: its cached prefix matched, then pinned, then its new blocks inserted,
    each a slice at a time if the caller wants (``match_some``, ``pin_some``, ``insert_some``);
    ``finish_store`` opens its lease. A ``clear`` in between makes it stale (``generation``).

    Between the slices of one plan nothing but a clear may change which blocks are cached or
    pinned, so its match and room check stay true: the store queue holds the rank's other
    stores and unpinning back meanwhile (a release closing a lease frees only its tail block:
    more room, never less)."""

    request_id: RequestId
    tokens: np.ndarray
    digests: list[bytes]
    keys: StoreKeys  # what the store mixes into its blocks' identity, as published
    has_tail: bool
    generation: int
    blocks: list[int] = field(default_factory=list)  # matched, then inserted: the lease's
    matched: int = 0
    matched_unpinned: int = 0  # of the matched blocks, those no request pinned
    matching: bool = True
    # The host tier's slots of the blocks right after the matched ones, held until they are
    # copied back (promoted); found while ``promoting``, at ``host_generation``.
    promoted: list[int] = field(default_factory=list)
    promoting: bool = False
    host_generation: int = 0
    pinned: int = 0
    # A hybrid cache's other groups: each one's part, located after the pool's match, and the
    # prefix every group can serve (what the reply counts as cached).
    groups: list[GroupPlan] = field(default_factory=list)
    locating: bool = False
    located: int = 0
    hit: int = 0
    last: int = ROOT  # the block the next inserted run hangs under
    # A store done in slices encodes its reply's ids a slice at a time (see encoded.py).
    reply_ids: EncodedArray | None = None


class RankCache:
    def __init__(
        self,
        config: CacheConfig,
        sink: EventSink,
        hash_format: HashFormat,
        rank: int = 0,
        pool_name: str | None = None,
    ) -> None:
        self.block_size = config.block_size
        self.wire_hash = wire_hasher(hash_format)
        specs = config.group_specs()
        primary = specs[config.primary_group]
        device = rank_device(config, rank)
        self.pool = create_pool(
            device, primary.num_blocks, primary.block_bytes, config.scrub_on_free, rank, pool_name
        )
        self.index = RadixIndex(primary.num_blocks)
        sink.size_records(primary.num_blocks, config.host_blocks)
        self.groups: list[SecondaryGroup] = []
        try:
            for spec in specs:
                if spec is primary:
                    continue
                name = None if pool_name is None else f"{pool_name}-g{spec.idx}"
                pool = create_pool(
                    device, spec.num_blocks, spec.block_bytes, config.scrub_on_free, rank, name
                )
                group = SecondaryGroup(spec, self.block_size, pool, sink, self.wire_hash)
                self.groups.append(group)
        except BaseException:
            self._close_pools()
            raise
        self.host: HostTier | None = None
        if config.host_blocks:
            try:
                self.host = HostTier(
                    config.host_blocks,
                    config.block_size,
                    config.block_bytes,
                    sink.host_medium,
                    self.pool,
                    None if pool_name is None else f"{pool_name}-host",
                )
            except BaseException:
                self._close_pools()
                raise
            if not self.host.copier.synchronous:
                # A store's reply waits for its copies on the pool's stream, and for the
                # scrubs enqueued there with them (copy_fence): allocating never waits for a
                # stream on which demotions run ahead of the scrubs.
                self.pool.sync_scrubs = False
        # Token ids of each cached block, indexed by block id (kept for snapshots).
        self.tokens = np.zeros((primary.num_blocks, config.block_size), dtype=TOKEN_DTYPE)
        self.leases: dict[RequestId, Lease] = {}
        self.tail_blocks = 0  # open leases' tail blocks: kept, so stats never walk the leases
        self.sink = sink
        self.hash_algorithm = config.hash_algorithm
        self.generation = 0  # bumped by every clear
        # Work per stored block, in blocks of a cache without a host tier: a store that evicts
        # then also copies each evicted block to the host tier and publishes it there (and
        # the tier's oldest block out), about as much again. Stores are sliced by it.
        self.block_units = 2 if self.host is not None else 1
        self._copied = False  # tier copies enqueued since the last copy_fence

    @property
    def copies_async(self) -> bool:
        """Tier copies run behind the loop's back (on a GPU stream): see copy_fence."""
        return self.host is not None and not self.host.copier.synchronous

    @property
    def pinned_blocks(self) -> int:
        return len(self.index) - self.index.unpinned + self.tail_blocks

    def store(self, request: Store, tokens: np.ndarray) -> StoreResult:
        """Match the cached prefix, allocate and pin the rest, in one step (``tokens``: the
        request's, decoded)."""
        algorithm = self.hash_algorithm
        root = root_key(request.lora_id, request.cache_salt, algorithm)
        digests = chain_digests(tokens, self.block_size, root, algorithm)
        plan = self.begin_store(request, tokens, digests)
        everything = len(digests)
        while not self.match_some(plan, everything):
            pass  # the pool's prefix, then the host tier's, then the other groups'
        self.check_room(plan)
        self.pin_some(plan, everything)
        self.insert_some(plan, everything)
        while not self.group_some(plan, everything):
            pass
        return self.finish_store(plan)

    def begin_store(
        self, request: Store, tokens: np.ndarray, digests: list[bytes], in_slices: bool = False
    ) -> StorePlan:
        """A plan for a store; nothing changes yet."""
        request_id = request.request_id
        if request_id in self.leases:
            raise CacheError("duplicate_request", f"request {request_id!r} is already open")
        return StorePlan(
            request_id,
            tokens,
            digests,
            store_keys(request.lora_id, request.lora_name, request.cache_salt),
            len(tokens) % self.block_size != 0,
            self.generation,
            reply_ids=EncodedArray() if in_slices else None,
            groups=[GroupPlan() for _ in self.groups],
            locating=bool(self.groups),
        )

    def match_some(self, plan: StorePlan, limit: int) -> bool:
        """Match up to ``limit`` more blocks of the cached prefix, then of its continuation on
        the host tier, then locate as many in each other group; True once all are done."""
        if plan.matching:
            wanted = plan.digests[plan.matched : plan.matched + limit]
            found = self.index.match(wanted)
            if found:
                plan.blocks += found
                plan.matched += len(found)
                plan.last = found[-1]
            plan.matched_unpinned += self.index.count_unpinned(found)
            plan.matching = len(found) == len(wanted) and plan.matched < len(plan.digests)
            if not plan.matching and self.host is not None:
                plan.promoting = plan.matched < len(plan.digests)
                plan.host_generation = self.host.generation
        elif plan.promoting and self.host is not None:
            start = plan.matched + len(plan.promoted)
            wanted = plan.digests[start : start + limit]
            found = self.host.match(wanted)
            self.host.hold(found)
            plan.promoted += found
            plan.promoting = len(found) == len(wanted) and start + len(found) < len(plan.digests)
        elif plan.locating:
            wanted = plan.digests[plan.located : plan.located + limit]
            for group, part in zip(self.groups, plan.groups, strict=True):
                group.locate_some(part, wanted)
            plan.located += len(wanted)
            if plan.located == len(plan.digests):
                self._settle_hit(plan)
        return not plan.matching and not plan.promoting and not plan.locating

    def _settle_hit(self, plan: StorePlan) -> None:
        """The prefix every group can serve, as vLLM's hybrid coordinator finds it: each
        group's hit capped by the shortest so far, until none is shorter."""
        hit = plan.matched
        while True:
            parts = zip(self.groups, plan.groups, strict=True)
            shortest = min(group.hit(part, hit) for group, part in parts)
            if shortest == hit:
                break
            hit = shortest
        plan.hit = hit
        for group, part in zip(self.groups, plan.groups, strict=True):
            group.prepare(part, hit)
        plan.locating = False

    def abandon(self, plan: StorePlan) -> None:
        """Let go of what a plan that will not finish holds on the host tier (refused, or
        made stale by a reset)."""
        if self.host is not None:
            copied = max(0, len(plan.blocks) - plan.matched)
            self.host.let_go(plan.promoted[copied:], plan.host_generation)
            plan.promoted = plan.promoted[:copied]

    def check_room(self, plan: StorePlan) -> None:
        """Refuse (changing nothing) a matched plan whose new blocks cannot be had."""
        needed = len(plan.digests) - plan.matched + plan.has_tail
        available = self.pool.free_count + self.index.unpinned - plan.matched_unpinned
        pools: list[tuple[BlockPool, int, int, str]] = [(self.pool, needed, available, "")]
        for group, part in zip(self.groups, plan.groups, strict=True):
            which = f"group {group.spec.idx}: "
            pools.append((group.pool, *group.room(part, plan.has_tail), which))
        for pool, needed, available, which in pools:
            if needed > available:
                self.abandon(plan)
                raise CacheError(
                    "pool_exhausted",
                    f"{which}request needs {needed} blocks but only {available} can be freed: "
                    f"the other {pool.num_blocks - available} are pinned by open requests",
                )

    def pin_some(self, plan: StorePlan, limit: int) -> bool:
        """Pin up to ``limit`` more of the matched blocks, from the root; True once all are."""
        chunk = plan.blocks[plan.pinned : min(plan.pinned + limit, plan.matched)]
        self.index.pin(chunk)
        plan.pinned += len(chunk)
        if plan.reply_ids is not None:
            plan.reply_ids.extend(chunk)
        return plan.pinned == plan.matched

    def insert_some(self, plan: StorePlan, limit: int) -> bool:
        """Insert up to ``limit`` more of the plan's new blocks (evicting as needed) and
        capture them as one stored run; True once all are in. They are pinned at once, so
        later slices never evict them."""
        size, index = self.block_size, self.index
        start = len(plan.blocks)
        digests = plan.digests[start : start + limit]
        if digests:
            shortfall = len(digests) - self.pool.free_count
            if shortfall > 0:
                self._evict(shortfall)
            ids = self.pool.allocate(len(digests))
            promoted = plan.matched + len(plan.promoted) - start
            if promoted > 0 and self.host is not None:
                self._promote(plan, start, ids[:promoted])
            parent = plan.last
            index.insert_run(digests, ids, parent, plan.keys)
            tokens = plan.tokens[start * size : (start + len(ids)) * size]
            self.tokens[ids] = tokens.reshape(len(ids), size)
            wire_hash = self.wire_hash
            self.sink.stored(
                parent_block=parent if parent != ROOT else None,
                block_ids=ids,
                hashes=wire_hash(digests),
                parent_hash=wire_hash([index.digest[parent]])[0] if parent != ROOT else None,
                token_ids=tokens,
                keys=plan.keys,
            )
            plan.blocks += ids
            plan.last = ids[-1]
            if plan.reply_ids is not None:
                plan.reply_ids.extend(ids)
        return len(plan.blocks) == len(plan.digests)

    def group_some(self, plan: StorePlan, limit: int) -> bool:
        """Hold up to ``limit`` more blocks in the other groups of a hybrid cache (the
        reused ones pinned first, group by group); True once every group holds its own."""
        for group, part in zip(self.groups, plan.groups, strict=True):
            if limit and part.pinned < len(part.reused):
                limit -= group.pin_some(part, limit)
            if limit and part.start + len(part.blocks) < len(part.located):
                limit -= group.insert_some(part, plan.digests, plan.tokens, plan.keys, limit)
            if part.pinned < len(part.reused) or part.start + len(part.blocks) < len(part.located):
                return False
        return True

    def finish_store(self, plan: StorePlan) -> StoreResult:
        """Allocate the plan's partial tail blocks and open its lease; returns (block_ids,
        cached tokens, every group's blocks on a hybrid cache)."""
        if plan.has_tail and self.pool.free_count == 0:
            self._evict(1)
        tail = self.pool.allocate(1) if plan.has_tail else []
        group_leases = [
            GroupLease(part.blocks, group.allocate_tail() if plan.has_tail else None, part.start)
            for group, part in zip(self.groups, plan.groups, strict=True)
        ]
        self.leases[plan.request_id] = Lease(plan.blocks, tail[0] if tail else None, group_leases)
        self.tail_blocks += len(tail)
        groups = self._group_blocks(plan.blocks + tail, group_leases) if self.groups else None
        if self.groups:
            cached = plan.hit * self.block_size  # the prefix every group serves
        else:
            # Promoted blocks are cached too: the engine need not compute them again.
            cached = (plan.matched + len(plan.promoted)) * self.block_size
        if plan.reply_ids is None:
            return plan.blocks + tail, cached, groups
        plan.reply_ids.extend(tail)
        return plan.reply_ids, cached, groups

    def _group_blocks(self, pool_blocks: list[int], leases: list[GroupLease]) -> list[GroupBlocks]:
        """Every group's blocks for the reply, in group order."""
        replies = [
            GroupBlocks(
                group.spec.idx or 0,
                lease.start,
                lease.blocks + ([] if lease.tail_block is None else [lease.tail_block]),
            )
            for group, lease in zip(self.groups, leases, strict=True)
        ]
        primary = self.sink.pool_lane.tag
        assert primary is not None
        replies.insert(primary.idx, GroupBlocks(primary.idx, 0, pool_blocks))
        return replies

    def _evict(self, count: int) -> None:
        evicted = self.index.evict(count)
        digest = self.index.digest
        digests = list(map(digest.__getitem__, evicted))
        hashes = self.wire_hash(digests)
        if self.host is not None:
            # Copied out before any of the blocks is handed out again; their host stores go
            # out before their removal from the pool, so no reader sees them nowhere.
            self._demote(evicted, digests, hashes)
        self.sink.removed(evicted, hashes)
        self.pool.free(evicted)

    def _promote(self, plan: StorePlan, start: int, block_ids: list[int]) -> None:
        """Copy the host tier's blocks of the plan's new blocks ``start``.. into ``block_ids``
        (just allocated), and let go of their slots."""
        host = self.host
        assert host is not None
        first = start - plan.matched
        slots = plan.promoted[first : first + len(block_ids)]
        host.copier.promote(np.asarray(slots, dtype=np.int64), np.asarray(block_ids, np.int64))
        host.let_go(slots, plan.host_generation)
        self._copied = True

    def _demote(self, evicted: list[int], digests: list[bytes], hashes: list[BlockHash]) -> None:
        """Copy the blocks the pool evicts (``evicted``, leaves first) to the host tier, those
        not there already (which are only used), evicting its least recently used."""
        host = self.host
        assert host is not None
        # Parents first: the order readers link a chain in.
        moved, moved_digests, moved_hashes = evicted[::-1], digests[::-1], hashes[::-1]
        found = list(map(host.slot_of.get, moved_digests))
        if found.count(None) != len(found):  # some are there already: only used
            kept = [i for i, slot in enumerate(found) if slot is None]
            for slot in found:
                if slot is not None:
                    host.touch(slot)
            moved = [moved[i] for i in kept]
            moved_digests = [moved_digests[i] for i in kept]
            moved_hashes = [moved_hashes[i] for i in kept]
            if not moved:
                return
        slots, gone = host.take(len(moved))
        if gone:
            self.sink.host_removed(gone, self.wire_hash([host.digest[s] for s in gone]))
        # With every slot held by stores under way, the deepest blocks are not kept.
        del moved[len(slots) :], moved_digests[len(slots) :], moved_hashes[len(slots) :]
        if not moved:
            return
        index = self.index
        above = list(map(index.parent.__getitem__, moved))
        parents: list[bytes | None] = list(map(index.digest.__getitem__, above))
        if ROOT in above:
            for i, parent in enumerate(above):
                if parent == ROOT:
                    parents[i] = None  # a prompt's first block
        keys = list(map(index.keys.__getitem__, moved))
        rows = self.tokens[moved]
        host.fill(slots, moved_digests, parents, keys, rows)
        host.copier.demote(np.asarray(moved, dtype=np.int64), np.asarray(slots, np.int64))
        self._copied = True
        self._publish_host_stores(slots, moved_hashes, moved_digests, parents, keys, rows)

    def _publish_host_stores(
        self,
        slots: list[int],
        hashes: list[BlockHash],
        digests: list[bytes],
        parents: list[bytes | None],
        keys: list[StoreKeys],
        rows: np.ndarray,
        announced: bool = False,
    ) -> None:
        """Capture the host tier's blocks in ``slots`` (their wire hashes, digests, chain
        parents' digests, keys and token rows) as stores: one per run of blocks each the chain
        child of the one before (as they were stored), with the chain parent's hash whichever
        tier holds it (Dynamo links a host block to the block before it)."""
        wire_hash = self.wire_hash
        starts = [0]
        starts += [
            i
            for i, (parent, before, key, key_before) in enumerate(
                zip(parents[1:], digests, keys[1:], keys, strict=False), 1
            )
            if parent != before or key is not key_before
        ]
        run_parents = [parents[i] for i in starts]
        parent_hashes = wire_hash([p for p in run_parents if p is not None])[::-1]
        ends = [*starts[1:], len(slots)]
        for first, end, parent in zip(starts, ends, run_parents, strict=True):
            self.sink.host_stored(
                slots=slots[first:end],
                hashes=hashes[first:end],
                parent_hash=parent_hashes.pop() if parent is not None else None,
                token_ids=rows[first:end].reshape(-1),
                keys=keys[first],
                announced=announced,
            )

    def publish_backlog(self, limit: int) -> bool:
        """Capture up to ``limit`` blocks' worth of what the last resets left the host tier to
        publish (see host_tier); True while more is left."""
        host = self.host
        if host is None:
            return False
        removed = host.next_removals(limit)
        if removed:
            self.sink.host_removed(None, self.wire_hash(removed))
        if limit > len(removed):
            announced = host.next_announcements(limit - len(removed))
            if announced:
                digests = list(map(host.digest.__getitem__, announced))
                self._publish_host_stores(
                    announced,
                    self.wire_hash(digests),
                    digests,
                    list(map(host.parent_digest.__getitem__, announced)),
                    list(map(host.keys.__getitem__, announced)),
                    host.tokens[announced],
                    announced=True,
                )
        return host.backlog

    def copy_fence(self) -> Fence | None:
        """The fence of the tier copies (and scrubs) enqueued since the last call, where they
        run asynchronously (on a GPU): a store's reply waits for it, since the engine reads
        promoted blocks, writes into blocks a demotion copies out, and must find freed blocks
        zeroed."""
        enqueued = self._copied
        self._copied = False
        if self.host is None or not self.copies_async:
            return None
        enqueued = self.pool.take_unsynced() or enqueued
        return self.host.copier.fence() if enqueued else None

    def end_lease(self, request_id: RequestId) -> Lease:
        """Close an open request and free its tail block; its full blocks stay pinned until
        the caller ``unpin``s them (in slices, deepest first, if it wants)."""
        lease = self.leases.pop(request_id, None)
        if lease is None:
            raise CacheError("unknown_request", f"request {request_id!r} is not open")
        if lease.tail_block is not None:
            self.pool.free([lease.tail_block])
            self.tail_blocks -= 1
        for group, part in zip(self.groups, lease.groups, strict=True):
            if part.tail_block is not None:
                group.free_tail(part.tail_block)
        return lease

    def let_window_go(self, request_id: RequestId, computed_tokens: int) -> UnpinParts:
        """The blocks of an open request that fell out of its sliding-window groups' windows
        once ``computed_tokens`` of it are computed (vLLM's ``remove_skipped_blocks``), per
        group as ``Lease.parts`` numbers them: taken out of its lease, for the caller to
        unpin. They stay cached until evicted."""
        lease = self.leases.get(request_id)
        if lease is None:
            raise CacheError("unknown_request", f"request {request_id!r} is not open")
        parts: UnpinParts = []
        for number, (group, part) in enumerate(zip(self.groups, lease.groups, strict=True), 1):
            window = group.spec.sliding_window
            if window is None:
                continue
            first_useful = max(0, computed_tokens - window + 1) // self.block_size
            gone = min(first_useful, part.start + len(part.blocks)) - part.start
            if gone > 0:
                parts.append((number, part.blocks[:gone]))
                part.blocks = part.blocks[gone:]
                part.start += gone
        return parts

    def unpin(self, block_ids: list[int], group: int = 0) -> None:
        """Unpin blocks of the pool's group (0) or of another group (1.., see Lease.parts)."""
        if group:
            self.groups[group - 1].unpin(block_ids)
        else:
            self.index.unpin(block_ids)

    def clear(self, every_tier: bool = True) -> tuple[object, ...]:
        """Drop every block of the pool (and of the host tier: ``every_tier``) and every open
        request in O(1); a host tier left standing is announced again (``publish_backlog``).
        Returns the old containers: freeing them costs O(blocks), so the caller hands them
        to the reaper."""
        self.generation += 1  # store plans in progress are stale now
        old_leases, self.leases = self.leases, {}
        self.tail_blocks = 0
        old_index: tuple[object, ...] = self.index.clear()
        self.pool.free_all()
        for group in self.groups:
            old_index += group.clear()
        old_host: tuple[object, ...] = ()
        if self.host is not None:
            if every_tier:
                old_host = self.host.clear()
            else:
                self.host.announce_all()
        return (old_leases, *old_index, *old_host)

    def host_block_events(self, slots: list[int]) -> list[BlockStored]:
        """Host tier blocks as one-block stores, as a snapshot reports them (token ids are
        views of the tier's rows, valid until the slot is reused)."""
        host = self.host
        assert host is not None
        return one_block_stores(
            [host.digest[s] for s in slots],
            [host.parent_digest[s] for s in slots],
            [host.tokens[s] for s in slots],
            [host.keys[s] for s in slots],
            wire_hash=self.wire_hash,
            block_size=self.block_size,
            medium=host.medium,
        )

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        self._close_pools()

    def _close_pools(self) -> None:
        for group in self.groups:
            group.close()
        self.pool.close()

    def block_events(self, block_ids: list[int]) -> list[BlockStored]:
        """Cached blocks as one-block stores, as a snapshot reports them; their token ids are
        views of the cache's rows, valid until the block's slot is reused."""
        size = self.block_size
        medium = self.sink.medium
        index = self.index
        digest, parent_of, keys_of, tokens = index.digest, index.parent, index.keys, self.tokens
        group = self.sink.pool_lane.tag
        parents = [parent_of[b] for b in block_ids]
        hashes = self.wire_hash([digest[b] for b in block_ids])
        parent_hashes = self.wire_hash([digest[p] for p in parents if p != ROOT])[::-1]
        events = []
        for block_id, block_hash, parent in zip(block_ids, hashes, parents, strict=True):
            events.append(
                stored_event(
                    hashes=[block_hash],
                    parent_hash=parent_hashes.pop() if parent != ROOT else None,
                    # The cache's own row (a view; see snapshot.SnapshotJob._encode).
                    token_ids=tokens[block_id],
                    block_size=size,
                    medium=medium,
                    keys=keys_of[block_id],
                    group=group,
                )
            )
        return events
