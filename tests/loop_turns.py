"""Loop turns counted by hand, for tests of work done a slice per turn of the asyncio loop
(in-process, never timed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgpack

from kvpubd.daemon.control_server import Reply
from kvpubd.daemon.service import Service
from kvpubd.daemon.settings import Settings


@asynccontextmanager
async def started_service(tmp_path: Path, **sections: dict[str, Any]) -> AsyncIterator[Service]:
    """The daemon's service in this process: private ipc endpoints, replay off, the drain tick
    out of the way; ``sections`` add to those settings or replace them."""
    # Any values, as load_settings has them: Settings(**...) also takes its options as keywords.
    settings: dict[str, Any] = {
        "events": {
            "endpoint": f"ipc://{tmp_path}/ev",
            "replay_endpoint": "",
            "tick_interval_ms": 60_000,
        },
        "control": {"endpoint": f"ipc://{tmp_path}/ctl"},
        "service": {"linger_ms": 0},
    }
    for name, values in sections.items():
        settings.setdefault(name, {}).update(values)
    service = Service(Settings(**settings))
    await service.startup()
    try:
        yield service
    finally:
        await service.shutdown()


async def turns_until(done: Any, limit: int = 10_000) -> int:
    """Loop turns until ``done()``."""
    for turn in range(limit):
        if done():
            return turn
        await asyncio.sleep(0)
    raise AssertionError(f"not done after {limit} loop turns")


async def settled(reply: Reply) -> dict[str, Any]:
    """The reply, once it is there (loop turns in between)."""
    replies: list[bytes] = []
    if isinstance(reply, bytes):
        replies.append(reply)
    else:
        reply.then(lambda value, error: replies.append(bytes(value)) if value else None)
    await turns_until(lambda: bool(replies))
    decoded: dict[str, Any] = msgpack.unpackb(replies[0], raw=False)
    return decoded


async def until(condition: Callable[[], object], what: str, deadline_s: float = 10.0) -> None:
    """Let the loop run (a millisecond at a time) until ``condition()`` holds; fail naming
    ``what`` after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)
