"""Stores too large for one loop step, carried out a slice at a time.

A store costs a few microseconds per new block (hash chain, eviction, index, pool), so one of
thousands of blocks would hold a reset back for tens of milliseconds. Such a store is hashed,
then inserted, ``SLICE_BLOCKS`` blocks per loop turn; a reset in between wins, and the store
starts again on the emptied cache (its hashes are kept). While one is under way, every later
store of the rank queues behind it: stores apply in arrival order, and no other store sees its
half-inserted blocks or changes the pool between its check and its last slice.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvpubd.daemon.cache import CacheError, RankCache, RequestId
from kvpubd.daemon.decoding import decode_tokens_in_slices
from kvpubd.daemon.pending import Pending
from kvpubd.protocol.hashing import chain_digests, root_key
from kvpubd.protocol.int_arrays import IntArray

log = logging.getLogger(__name__)

SYNC_BLOCKS = 512  # full blocks a store may cover and still run in one loop step
SLICE_BLOCKS = 512  # blocks hashed, or inserted, per loop turn
# Largest requests' worth of tokens the queue holds before it refuses more stores (busy): a
# client that pipelines stores without reading the replies cannot grow the daemon's memory
# without bound (the queue drains one slice per loop turn; requests are read much faster).
QUEUED_REQUESTS = 4

StoreResult = tuple[list[int], int]  # block ids, cached tokens


@dataclass(slots=True)
class _Queued:
    request_id: RequestId
    tokens: np.ndarray | IntArray  # a list still to decode (a slice per loop turn first)
    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None
    result: Pending[StoreResult] = field(default_factory=Pending)


class StoreQueue:
    def __init__(self, cache: RankCache, max_queued_tokens: int) -> None:
        self._cache = cache
        self._queue: deque[_Queued] = deque()
        self._task: asyncio.Task[None] | None = None
        self.max_queued_tokens = max_queued_tokens
        self.queued_tokens = 0

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    def holds(self, request_id: RequestId) -> bool:
        return self.result_of(request_id) is not None

    def result_of(self, request_id: RequestId) -> Pending[StoreResult] | None:
        """The result to come of the store of ``request_id`` under way or queued, if any."""
        for item in self._queue:
            if item.request_id == request_id:
                return item.result
        return None

    def submit(
        self,
        request_id: RequestId,
        tokens: np.ndarray | IntArray,
        lora_id: int | None,
        lora_name: str | None,
        cache_salt: str | None,
    ) -> Pending[StoreResult]:
        """Queue a store; raises CacheError ``busy`` (changing nothing) while the queue holds
        ``max_queued_tokens`` tokens. An empty queue takes any store."""
        if self._queue and self.queued_tokens + len(tokens) > self.max_queued_tokens:
            raise CacheError(
                "busy",
                f"{len(self._queue)} stores of {self.queued_tokens} tokens are queued on this "
                "rank; retry once their replies came",
            )
        item = _Queued(request_id, tokens, lora_id, lora_name, cache_salt)
        self._queue.append(item)
        self.queued_tokens += len(tokens)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="kvpubd large stores")
        return item.result

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for item in self._queue:
            item.result.fail(asyncio.CancelledError())
        self._queue.clear()
        self.queued_tokens = 0

    async def _run(self) -> None:
        while self._queue:
            item = self._queue[0]
            try:
                result = await self._store(item)
            except CacheError as exc:
                item.result.fail(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: fail this store, keep serving
                log.exception("store %r failed", item.request_id)
                item.result.fail(exc)
            else:
                # Its reply is sent right here (see Pending): nothing read after the store
                # finished is answered ahead of it.
                item.result.resolve(result)
            self._queue.popleft()
            self.queued_tokens -= len(item.tokens)

    async def _store(self, item: _Queued) -> StoreResult:
        if isinstance(item.tokens, IntArray):
            item.tokens = await decode_tokens_in_slices(item.tokens)
        cache = self._cache
        size = cache.block_size
        digests: list[bytes] = []
        algorithm = cache.hash_algorithm
        link = root_key(item.lora_id, item.cache_salt, algorithm)
        for start in range(0, len(item.tokens) // size, SLICE_BLOCKS):
            part = chain_digests(
                item.tokens[start * size : (start + SLICE_BLOCKS) * size], size, link, algorithm
            )
            digests += part
            link = part[-1]
            await asyncio.sleep(0)
        while True:
            plan = cache.plan_store(
                item.request_id, item.tokens, digests, item.lora_id, item.lora_name, item.cache_salt
            )
            while not cache.insert_some(plan, SLICE_BLOCKS):
                await asyncio.sleep(0)
                if plan.generation != cache.generation:
                    break  # a reset emptied the cache: start again on the new state
            else:
                return cache.finish_store(plan)
