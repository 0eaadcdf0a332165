"""The daemon's lifecycle: ``Service(settings).serve()`` runs ``startup()``, ``main_loop()`` and
``shutdown()``, as uvicorn's ``Server.serve()`` does.

One asyncio loop owns all state. ZeroMQ sockets are served from loop readers (their FD is
edge-triggered, so each reader drains until ZeroMQ reports nothing more to read). Every
background task is supervised: one that dies stops the daemon with a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import secrets
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from kvpubd.daemon import logs, resources
from kvpubd.daemon.conn_cap import ConnectionCap
from kvpubd.daemon.control_server import ControlServer, Handler, StartupError
from kvpubd.daemon.curve import CurveServer
from kvpubd.daemon.drain import Drain
from kvpubd.daemon.endpoint_lock import (
    EndpointInUse,
    EndpointLock,
    UnsafeDirectory,
    check_owner_only,
    lock_path,
    lock_socket_files,
    make_parents,
    remove_dirs,
)
from kvpubd.daemon.hooks import MetricsHooks, NullMetrics
from kvpubd.daemon.notify import Notifier, watchdog_interval
from kvpubd.daemon.operations import Operations
from kvpubd.daemon.owners import ConnectionOwners, RequestOwners
from kvpubd.daemon.pipeline import RankPipeline
from kvpubd.daemon.pool import (
    cache_bytes,
    check_memory,
    check_shm_space,
    describe_pools,
    pool_segment_name,
    stale_segment_bytes,
)
from kvpubd.daemon.reaper import Reaper
from kvpubd.daemon.seq_state import SeqStateInUse
from kvpubd.daemon.settings import CacheConfig, ConfigError, Settings
from kvpubd.daemon.zmq_loop import new_context
from kvpubd.protocol.auth import AuthError
from kvpubd.protocol.endpoints import default_runtime_dir, rank_endpoint

log = logging.getLogger("kvpubd")

__all__ = ["Service", "StartupError", "TaskFailed", "WorkerRole"]

DRAIN_TASK = "drain loop"


class TaskFailed(RuntimeError):
    """A background task of the daemon died; the daemon stops with a non-zero status."""


@dataclass(frozen=True)
class WorkerRole:
    """This service is one rank worker of a service of rank processes (rank_worker): its
    control requests come from that service over a private endpoint, and the service's epoch
    is its own. Everything else (the rank's endpoints, seq state, pool segment name) is as a
    single daemon serving that rank would have it."""

    control_endpoint: str
    epoch: int
    # The service serves metrics: count events by type (stats carry them to it).
    count_events: bool = False


class Service:
    """``reload_settings`` (SIGHUP) returns the configuration as it is now, or raises
    ConfigError; ``start_lines`` are logged once the daemon holds its endpoint."""

    def __init__(
        self,
        settings: Settings,
        reload_settings: Callable[[], Settings] | None = None,
        start_lines: list[str] | None = None,
        worker: WorkerRole | None = None,
    ) -> None:
        self.settings = settings
        self.worker = worker
        # Where control requests come in: the configured endpoint, or a worker's private one.
        self._control_config = (
            settings.control
            if worker is None
            else settings.control.model_copy(update={"endpoint": worker.control_endpoint})
        )
        self._reload_settings = reload_settings
        self._start_lines = start_lines or []
        self.ready = False
        # What start-up made and shutdown removes: the endpoint lock, directories it created.
        # The control endpoint's lock, then those of the ranks' ipc socket files.
        self._locks: list[EndpointLock] = []
        self._created_dirs: list[Path] = []
        self._caps: list[ConnectionCap] = []
        self.epoch = secrets.randbits(62) if worker is None else worker.epoch
        self.pipelines: list[RankPipeline] = []
        self.drain = Drain(self.pipelines, settings.events.tick_interval_ms / 1000)
        # A rank worker counts what its service's metrics read through its stats.
        counts = worker is not None and worker.count_events
        self.metrics: MetricsHooks = (
            self._create_metrics() if settings.metrics.port or counts else NullMetrics()
        )
        self.operations = Operations(self.pipelines, settings, self.metrics, self.epoch, self.drain)
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self.control: ControlServer | None = None
        self._exit = asyncio.Event()
        # The sockets' linger at exit, where it is not theirs (linger_ms): see request_exit.
        self._exit_linger_ms: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: BaseException | None = None
        self._failure_task = ""
        # Frees cleared indexes piecemeal: one deallocation per block must not delay a marker.
        self._reaper = Reaper()
        self._notifier = Notifier.from_environment()
        self._key_reload: asyncio.Task[None] | None = None
        self._reloading: asyncio.Task[None] | None = None
        self._reload_again = False

    @property
    def control_endpoint(self) -> str:
        return self.control.endpoint if self.control is not None else ""

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT; raises TaskFailed if a background task died."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_exit)
        # SIGHUP's default action kills the process without a word.
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        try:
            await self.lifetime()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(signum)

    async def lifetime(self, started: Callable[[], None] | None = None) -> None:
        """Start up, serve until ``request_exit``, shut down; raises TaskFailed if a
        background task died. ``started`` is called once start-up ended, as it ended."""
        try:
            try:
                stopped_early = await self._start_unless_stopped()
            finally:
                if started is not None:
                    started()
            if not stopped_early:
                await self.main_loop()
        finally:
            await self.shutdown()
        if self._failure is not None:
            raise TaskFailed(f"{self._failure_task}: {self._failure!r}") from self._failure

    async def _start_unless_stopped(self) -> bool:
        """Start up; True if an exit request came first (start-up can take seconds: rank
        workers starting, a large pool allocated), and start-up was cancelled."""
        startup = asyncio.ensure_future(self.startup())
        exit_requested = asyncio.ensure_future(self._exit.wait())
        try:
            await asyncio.wait({startup, exit_requested}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exit_requested.cancel()
        if startup.done():
            startup.result()  # raises what start-up raised
            return False
        startup.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await startup
        log.info("stopped before start-up ended")
        return True

    def health(self) -> str | None:
        """None while the daemon is ready and its drain loop runs; else what is wrong."""
        if not self.ready:
            return "not ready"
        if self._exit.is_set():
            return "stopping"
        if not any(t.get_name() == f"kvpubd {DRAIN_TASK}" and not t.done() for t in self._tasks):
            return "the drain loop is not running"
        return None

    def reload(self) -> None:
        """SIGHUP: apply the log level and the CURVE authorised keys as they are now; every
        other setting needs a restart. The file is read and checked on a thread (parsing one of
        hundreds of kilobytes held resets back half a second), one reload at a time: a SIGHUP
        meanwhile reads it once more after. The keys are read a few files per loop turn (a
        directory of thousands would hold a reset back); a SIGHUP during that starts over."""
        if self._reload_settings is None:
            log.info("SIGHUP: nothing to reload")
            return
        if self._reloading is not None and not self._reloading.done():
            self._reload_again = True
            return
        self._reloading = asyncio.create_task(self._reload(self._reload_settings))

    async def _reload(self, read: Callable[[], Settings]) -> None:
        # systemd (`systemctl reload`) is told when the reload starts and when it is done, the
        # CURVE keys read too.
        self._notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
        try:
            while True:
                self._reload_again = False
                try:
                    fresh = await asyncio.to_thread(read)
                except ConfigError as exc:
                    log.error("SIGHUP: config error: %s; nothing reloaded", exc)
                else:
                    self._apply_reload(fresh)
                    if self._key_reload is not None:
                        await asyncio.wait({self._key_reload})  # its failure is its own
                if not self._reload_again:
                    return
        finally:
            if not self._exit.is_set():  # a reload cut short by a stop: STOPPING=1 was sent
                self._notifier.ready("reloaded")

    def _apply_reload(self, fresh: Settings) -> None:
        self._set_log_level(fresh.service.log_level)
        reloaded = f"log level {fresh.service.log_level}"
        curve = self.control.curve if self.control is not None else None
        if self._key_reload is not None:
            self._key_reload.cancel()
            self._key_reload = None
        if curve is None:
            log.info("SIGHUP: reloaded %s", reloaded)
        else:
            self._key_reload = asyncio.create_task(self._reload_keys(curve, reloaded))
        running = self.settings.model_dump()  # both sides dumped: lists of models compare so
        changed = [
            f"{section}.{key}"
            for section, values in fresh.model_dump().items()
            for key, value in values.items()
            if (section, key) != ("service", "log_level") and running[section][key] != value
        ]
        if changed:
            log.warning("SIGHUP: %s changed; restart the daemon to apply", ", ".join(changed))

    def _set_log_level(self, level: str) -> None:
        """SIGHUP's log level, here (a service of rank processes passes it on)."""
        logs.set_level(level)

    async def _reload_keys(self, curve: CurveServer, reloaded: str) -> None:
        try:
            count = await curve.reload()
        except AuthError as exc:
            log.error("SIGHUP: control.curve_authorized_keys: %s; keeping the keys loaded", exc)
            log.info("SIGHUP: reloaded %s", reloaded)
        else:
            log.info("SIGHUP: reloaded %s, %d authorised CURVE client key(s)", reloaded, count)

    def request_exit(self, linger_ms: int | None = None) -> None:
        """Stop; ``linger_ms``: what queued messages get at most, whatever linger_ms says (a
        rank worker whose service is gone lets go of its endpoints at once, so that a service
        started again right away can take them)."""
        if not self._exit.is_set():
            log.info("shutdown requested")
        if linger_ms is not None and (
            self._exit_linger_ms is None or linger_ms < self._exit_linger_ms
        ):
            self._exit_linger_ms = linger_ms
        self._exit.set()

    async def startup(self) -> None:
        # The lock first: a daemon running on this endpoint keeps its sockets, socket file and
        # pool segment (named after the endpoint), and this one says one line and exits.
        self._lock_endpoint()
        for line in self._start_lines:
            log.info("%s", line)
        resources.raise_fd_limit()
        limit = resources.fd_limit()
        if limit < resources.MIN_FD_LIMIT:
            raise StartupError(
                f"the file descriptor limit is {limit}: kvpubd needs at least "
                f"{resources.MIN_FD_LIMIT} (raise it with ulimit -n or LimitNOFILE=)"
            )
        if limit < resources.SAFE_FD_LIMIT:
            log.warning(
                "file descriptors: the limit is %d; below %d a burst of connections to an "
                "ipc endpoint can use up the reserve before its cap closes it, and libzmq "
                "then aborts the daemon (raise it with ulimit -n or LimitNOFILE=)",
                limit,
                resources.SAFE_FD_LIMIT,
            )
        self._check_memory()
        self._context = new_context()
        self.control = ControlServer(
            self._context,
            self._control_config,
            self._control_handler(),
            self.metrics,
            # A worker's one client is its service, which bounds its requests in flight.
            replies_bounded_by_client=self.worker is not None,
        )
        self.control.bind()
        await self._start_ranks(self._context)
        # Metrics before the control socket is served: a daemon that answers ping has every
        # endpoint up (a probe right after the first ping found /healthz refusing connections).
        await self._start_metrics()
        self.control.start()
        self._cap_connections()
        upstream = self.settings.upstream
        log.log(
            logging.INFO if self.worker is None else logging.DEBUG,
            "ready: %d rank(s), %s, control on %s, fd limit %d",
            len(self.settings.cache.ranks),
            f"following the {upstream.flavour} engine at {upstream.endpoint}"
            if upstream.on
            else f"{self.settings.cache.num_blocks} blocks of "
            f"{self.settings.cache.block_bytes} bytes each",
            self.control_endpoint,
            resources.fd_limit(),
        )
        # Everything built so far lives as long as the daemon: the per-block lists of every
        # index among it. Out of the collector's reach, a full collection no longer walks them
        # (a pause that grew with the pool and landed on whichever reset came next).
        gc.freeze()
        self.ready = True
        if self.worker is None:
            self._notify_ready()

    # -- the ranks: in this process (a subclass runs them in worker processes) ---------------

    def _create_metrics(self) -> MetricsHooks:
        from kvpubd.daemon.metrics import Metrics  # prometheus-client only where metrics are on

        return Metrics(lambda: self.pipelines, lambda: self.drain.paused, self.health)

    def _control_handler(self) -> Handler:
        return self.operations.handle

    async def _start_ranks(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Build every rank's pipeline, publish its startup marker, start the drain."""
        for rank in self.settings.cache.ranks:
            try:
                pipeline = RankPipeline(
                    rank,
                    self.settings,
                    context,
                    self.metrics,
                    self._reaper,
                    self.drain,
                )
            except SeqStateInUse as exc:
                raise StartupError(str(exc)) from None
            self.pipelines.append(pipeline)
        for pipeline in self.pipelines:
            pipeline.start()
            publisher = pipeline.publisher
            snapshots = publisher.transport.snapshot_endpoint
            log.info(
                "rank %d: events on %s, replay on %s%s",
                pipeline.rank,
                publisher.endpoint or "(nowhere)",
                publisher.replay_endpoint or "(off)",
                f", snapshots on {snapshots}" if snapshots else "",
            )
            publisher.start()
        self._spawn(self.drain.run(), DRAIN_TASK)
        self._spawn(self._reaper.run(), "reaper")

    def _stop_publishing(self) -> None:
        """Shutdown's first step: no more replays or snapshots served."""
        for pipeline in self.pipelines:
            pipeline.publisher.stop()

    async def _stop_ranks(self) -> None:
        """After the control socket closed: publish what each rank captured, close it."""
        for pipeline in self.pipelines:
            seq = _attempt(f"rank {pipeline.rank} last batch", pipeline.flush)
            if seq is not None:
                log.info("rank %d: published the last batch, seq %d", pipeline.rank, seq)
        for pipeline in self.pipelines:
            close = functools.partial(pipeline.close, self._exit_linger_ms)
            _attempt(f"rank {pipeline.rank} close", close)

    def _rank_listeners(self) -> list[tuple[zmq.Socket[bytes], str, str]]:
        """Each rank's listening sockets, for the connection caps."""
        return [
            (sock, bound, f"rank {pipeline.rank} {what}")
            for pipeline in self.pipelines
            for sock, bound, what in pipeline.publisher.listeners()
        ]

    def _rank_socket_files(self) -> list[tuple[str, str]]:
        """(what, endpoint) of every rank socket to lock before anything binds."""
        events = self.settings.events
        return [
            (f"rank {rank} {kind} endpoint", rank_endpoint(base, rank))
            for rank in self.settings.cache.ranks
            for kind, base in (
                ("events", events.endpoint),
                ("replay", events.replay_endpoint),
                ("snapshot", events.snapshot_endpoint),
            )
            if base
        ]

    @property
    def owners(self) -> RequestOwners:
        """Who opened each open request (released when its client goes away)."""
        return self.operations.owners

    async def main_loop(self) -> None:
        """Wait for an exit request, or for a background task to die."""
        await self._exit.wait()

    async def shutdown(self) -> None:
        """Stop everything that started; each step runs even if an earlier one failed."""
        self._notifier.stopping("stopping")
        self._stop_publishing()
        for guard in self._caps:
            _attempt(f"{guard.name} connection cap", guard.close)
        self._caps = []
        self.owners.close()
        tasks, self._tasks = self._tasks, []
        tasks += [t for t in (self._key_reload, self._reloading) if t is not None]
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
        try:
            await self._stop_ranks()
        except Exception:
            log.exception("shutdown: stopping the ranks failed")
        if self._context is not None:
            # Closes what a failed start-up left open, then waits up to each socket's linger
            # (linger_ms for PUB) for queued messages to reach subscribers.
            _attempt("zmq context", self._context.destroy)
            self._context = None
        # Last, so that no second daemon can start before this one let go of everything.
        locks, self._locks = self._locks, []
        for lock in reversed(locks):
            _attempt("endpoint lock", lock.release)
        remove_dirs(self._created_dirs)
        if self.ready:  # a daemon that never started does not say it stopped
            log.info("stopped")
        self._notifier.close()

    def _lock_endpoint(self) -> None:
        """Lock the control endpoint and every rank's ipc socket file before anything binds:
        one daemon per endpoint, and none takes over another's sockets."""
        endpoint = self._control_config.endpoint
        path = lock_path(endpoint, default_runtime_dir())
        sockets = self._rank_socket_files()
        try:
            if path is not None:
                self._created_dirs = make_parents(path)
                if path.parent == default_runtime_dir():
                    check_owner_only(path.parent)
                self._locks.append(EndpointLock.acquire(endpoint, path))
            self._locks += lock_socket_files(sockets)
        except (EndpointInUse, UnsafeDirectory) as exc:
            raise StartupError(str(exc)) from None
        except OSError as exc:  # e.g. a directory this user may not write to
            raise StartupError(f"cannot lock an endpoint: {exc}") from None

    def _check_memory(self) -> None:
        """Refuse a cache the machine cannot hold, before any of it is allocated: host pools
        against /dev/shm (the more precise message), then everything against memory."""
        cache = self.settings.cache
        if self.settings.upstream.on:
            return  # the engine owns the cache: no pool here
        ranks = len(cache.ranks)
        # A hybrid cache has a pool per group.
        specs = cache.group_specs()
        pool_blocks = sum(spec.num_blocks for spec in specs)
        pool_bytes = sum(spec.num_blocks * spec.block_bytes for spec in specs)
        host_pool = pool_bytes if cache.on_host else 0
        # The host tier lives in shared memory whatever the pool's device.
        host_tier = cache.host_blocks * cache.block_bytes
        if host_pool or host_tier:
            names = [pool_segment_name(self.settings.control.endpoint, r) for r in cache.ranks]
            names += [f"{name}-{part}" for name in names for part in _segment_suffixes(cache)]
            tier = f", and {ranks} host tier(s) of {cache.host_blocks} blocks" if host_tier else ""
            pools = describe_pools(ranks, cache.num_blocks, cache.block_bytes)
            if cache.groups:
                pools = f"{len(specs)} groups' pools ({pool_blocks} blocks per rank)"
            check_shm_space(
                ranks * (host_pool + host_tier),
                pools + tier,
                reclaimable=stale_segment_bytes(names),
            )
        per_rank = cache_bytes(pool_blocks, cache.block_size, host_pool)
        per_rank += cache_bytes(cache.host_blocks, cache.block_size, host_tier)
        check_memory(
            ranks * per_rank,
            f"the cache ({ranks} rank(s) of {cache.num_blocks} blocks"
            + (f" and {cache.host_blocks} host blocks)" if host_tier else ")"),
        )

    def _cap_connections(self) -> None:
        """Share the fds left after start-up (less a reserve) among the listeners, so that no
        flood of connections can use up the last one (see conn_cap)."""
        assert self.control is not None and self.control.socket is not None
        listeners = [(self.control.socket, self.control_endpoint, "control")]
        listeners += self._rank_listeners()
        metrics_on = bool(self.settings.metrics.port)
        cap = resources.fd_budget(len(listeners) + metrics_on)
        loop = asyncio.get_running_loop()
        # The control socket's connections tell whose open requests to release (see owners).
        owners = self.owners
        observers = {"control": ConnectionOwners(owners) if owners.enabled else None}
        for sock, bound, name in listeners:
            guard = ConnectionCap.create(sock, bound, cap, name, observers.get(name))
            if guard is not None:
                guard.start(loop)
                self._caps.append(guard)
        if metrics_on:
            self.metrics.max_connections = cap  # type: ignore[attr-defined]
        log.debug(
            "connections: at most %d per listener (%d fds open, limit %d)",
            cap,
            resources.open_fds(),
            resources.fd_limit(),
        )

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
        # The ranks configured: a service of rank processes holds no pipeline of its own.
        delivered = self._notifier.ready(
            f"serving {len(self.settings.cache.ranks)} rank(s), control on {self.control_endpoint}"
        )
        interval = watchdog_interval()
        if interval is not None:
            self._spawn(self._watchdog(interval), "watchdog")
        log.info(
            "%s%s",
            "notified systemd: ready" if delivered else "systemd not told it is ready (see above)",
            f"; watchdog ping every {interval:g} s" if interval is not None else "",
        )

    async def _watchdog(self, interval: float) -> None:
        while True:
            self._notifier.watchdog()
            await asyncio.sleep(interval)


def _attempt(what: str, step: Callable[[], Any]) -> Any:
    """Run one shutdown step; a failure is logged and the next step still runs."""
    try:
        return step()
    except Exception:
        log.exception("shutdown: %s failed", what)
        return None


def _segment_suffixes(cache: CacheConfig) -> list[str]:
    """What a rank's other shared memory segments add to its pool's name: the host tier's,
    and the pools of a hybrid cache's other groups (see RankCache)."""
    primary = cache.primary_group
    groups = [f"g{spec.idx}" for n, spec in enumerate(cache.group_specs()) if n != primary]
    return ["host", *groups] if cache.host_blocks else groups
