"""The longest loop step each large-store case takes, in-process (a monitor task wakes every
loop turn; the largest gap between its wake-ups is the longest step anything else took), in
wall-clock time and in this thread's CPU time (which a busy shared host inflates less); and
the longest step of each task in CPU time (the store queue's task is "kvpubd large stores"; the
caller's task, "main", does what the control socket would: parse and hand over requests).

    PYTHONPATH=$PWD python scripts/store_steps.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np

from kvpubd.daemon.pending import Pending
from kvpubd.daemon.service import Service
from kvpubd.daemon.settings import Settings

BLOCKS = 62_500
TINY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "uint8"}


class TaskSteps:
    """The longest CPU time one step of each task took, by wrapping the loop's callbacks."""

    def __init__(self) -> None:
        self.longest: dict[str, float] = {}
        run = asyncio.events.Handle._run
        longest = self.longest

        def timed(handle: asyncio.events.Handle) -> None:
            started = time.thread_time()
            run(handle)
            elapsed = time.thread_time() - started
            owner = getattr(handle._callback, "__self__", None)  # type: ignore[attr-defined]
            name = owner.get_name() if isinstance(owner, asyncio.Task) else "callbacks"
            if isinstance(owner, asyncio.Task) and name.startswith("Task-"):
                name = owner.get_coro().__qualname__  # type: ignore[union-attr]
            longest[name] = max(longest.get(name, 0.0), elapsed)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]

    def report(self) -> str:
        top = sorted(self.longest.items(), key=lambda item: -item[1])[:3]
        self.longest.clear()
        return ", ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in top)


TASK_STEPS = TaskSteps()


class StepMonitor:
    def __init__(self) -> None:
        self.longest = 0.0
        self.longest_cpu = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while True:
            await asyncio.sleep(0)
            now, now_cpu = time.perf_counter(), time.thread_time()
            self.longest = max(self.longest, now - last)
            self.longest_cpu = max(self.longest_cpu, now_cpu - last_cpu)
            last, last_cpu = now, now_cpu

    def __enter__(self) -> StepMonitor:
        self._task = asyncio.ensure_future(self._watch())
        return self

    def __exit__(self, *_: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def settle(reply: Any) -> bytes:
    """The reply's bytes once sent (decoding them is the client's work: done after the case)."""
    if isinstance(reply, Pending):
        done: list[Any] = []
        reply.then(lambda value, error: done.append(value if error is None else error))
        while not done:
            await asyncio.sleep(0)
        reply = done[0]
    return bytes(reply)


async def main() -> None:
    tmp = tempfile.mkdtemp(prefix="store-steps-")
    settings = Settings(
        events={"endpoint": f"ipc://{tmp}/ev", "replay_endpoint": "", "tick_interval_ms": 10},
        control={"endpoint": f"ipc://{tmp}/ctl", "max_blocks_per_store": BLOCKS},
        cache={**TINY, "num_blocks": BLOCKS + 4096},
        service={"linger_ms": 0},
    )
    service = Service(settings)
    await service.startup()
    control = service.control
    assert control is not None
    seq = iter(range(1 << 30))

    def frames(op: str, **fields: Any) -> list[bytes]:
        return [b"peer", b"", msgpack.packb({"op": op, "id": next(seq), **fields})]

    tokens = np.random.default_rng(0).integers(0, 1 << 31, BLOCKS * 16, dtype="<u4").tobytes()

    only = sys.argv[1:]  # case numbers to report (all by default)
    cases = iter(range(1, 100))

    sent: list[bytes] = []  # the replies of the case, decoded once it is over

    async def case(name: str, run: Callable[[], Awaitable[Any]]) -> None:
        number = next(cases)
        await asyncio.sleep(0.05)
        if only and str(number) not in only:
            await run()
            return
        with StepMonitor() as monitor:
            await asyncio.sleep(0)  # the monitor's first wake-up
            await asyncio.sleep(0)
            TASK_STEPS.report()
            started = time.perf_counter()
            await run()
            total = time.perf_counter() - started
            await asyncio.sleep(0)  # the monitor sees the last step
            await asyncio.sleep(0)
        print(
            f"{number}. {name:45s} longest step {monitor.longest * 1e3:7.2f} ms "
            f"(CPU {monitor.longest_cpu * 1e3:6.2f} ms), total {total:6.2f} s"
        )
        codes = Counter(
            "ok" if reply["ok"] else reply["error"]["code"] for reply in map(msgpack.unpackb, sent)
        )
        sent.clear()
        print(f"   longest CPU step by task (ms): {TASK_STEPS.report()}")
        print(f"   replies: {dict(codes)}")

    async def store(request_id: str) -> None:
        request = frames("store", request_id=request_id, token_ids=tokens)
        sent.append(await settle(control.handle_frames(request)))

    async def release(request_id: str) -> None:
        sent.append(await settle(control.handle_frames(frames("release", request_id=request_id))))
        cache = service.pipelines[0].cache
        while cache.pinned_blocks:  # answered at once; unpinned a slice per turn
            await asyncio.sleep(0)

    async def flood() -> None:
        replies = [control.handle_frames(frames("store", request_id="big2", token_ids=tokens))]
        for i in range(30_000):
            replies.append(
                control.handle_frames(frames("store", request_id=f"e{i}", token_ids=b""))
            )
            if i % 64 == 63:
                await asyncio.sleep(0)  # the control server reads 64 requests per wake-up
        for i, reply in enumerate(replies):
            sent.append(await settle(reply))
            if i % 64 == 63:
                await asyncio.sleep(0)  # reading 30 000 replies is this client's own work

    async def many_open() -> None:
        for i in range(50_000):
            control.handle_frames(frames("store", request_id=f"o{i}", token_ids=b""))
            if i % 64 == 63:
                await asyncio.sleep(0)
        started = time.perf_counter()
        await settle(control.handle_frames(frames("stats")))
        print(f"  stats, 50 000 open: {(time.perf_counter() - started) * 1e3:.2f} ms")

    await case(f"new store of {BLOCKS} blocks", lambda: store("a"))
    await case("release of it", lambda: release("a"))
    await case("cached store of the same prompt", lambda: store("b"))
    await case("release of it", lambda: release("b"))
    await case("a large store + 30 000 empty stores", flood)
    await case("50 000 empty stores, then stats", many_open)
    await service.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
