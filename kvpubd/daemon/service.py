"""The daemon's lifecycle: ``Service(settings).serve()`` runs ``startup()``, ``main_loop()`` and
``shutdown()``, as uvicorn's ``Server.serve()`` does.

One asyncio loop owns all state. ZeroMQ sockets are served from loop readers (their FD is
edge-triggered, so each reader drains until ZeroMQ reports nothing more to read). Every
background task is supervised: one that dies stops the daemon with a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import zmq

from kvpubd.daemon.control_server import ControlServer, StartupError
from kvpubd.daemon.hooks import MetricsHooks, NullMetrics
from kvpubd.daemon.notify import Notifier, watchdog_interval
from kvpubd.daemon.operations import Operations
from kvpubd.daemon.pipeline import RankPipeline
from kvpubd.daemon.reaper import Reaper
from kvpubd.protocol.config import Settings

log = logging.getLogger("kvpubd")

__all__ = ["Service", "StartupError", "TaskFailed", "run"]


class TaskFailed(RuntimeError):
    """A background task of the daemon died; the daemon stops with a non-zero status."""


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.epoch = secrets.randbits(62)
        self.pipelines: list[RankPipeline] = []
        self.metrics: MetricsHooks = (
            _create_metrics(self) if settings.metrics.port else NullMetrics()
        )
        self.operations = Operations(self.pipelines, settings, self.metrics, self.epoch)
        self._context: zmq.Context | None = None
        self.control: ControlServer | None = None
        self._exit = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: BaseException | None = None
        self._failure_task = ""
        # Frees cleared indexes piecemeal: one deallocation per block must not delay a marker.
        self._reaper = Reaper()
        self._notifier = Notifier.from_environment()

    @property
    def paused(self) -> bool:
        return self.operations.paused

    @property
    def control_endpoint(self) -> str:
        return self.control.endpoint if self.control is not None else ""

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT; raises TaskFailed if a background task died."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_exit)
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
        if self._failure is not None:
            raise TaskFailed(f"{self._failure_task}: {self._failure!r}") from self._failure

    def request_exit(self) -> None:
        if not self._exit.is_set():
            log.info("shutdown requested")
        self._exit.set()

    async def startup(self) -> None:
        self._context = zmq.Context()
        # Control first: it refuses to start beside a running daemon on the same endpoint,
        # before anything here could take over that daemon's sockets or pool segment.
        self.control = ControlServer(
            self._context, self.settings.control, self.operations.handle, self.metrics
        )
        self.control.bind()
        for rank in range(self.settings.cache.data_parallel_size):
            self.pipelines.append(
                RankPipeline(rank, self.settings, self._context, self.metrics, self._reaper)
            )
        for pipeline in self.pipelines:
            pipeline.start()
            publisher = pipeline.publisher
            log.info(
                "rank %d: events on %s, replay on %s",
                pipeline.rank,
                publisher.endpoint,
                publisher.replay_endpoint or "(off)",
            )
            publisher.start()
        self.control.start()
        await self._start_metrics()
        self._spawn(self._drain_loop(), "drain loop")
        self._spawn(self._reaper.run(), "reaper")
        log.info(
            "ready: %d rank(s), %d blocks of %d bytes each, control on %s",
            len(self.pipelines),
            self.settings.cache.num_blocks,
            self.settings.cache.block_bytes,
            self.control_endpoint,
        )
        # Everything built so far lives as long as the daemon: the per-block lists of every
        # index among it. Out of the collector's reach, a full collection no longer walks them
        # (a pause that grew with the pool and landed on whichever reset came next).
        gc.freeze()
        self._notify_ready()

    async def main_loop(self) -> None:
        """Wait for an exit request, or for a background task to die."""
        await self._exit.wait()

    async def shutdown(self) -> None:
        """Stop everything that started; each step runs even if an earlier one failed."""
        self._notifier.stopping("stopping")
        for pipeline in self.pipelines:
            pipeline.publisher.stop()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await self.metrics.close()
        except Exception:
            log.exception("shutdown: metrics endpoint failed")
        if self.control is not None:  # stop taking requests first
            _attempt("control socket", self.control.close)
            self.control = None
        for pipeline in self.pipelines:
            seq = _attempt(f"rank {pipeline.rank} last batch", pipeline.flush)
            if seq is not None:
                log.info("rank %d: published the last batch, seq %d", pipeline.rank, seq)
        for pipeline in self.pipelines:
            _attempt(f"rank {pipeline.rank} close", pipeline.close)
        if self._context is not None:
            # Closes what a failed start-up left open, then waits up to each socket's linger
            # (linger_ms for PUB) for queued messages to reach subscribers.
            _attempt("zmq context", self._context.destroy)
            self._context = None
        log.info("stopped")
        self._notifier.close()

    # -- background tasks ------------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=f"kvpubd {name}")
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._exit.is_set():
            return
        failure = task.exception() or RuntimeError("returned")
        log.critical("%s died: %r; stopping", task.get_name(), failure, exc_info=failure)
        self._failure = failure
        self._failure_task = task.get_name()
        # Stop the watchdog pings at once: systemd must see a daemon that no longer works.
        for other in self._tasks:
            if other.get_name() == "kvpubd watchdog":
                other.cancel()
        self._exit.set()

    async def _start_metrics(self) -> None:
        host, port = self.settings.metrics.host, self.settings.metrics.port
        if not port:
            return
        try:
            url = await self.metrics.start(host, port)
        except OSError as exc:
            raise StartupError(f"metrics endpoint {host}:{port}: {exc.strerror or exc}") from None
        log.info("metrics on %s", url)

    def _notify_ready(self) -> None:
        """Tell systemd (Type=notify) the daemon is ready: every socket is bound and the
        startup markers are published. Watchdog pings come from this loop, so a stuck loop
        stops them and systemd restarts the daemon."""
        if not self._notifier.enabled:
            return
        self._notifier.ready(
            f"serving {len(self.pipelines)} rank(s), control on {self.control_endpoint}"
        )
        interval = watchdog_interval()
        if interval is not None:
            self._spawn(self._watchdog(interval), "watchdog")
        log.info(
            "notified systemd: ready%s",
            f"; watchdog ping every {interval:g} s" if interval is not None else "",
        )

    async def _watchdog(self, interval: float) -> None:
        while True:
            self._notifier.watchdog()
            await asyncio.sleep(interval)

    async def _drain_loop(self) -> None:
        interval = self.settings.events.tick_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            paused = self.operations.paused
            for pipeline in self.pipelines:
                if not paused:
                    pipeline.flush(new_tick=True)
                # Also while paused: the daemon is alive, and a consumer learns the last seq.
                pipeline.publisher.heartbeat()
                pipeline.compact()


def _attempt(what: str, step: Callable[[], Any]) -> Any:
    """Run one shutdown step; a failure is logged and the next step still runs."""
    try:
        return step()
    except Exception:
        log.exception("shutdown: %s failed", what)
        return None


def _create_metrics(service: Service) -> MetricsHooks:
    from kvpubd.daemon.metrics import Metrics  # prometheus-client only where metrics are on

    return Metrics(lambda: service.pipelines, lambda: service.paused)


def run(settings: Settings) -> None:
    """Run the daemon until SIGTERM/SIGINT, on uvloop unless configured otherwise."""
    service = Service(settings)
    if settings.service.loop == "uvloop":
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
            log.warning("uvloop is not installed; using the asyncio loop")
        else:
            uvloop.run(service.serve())
            return
    asyncio.run(service.serve())
