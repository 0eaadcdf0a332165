"""Loop turns counted by hand, for tests of work done a slice per turn of the asyncio loop
(in-process, never timed)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from kvpubd.daemon.pending import Pending


async def turns_until(done: Any, limit: int = 10_000) -> int:
    """Loop turns until ``done()``."""
    for turn in range(limit):
        if done():
            return turn
        await asyncio.sleep(0)
    raise AssertionError(f"not done after {limit} loop turns")


async def settled(reply: bytes | Pending[bytes] | Pending[memoryview]) -> dict[str, Any]:
    """The reply, once it is there (loop turns in between)."""
    replies: list[bytes] = []
    if isinstance(reply, bytes):
        replies.append(reply)
    else:
        reply.then(lambda value, error: replies.append(bytes(value)) if value else None)
    await turns_until(lambda: bool(replies))
    decoded: dict[str, Any] = msgpack.unpackb(replies[0], raw=False)
    return decoded
