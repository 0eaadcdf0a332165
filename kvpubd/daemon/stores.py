"""A rank's stores and releases too large for one loop step, carried out a budget per loop turn.

A store costs a few microseconds per block (hash chain, prefix match, pin, eviction, index,
pool, capture) and a release about one (unpin), so one of thousands of blocks would hold a
reset back for tens of milliseconds. Such a store is hashed, matched, pinned and inserted, and
such a release unpinned, a slice (``SLICE_BLOCKS``) per loop turn; a reset in between
wins: the store starts again on the emptied cache (its hashes are kept), the release is done
(the reset unpinned everything).

While one is under way, every later store and release of the rank queues behind it: they apply
in arrival order, and none changes which blocks are cached or pinned between another's slices
(a store's prefix match and room check stay true until it pins them). Queued small ones share
a budget per turn (``TURN_UNITS``), each costing ``REQUEST_UNITS`` besides its blocks:
thousands pipelined behind a large store never run in one step when it ends. The queue is
bounded in requests and in tokens, and lookups by request id are O(1).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvpubd.daemon.cache import CacheError, RankCache, RequestId, StoreResult, UnpinParts
from kvpubd.daemon.decoding import decode_tokens_in_slices
from kvpubd.daemon.pending import Pending
from kvpubd.protocol.control import Store
from kvpubd.protocol.hashing import chain_digests, root_key
from kvpubd.protocol.int_arrays import IntArray

log = logging.getLogger(__name__)
T = TypeVar("T")

SYNC_BLOCKS = 512  # full blocks a store (or a release) may cover and still run in one step
SLICE_BLOCKS = 512  # blocks hashed, matched, pinned, inserted or unpinned at a time
# Work per loop turn, in blocks: many small queued stores a turn, or one slice of a large one
# (see operations.BATCH_SYNC_S for what the turn's length costs a reset).
TURN_UNITS = 256
# What a request costs besides its blocks (its lease, its reply, the reply's send), in blocks:
# an empty store (~30 us: lease, reply, send) costs about as much as inserting 32 blocks.
REQUEST_UNITS = 32
# Largest requests' worth of tokens the queue holds before it refuses more stores (busy): a
# client that pipelines stores without reading the replies cannot grow the daemon's memory
# without bound (the queue drains a budget per loop turn; requests are read much faster).
QUEUED_REQUESTS = 4
# Requests (stores and releases) the queue holds before it refuses more (busy): small ones,
# which the token bound hardly counts, are bounded too.
MAX_QUEUED = 1024


@dataclass(slots=True)
class _Store:
    request: Store
    tokens: np.ndarray | IntArray  # a list still to decode (a slice per loop turn first)
    result: Pending[StoreResult] = field(default_factory=Pending)
    released: bool = False  # its release is queued behind it: the id is free for a new store

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id


@dataclass(slots=True)
class _Release:
    """The release of a store under way or queued: done once the store is."""

    request_id: RequestId
    result: Pending[int] = field(default_factory=Pending)


@dataclass(slots=True)
class _Unpin:
    """The blocks of a request released already (and answered): unpinned before any later
    store of the rank runs."""

    parts: UnpinParts
    generation: int


class _Overtaken(Exception):
    """A reset cleared the cache between two slices of the work."""


class StoreQueue:
    def __init__(
        self,
        cache: RankCache,
        max_queued_tokens: int,
        on_captured: Callable[[], None] = lambda: None,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self._cache = cache
        self._queue: deque[_Store | _Release | _Unpin] = deque()
        # The queued stores by request id (of an id stored again after its queued release:
        # the latest; the earlier is still in the queue).
        self._stores: dict[RequestId, _Store] = {}
        self._task: asyncio.Task[None] | None = None
        self._on_captured = on_captured  # after each inserted slice: the capture may go out
        self.max_queued_tokens = max_queued_tokens
        self.max_queued = max_queued
        self.queued_tokens = 0
        self._spent = 0  # units of work done in the current loop turn

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    @property
    def stores_queued(self) -> int:
        """Stores under way or queued: each opens a request once done."""
        return len(self._stores)

    def holds(self, request_id: RequestId) -> bool:
        """A store of ``request_id`` is under way or queued."""
        return request_id in self._stores

    def opens(self, request_id: RequestId) -> bool:
        """A store of ``request_id`` is under way or queued with no release behind it: a
        store of that id after its release is no duplicate (requests run in order)."""
        store = self._stores.get(request_id)
        return store is not None and not store.released

    def submit(self, request: Store, tokens: np.ndarray | IntArray) -> Pending[StoreResult]:
        """Queue a store of ``tokens`` (the request's, decoded or still to decode); raises
        CacheError ``busy`` (changing nothing) while the queue is full. An empty queue takes
        any store."""
        self._check_room(len(tokens))
        item = _Store(request, tokens)
        self._stores[request.request_id] = item
        self.queued_tokens += len(tokens)
        self._push(item)
        return item.result

    def submit_release(self, request_id: RequestId) -> Pending[int]:
        """Queue the release of a store under way or queued; the blocks it unpinned, once
        done (raises CacheError ``busy`` while the queue is full)."""
        self._check_room(0)
        item = _Release(request_id)
        self._push(item)
        self._stores[request_id].released = True
        return item.result

    def submit_unpin(self, parts: UnpinParts) -> None:
        """Queue the unpinning of a released request's blocks. Never refused: the request is
        closed already, and open requests are bounded."""
        self._push(_Unpin(parts, self._cache.generation))

    def _check_room(self, tokens: int) -> None:
        if not self._queue:
            return
        if len(self._queue) >= self.max_queued or self.queued_tokens + tokens > (
            self.max_queued_tokens
        ):
            raise CacheError(
                "busy",
                f"{len(self._queue)} requests ({self.queued_tokens} tokens) are queued on "
                "this rank; retry once their replies came",
            )

    def _push(self, item: _Store | _Release | _Unpin) -> None:
        self._queue.append(item)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="kvpubd large stores")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for item in self._queue:
            if not isinstance(item, _Unpin):
                item.result.fail(asyncio.CancelledError())
        self._queue.clear()
        self._stores.clear()
        self.queued_tokens = 0

    async def _run(self) -> None:
        self._spent = 0  # a task starts on a loop turn of its own
        while self._queue:
            item = self._queue[0]
            if isinstance(item, _Store):
                await self._settle(item.result, self._store(item), item.request_id)
                if self._stores.get(item.request_id) is item:  # not stored again behind it
                    del self._stores[item.request_id]
                self.queued_tokens -= len(item.tokens)
            elif isinstance(item, _Release):
                await self._settle(item.result, self._release(item), item.request_id)
            else:
                unpinned: Pending[None] = Pending()  # answered already: logs a bug, no more
                await self._settle(unpinned, self._unpin(item.parts, item.generation), "")
            self._queue.popleft()

    async def _settle(
        self, result: Pending[T], work: Coroutine[Any, Any, T], request_id: RequestId
    ) -> None:
        try:
            value = await work
        except CacheError as exc:
            result.fail(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: fail this request, keep serving
            log.exception("request %r failed", request_id)
            result.fail(exc)
        else:
            # Its reply is sent right here (see Pending): nothing read after the work
            # finished is answered ahead of it.
            result.resolve(value)

    async def _spend(self, units: int, generation: int | None = None) -> None:
        """Charge ``units`` of work to this loop turn, first yielding to the loop if they
        would exceed its budget. With ``generation`` (the cache's when the work began), raise
        _Overtaken if a reset came while yielded."""
        if self._spent and self._spent + units > TURN_UNITS:
            await asyncio.sleep(0)
            self._spent = 0
            if generation is not None and generation != self._cache.generation:
                raise _Overtaken
        self._spent += units

    async def _store(self, item: _Store) -> StoreResult:
        await self._spend(REQUEST_UNITS)
        if isinstance(item.tokens, IntArray):
            item.tokens = await decode_tokens_in_slices(item.tokens)
        digests = await self._hash(item)
        while True:
            try:
                return await self._store_on(item, digests, self._cache.generation)
            except _Overtaken:
                continue  # a reset emptied the cache: start again on the new state

    async def _hash(self, item: _Store) -> list[bytes]:
        cache = self._cache
        size, algorithm = cache.block_size, cache.hash_algorithm
        digests: list[bytes] = []
        link = root_key(item.request.lora_id, item.request.cache_salt, algorithm)
        tokens = _decoded(item)
        for start in range(0, len(tokens) // size, SLICE_BLOCKS):
            part_tokens = tokens[start * size : (start + SLICE_BLOCKS) * size]
            await self._spend(len(part_tokens) // size)
            part = chain_digests(part_tokens, size, link, algorithm)
            digests += part
            link = part[-1]
        return digests

    async def _store_on(self, item: _Store, digests: list[bytes], generation: int) -> StoreResult:
        """The store on the cache of ``generation``; _Overtaken once a reset cleared it."""
        cache = self._cache
        plan = cache.begin_store(item.request, _decoded(item), digests, in_slices=True)
        units = cache.block_units
        inserted = SLICE_BLOCKS // units  # a slice of inserts is a slice's worth of work
        try:
            while True:
                # A hybrid cache's other groups then locate every block, a slice at a time.
                done = plan.located if plan.locating and not plan.matching else plan.matched
                await self._spend(min(SLICE_BLOCKS, len(digests) - done), generation)
                if cache.match_some(plan, SLICE_BLOCKS):
                    break
            cache.check_room(plan)
            while plan.pinned < plan.matched:
                count = min(SLICE_BLOCKS, plan.matched - plan.pinned)
                await self._spend(count, generation)
                cache.pin_some(plan, count)
            while len(plan.blocks) < len(digests):
                count = min(inserted, len(digests) - len(plan.blocks))
                await self._spend(count * units, generation)
                cache.insert_some(plan, count)
                self._on_captured()
            done = not plan.groups
            while not done:  # a hybrid cache's other groups
                await self._spend(SLICE_BLOCKS, generation)
                done = cache.group_some(plan, SLICE_BLOCKS)
                self._on_captured()
        except _Overtaken:
            cache.abandon(plan)
            raise
        result = cache.finish_store(plan)
        fence = cache.copy_fence()
        # Its tier copies run on the GPU's stream: the engine may read and write the store's
        # blocks once answered, so it waits (polling, never blocking the loop: a reset
        # meanwhile is answered at once) and so do the rank's later requests behind it.
        while fence is not None and not fence.done:
            await asyncio.sleep(0)
        if generation != cache.generation:
            raise _Overtaken  # its lease went with the reset: store again, on the new state
        return result

    async def _release(self, item: _Release) -> int:
        await self._spend(REQUEST_UNITS)
        lease = self._cache.end_lease(item.request_id)
        await self._unpin(lease.parts(), self._cache.generation)
        return lease.size

    async def _unpin(self, parts: UnpinParts, generation: int) -> None:
        """Unpin the blocks pinned in the cache of ``generation``, each group's deepest first
        (so the released chain is evicted tail-first); a reset unpinned them all."""
        cache = self._cache
        try:
            for group, blocks in parts:
                end = len(blocks)
                while end and generation == cache.generation:
                    start = max(0, end - SLICE_BLOCKS)
                    await self._spend(end - start, generation)
                    cache.unpin(blocks[start:end], group)
                    end = start
        except _Overtaken:
            pass


def _decoded(item: _Store) -> np.ndarray:
    """The store's tokens, decoded by ``_store`` before anything reads them."""
    assert isinstance(item.tokens, np.ndarray)
    return item.tokens
