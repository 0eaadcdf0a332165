"""The periodic drain: every ``events.tick_interval_ms`` each rank publishes what it captured
as one batch, sends its heartbeat if due and compacts its published record a slice.

One owner for the loop and its pause flag: the ``pause``/``resume`` ops set it, the loop, a
rank's early flush at ``FLUSH_BLOCKS``, ``stats`` and the metrics read it. Paused, nothing
captured goes out before a reset or a resume (resets and snapshots still publish)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger("kvpubd")


class _Heartbeats(Protocol):
    def heartbeat(self) -> int | None: ...


class DrainedRank(Protocol):
    """What the drain does to one rank (a ``RankPipeline``)."""

    @property
    def publisher(self) -> _Heartbeats: ...

    def flush(self, new_tick: bool = False) -> int | None: ...

    def compact(self) -> None: ...


class Drain:
    """``ranks``: the pipelines, the service's list (filled at start-up, before ``run``)."""

    def __init__(self, ranks: Sequence[DrainedRank], interval_s: float) -> None:
        self._ranks = ranks
        self.interval_s = interval_s
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        self._paused = True
        log.info("periodic drain paused")

    def resume(self) -> None:
        self._paused = False
        log.info("periodic drain resumed")

    async def run(self) -> None:
        """The loop; the service spawns it and stops the daemon should it ever raise."""
        while True:
            await asyncio.sleep(self.interval_s)
            paused = self._paused
            for rank in self._ranks:
                if not paused:
                    rank.flush(new_tick=True)
                # Also while paused: the daemon is alive, and a consumer learns the last seq.
                rank.publisher.heartbeat()
                rank.compact()
