"""A service of rank processes (``service.rank_processes``): this process owns the control
socket, the endpoint lock, the metrics endpoint, systemd's notify and watchdog and SIGHUP; each
rank runs in a worker process of its own (rank_worker), with its cache, pool, publisher,
replay and snapshot endpoints. Clients see the same endpoints and protocol as from a daemon
serving every rank in one process: requests are answered or forwarded by ``RankFront``.

A worker that dies (or whose loop stops answering pings for ``service.rank_hang_timeout_s``,
and is killed) is started again, up to ``service.rank_restarts`` times in
``service.rank_restart_window_s``; its seqs go on from the last one published (with
``events.seq_origin = "continue"``) and its first batch is ``AllBlocksCleared``, as after a
daemon restart. One death more stops the service with a non-zero status. On SIGTERM every
worker publishes what its rank captured and exits before this process does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvpubd.daemon.cache import CacheError
from kvpubd.daemon.control_server import Handler, StartupError
from kvpubd.daemon.endpoint_lock import (
    EndpointInUse,
    EndpointLock,
    check_owner_only,
    ipc_path,
    lock_path,
    make_parents,
)
from kvpubd.daemon.hooks import MetricsHooks
from kvpubd.daemon.owners import RequestOwners
from kvpubd.daemon.rank_front import RankFront, decode_ok
from kvpubd.daemon.rank_link import Conn, RankLink
from kvpubd.daemon.rank_processes import RankProcess, WorkerFailed
from kvpubd.daemon.rank_worker import WorkerSpec
from kvpubd.daemon.service import Service
from kvpubd.daemon.settings import Settings
from kvpubd.protocol.control import Ping, PingReply, RankStats, Stats, StatsReply
from kvpubd.protocol.endpoints import default_runtime_dir, rank_endpoint

log = logging.getLogger("kvpubd")

# How long a worker may take to start: a large pool on a GPU takes seconds to allocate.
START_TIMEOUT_S = 300.0
# A worker's answer to the service's first ping, and to a stats request for a scrape.
ANSWER_TIMEOUT_S = 10.0
STATS_TIMEOUT_S = 2.0
# A worker silent for this many ping intervals is unhealthy (/healthz), well before the
# watchdog kills it as hung (service.rank_hang_timeout_s).
HEALTH_SILENT_PINGS = 3
# Time to wait between a worker's death and its next start, doubled per death in the window.
RESTART_DELAY_S = 0.05
# Beyond its linger, what a worker may take to publish its last batch and exit on SIGTERM.
STOP_GRACE_S = 30.0

_encoder = msgspec.msgpack.Encoder()


PRIVATE_DIR_PREFIX = "kvpubd-ranks-"  # then the service's pid, then mkdtemp's suffix


def _remove_dead_services_dirs(runtime: Path) -> None:
    """Remove the private directories of services that are gone (killed outright: nothing
    of theirs removed them)."""
    for directory in runtime.glob(f"{PRIVATE_DIR_PREFIX}*-*"):
        pid_text = directory.name[len(PRIVATE_DIR_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


class WorkerDied(RuntimeError):
    """A rank worker died more often than the restart policy allows."""


class _KnownStats:
    """A rank's stats as last read from its worker (what the metrics collector reads)."""

    def __init__(self, stats: RankStats) -> None:
        self.rank = stats.rank
        self._stats = stats

    def stats(self) -> RankStats:
        return self._stats


class ProcessService(Service):
    def __init__(
        self,
        settings: Settings,
        reload_settings: Callable[[], Settings] | None = None,
        start_lines: list[str] | None = None,
    ) -> None:
        self._processes: dict[int, RankProcess] = {}
        self._links: dict[int, RankLink] = {}
        self._deaths: dict[int, deque[float]] = {r: deque() for r in settings.cache.ranks}
        self._known_stats: dict[int, RankStats] = {}
        self._restarting: dict[int, asyncio.Task[None]] = {}
        self._log_level: str | None = None  # as SIGHUP last set it (None: the settings')
        self._private_dir: Path | None = None
        self._zmq: zmq.Context[zmq.Socket[bytes]] | None = None
        super().__init__(settings, reload_settings, start_lines)
        self.front = RankFront(
            settings, self._running_link, self.metrics, self.epoch, silent=self._silent_for
        )

    # -- what differs from ranks in this process --------------------------------------------

    def _create_metrics(self) -> MetricsHooks:
        from kvpubd.daemon.metrics import Metrics

        return Metrics(
            lambda: [_KnownStats(self._known_stats[r]) for r in sorted(self._known_stats)],
            lambda: self.front.paused,
            self.health,
            refresh=self._refresh_stats,
        )

    def _control_handler(self) -> Handler:
        return self.front.handle

    @property
    def owners(self) -> RequestOwners:
        return self.front.owners

    def _rank_socket_files(self) -> list[tuple[str, str]]:
        return []  # each worker locks its own

    def _rank_listeners(self) -> list[tuple[zmq.Socket[bytes], str, str]]:
        return []  # each worker caps its own

    def _stop_publishing(self) -> None:
        pass  # each worker stops its own on SIGTERM

    def health(self) -> str | None:
        if not self.ready:
            return "not ready"
        if self._exit.is_set():
            return "stopping"
        for rank in self.settings.cache.ranks:
            if rank not in self._links:
                return f"rank {rank}'s worker is not running"
            if (silent_s := self._silent_for(rank)) is not None:
                return f"rank {rank}'s worker answered no ping for {silent_s:.1f} s"
        return None

    def _silent_for(self, rank: int) -> float | None:
        """How long a running worker has answered no ping, once that is HEALTH_SILENT_PINGS
        pings or more; None else."""
        process = self._processes.get(rank)
        if process is None or rank not in self._links:
            return None
        silent_s = time.monotonic() - process.last_pong
        return silent_s if silent_s > HEALTH_SILENT_PINGS * self._ping_interval() else None

    def _ping_interval(self) -> float:
        return min(1.0, self.settings.service.rank_hang_timeout_s / 4)

    def _set_log_level(self, level: str) -> None:
        super()._set_log_level(level)
        self._log_level = level  # a worker started again later starts at it too
        for process in self._processes.values():
            process.say(f"level {level}")

    # -- starting and stopping the workers ---------------------------------------------------

    async def _start_ranks(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._zmq = context
        runtime = default_runtime_dir()
        self._created_dirs += make_parents(runtime / "x")
        check_owner_only(runtime)
        # The workers' control endpoints: owner-only, short (an ipc path has ~100 bytes),
        # named after this process so that a later start removes it if this one is killed.
        _remove_dead_services_dirs(runtime)
        self._private_dir = Path(
            tempfile.mkdtemp(prefix=f"{PRIVATE_DIR_PREFIX}{os.getpid()}-", dir=runtime)
        )
        try:
            await asyncio.gather(*(self._start_worker(rank) for rank in self.settings.cache.ranks))
        except WorkerFailed as exc:
            raise StartupError(str(exc)) from None
        self._spawn(self._watch_workers(), "rank watchdog")

    def _spec(self, rank: int) -> WorkerSpec:
        assert self._private_dir is not None
        settings = self.settings.model_dump(mode="json")
        if self._log_level is not None:  # as SIGHUP last set it
            settings["service"]["log_level"] = self._log_level
        return WorkerSpec(
            settings=settings,
            rank=rank,
            control_endpoint=f"ipc://{self._private_dir}/rank{rank}.sock",
            epoch=self.epoch,
            count_events=bool(self.settings.metrics.port),
        )

    async def _start_worker(self, rank: int) -> None:
        spec = self._spec(rank)
        process = RankProcess(spec, lambda status: self._exited(process, status))
        self._processes[rank] = process
        await process.start(START_TIMEOUT_S)
        assert self._zmq is not None
        link = RankLink(self._zmq, spec.control_endpoint, rank)
        link.start()
        try:
            reply = await asyncio.wait_for(
                _settled(link.request(_encoder.encode(Ping()), Conn.PRIORITY)), ANSWER_TIMEOUT_S
            )
            (endpoints,) = decode_ok(reply, PingReply).endpoints
        except (asyncio.TimeoutError, CacheError, ValueError) as exc:
            link.close("no answer")
            process.abandon()  # its death is this failure's, not one more (a double restart)
            raise WorkerFailed(f"rank {rank}: the worker did not answer: {exc!r}") from None
        self.front.worker_started(rank, endpoints)
        pause = self.front.apply_pause(rank)
        self._links[rank] = link
        if pause is not None:
            await _settled(pause)
        log.info(
            "rank %d: worker pid %s; events on %s, replay on %s%s",
            rank,
            process.pid,
            endpoints.events or "(nowhere)",
            endpoints.replay or "(off)",
            f", snapshots on {endpoints.snapshot}" if endpoints.snapshot else "",
        )

    async def _stop_ranks(self) -> None:
        for task in self._restarting.values():
            task.cancel()
        await asyncio.gather(*self._restarting.values(), return_exceptions=True)
        timeout = self.settings.service.linger_ms / 1000 + STOP_GRACE_S
        processes = list(self._processes.values())
        statuses = await asyncio.gather(
            *(p.stop(timeout) for p in processes), return_exceptions=True
        )
        for process, status in zip(processes, statuses, strict=True):
            if isinstance(status, BaseException):
                log.error("rank %d: stopping its worker failed: %r", process.rank, status)
            elif status not in (0, None):
                log.error("rank %d: its worker exited with status %s", process.rank, status)
            else:
                continue
            # Its last events may not have gone out: the service does not end as if they had.
            if self._failure is None:
                self._failure = WorkerDied(f"rank {process.rank}'s worker exited with {status}")
                self._failure_task = f"rank {process.rank} worker"
        # What a worker killed meanwhile (or while it was being started again) left of its
        # ipc sockets: no worker takes them over now.
        for rank in self.settings.cache.ranks:
            self._remove_socket_files(rank)
        for rank, link in list(self._links.items()):
            link.close("the service is stopping")
            del self._links[rank]
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    def _running_link(self, rank: int) -> RankLink | None:
        return self._links.get(rank)

    # -- a worker that dies or hangs ---------------------------------------------------------

    def _exited(self, process: RankProcess, status: int) -> None:
        """A worker's exit, unless another worker took its rank since (it was given up)."""
        if self._processes.get(process.rank) is process:
            self._worker_exited(process.rank, status)

    def _worker_exited(self, rank: int, status: int) -> None:
        if self._exit.is_set():
            return
        log.error("rank %d: its worker exited with status %d", rank, status)
        link = self._links.pop(rank, None)
        if link is not None:
            link.close(f"rank {rank}'s worker exited before it answered")
        self.front.worker_lost(rank)
        deaths = self._deaths[rank]
        now = time.monotonic()
        deaths.append(now)
        window = self.settings.service.rank_restart_window_s
        while deaths and deaths[0] < now - window:
            deaths.popleft()
        allowed = self.settings.service.rank_restarts
        if len(deaths) > allowed:
            self._remove_socket_files(rank)
            self._fail(
                f"rank {rank} worker",
                WorkerDied(
                    f"rank {rank}'s worker died {len(deaths)} time(s) in {window:g} s "
                    f"(service.rank_restarts = {allowed})"
                ),
            )
            return
        delay = RESTART_DELAY_S * 2 ** (len(deaths) - 1)
        # Not a supervised task: it ends once the worker runs again.
        self._restarting[rank] = asyncio.create_task(
            self._restart(rank, delay), name=f"kvpubd rank {rank} restart"
        )

    def _remove_socket_files(self, rank: int) -> None:
        """What a killed worker left of its ipc sockets, where no worker takes it over (a new
        one would: its lock tells a dead owner's files from a live one's). Files whose lock a
        live process holds (another daemon's, on endpoints this service could not take) are
        left alone."""
        for endpoint in self._rank_ipc_endpoints(rank):
            path = ipc_path(endpoint)
            lock = lock_path(endpoint, default_runtime_dir())
            if path is None or lock is None:
                continue
            try:
                held = EndpointLock.acquire(endpoint, lock)
            except EndpointInUse:
                continue
            except OSError:  # no directory, or not ours: nothing of ours there
                continue
            path.unlink(missing_ok=True)
            held.release()  # removes the lock file

    def _rank_ipc_endpoints(self, rank: int) -> list[str]:
        events = self.settings.events
        bases = (events.endpoint, events.replay_endpoint, events.snapshot_endpoint)
        return [rank_endpoint(base, rank) for base in bases if base.startswith("ipc://")]

    async def _restart(self, rank: int, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self._start_worker(rank)
        except WorkerFailed as exc:
            log.error("%s", exc)
            self._worker_exited(rank, -1)
            return
        except Exception as exc:  # a bug: the service cannot go on without the rank
            self._fail(f"rank {rank} restart", exc)
            return
        log.warning("rank %d: worker started again (its first batch is AllBlocksCleared)", rank)

    async def _watch_workers(self) -> None:
        """Ping every worker's loop; one silent for rank_hang_timeout_s is killed (and then
        handled as one that died)."""
        timeout = self.settings.service.rank_hang_timeout_s
        interval = self._ping_interval()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for rank, process in list(self._processes.items()):
                if rank not in self._links or not process.running:
                    continue  # starting, or dead and about to be handled
                if now - process.last_pong > timeout:
                    log.error(
                        "rank %d: its worker (pid %s) answered no ping for %.1f s; killing it",
                        rank,
                        process.pid,
                        now - process.last_pong,
                    )
                    process.kill()
                else:
                    process.ping()

    def _fail(self, task: str, failure: BaseException) -> None:
        log.critical("%s: %s; stopping", task, failure)
        self._failure = failure
        self._failure_task = task
        self._exit.set()

    # -- metrics -----------------------------------------------------------------------------

    async def _refresh_stats(self) -> None:
        """Read every running worker's stats (for a scrape), all at once; a worker that does
        not answer within STATS_TIMEOUT_S keeps its last ones. (Waited for one after another,
        a scrape took that long per hung worker.)"""
        asked = {
            rank: asyncio.ensure_future(
                _settled(link.request(_encoder.encode(Stats()), Conn.PRIORITY))
            )
            for rank, link in list(self._links.items())
        }
        if not asked:
            return
        await asyncio.wait(asked.values(), timeout=STATS_TIMEOUT_S)
        for rank, answer in asked.items():
            if not answer.done():
                answer.cancel()
                continue
            with contextlib.suppress(Exception):
                for stats in decode_ok(answer.result(), StatsReply).ranks:
                    self._known_stats[rank] = stats


async def _settled(pending: Any) -> Any:
    """A Pending's value (or its error raised), awaited."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    pending.then(settle)
    return await future


def run(
    settings: Settings,
    reload_settings: Callable[[], Settings] | None = None,
    start_lines: list[str] | None = None,
) -> None:
    """Run the daemon until SIGTERM/SIGINT, on uvloop unless configured otherwise."""
    service = create_service(settings, reload_settings, start_lines)
    if settings.service.loop == "uvloop":
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
            log.warning("uvloop is not installed; using the asyncio loop")
        else:
            uvloop.run(service.serve())
            return
    asyncio.run(service.serve())


def create_service(
    settings: Settings,
    reload_settings: Callable[[], Settings] | None = None,
    start_lines: list[str] | None = None,
) -> Service:
    """The service ``settings`` ask for: ranks in worker processes, or in this one."""
    if uses_rank_processes(settings):
        return ProcessService(settings, reload_settings, start_lines)
    return Service(settings, reload_settings, start_lines)


def uses_rank_processes(settings: Settings, cpus: int | None = None) -> bool:
    """Whether ``settings`` ask for rank workers: "on", or "auto" with more than one rank and
    a CPU for each worker and one for the service (of the ``cpus`` this process may use). With
    fewer, the workers and the service would take turns on the same CPUs, and a reset would
    wait for two of them to be scheduled instead of one: on 2 CPUs under every soak load at
    once, 2 workers gave a reset p99 of 461 ms against 24 ms in one process."""
    mode = settings.service.rank_processes
    if mode != "auto":
        return mode == "on"
    ranks = len(settings.cache.ranks)
    return ranks > 1 and (usable_cpus() if cpus is None else cpus) >= ranks + 1


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, where the OS tells)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


__all__: Sequence[str] = [
    "ProcessService",
    "WorkerDied",
    "create_service",
    "run",
    "uses_rank_processes",
]
