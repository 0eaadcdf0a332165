"""The daemon: ``Service(settings).serve()`` runs startup, the main loop and shutdown.

One asyncio loop owns all state. ZeroMQ sockets are served from loop readers (their FD is
edge-triggered, so each reader drains until ZeroMQ reports nothing more to read), and every
handler is synchronous: a reset's marker is handed to ZeroMQ before its reply is sent.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import secrets
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from kvpubd import __version__
from kvpubd.daemon.cache import CacheError, RankCache
from kvpubd.daemon.notify import Notifier, watchdog_interval
from kvpubd.daemon.pool import pool_segment_name
from kvpubd.daemon.publisher import Publisher
from kvpubd.daemon.reaper import Reaper
from kvpubd.daemon.sink import EventSink
from kvpubd.protocol.auth import CurveServer
from kvpubd.protocol.config import Settings, rank_endpoint
from kvpubd.protocol.control import (
    Checksum,
    Ping,
    PoolInfo,
    ProtocolError,
    Release,
    Request,
    Reset,
    Snapshot,
    Stats,
    Store,
    error_reply,
    ok_reply,
    parse_request,
)
from kvpubd.protocol.hashing import token_count, tokens_array
from kvpubd.protocol.wire import event_to_wire

if TYPE_CHECKING:
    from kvpubd.daemon.metrics import Metrics

log = logging.getLogger("kvpubd")

# Control requests handled per reader wake-up before the loop gets a turn (drain ticks).
CONTROL_BURST = 64


class Rank:
    """Everything one data-parallel rank owns: cache, sink and publisher."""

    def __init__(
        self, rank: int, settings: Settings, context: zmq.Context, metrics: Metrics | None = None
    ) -> None:
        events = settings.events
        self.rank = rank
        self.metrics = metrics
        # Sockets first: a failed bind leaves nothing but sockets, which the context closes.
        self.publisher = Publisher(
            context,
            endpoint=rank_endpoint(events.endpoint, rank),
            replay_endpoint=rank_endpoint(events.replay_endpoint, rank)
            if events.replay_endpoint
            else "",
            topic=events.topic,
            wire_format=events.wire_format,
            rank=rank,
            buffer_steps=events.buffer_steps,
            max_replays=events.max_replays,
            hwm=events.hwm,
            replay_framing=events.replay_framing,
            linger_ms=settings.service.linger_ms,
        )
        self.sink = EventSink(
            block_size=settings.cache.block_size,
            medium=settings.medium,
            max_events_per_tick=events.max_events_per_tick,
        )
        self.cache = RankCache(
            settings.cache,
            self.sink,
            events.hash_format,
            rank,
            pool_name=pool_segment_name(settings.control.endpoint, rank),
        )
        self.resets = 0

    def flush(self, new_tick: bool = False) -> int | None:
        """Publish everything captured as one batch; returns its seq, or None if nothing was.
        ``new_tick``: this is the periodic drain, which starts a fresh capture budget."""
        events = self.sink.drain(new_tick)
        if not events:
            return None
        seq = self.publisher.publish(events)
        if self.metrics is not None:
            self.metrics.published(self.rank, events)
        return seq

    def stats(self) -> dict[str, Any]:
        pool = self.cache.pool
        return {
            "rank": self.rank,
            "seq": self.publisher.last_seq,
            "batches": self.publisher.batches,
            "events_published": self.publisher.events,
            "dropped_stores": self.sink.dropped_stores,
            "resets": self.resets,
            "replay_requests": self.publisher.replay_requests,
            "replays_refused": self.publisher.replays_refused,
            "blocks_total": pool.num_blocks,
            "blocks_used": pool.used_count,
            "blocks_free": pool.free_count,
            "blocks_cached": len(self.cache.index),
            "blocks_pinned": self.cache.pinned_blocks,
            "blocks_published": len(self.sink.published),
            "requests_open": len(self.cache.leases),
            "events_pending": self.sink.pending_count,
            "endpoint": self.publisher.endpoint,
            "replay_endpoint": self.publisher.replay_endpoint,
        }


class Service:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.epoch = secrets.randbits(62)
        self.paused = False
        self.ranks: list[Rank] = []
        self.control_endpoint = ""
        self._context: zmq.Context | None = None
        self._control: zmq.Socket | None = None
        self._exit = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._readers: list[int] = []
        # Work a request leaves for after its reply (scrubs).
        self._after_reply: list[Callable[[], None]] = []
        # Frees cleared indexes piecemeal: one deallocation per block must not delay a marker.
        self._reaper = Reaper()
        self.metrics = _create_metrics(self) if settings.metrics.port else None
        self._notifier = Notifier.from_environment()
        self._curve: CurveServer | None = None
        self._handlers: dict[type, Callable[[Any], dict[str, Any]]] = {
            Ping: self._ping,
            Stats: self._stats,
            Store: self._store,
            Release: self._release,
            Reset: self._reset,
            Snapshot: self._snapshot,
            PoolInfo: self._pool_info,
            Checksum: self._checksum,
        }

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> None:
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

    def request_exit(self) -> None:
        if not self._exit.is_set():
            log.info("shutdown requested")
        self._exit.set()

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        self._context = zmq.Context()
        # Control first: it refuses to start beside a running daemon on the same endpoint,
        # before anything here could take over that daemon's sockets or pool segment.
        self._control = self._bind_control()
        for rank in range(self.settings.cache.data_parallel_size):
            self.ranks.append(Rank(rank, self.settings, self._context, self.metrics))
        for rank in self.ranks:
            # Seq 0 of every start tells subscribers to forget what an earlier run published.
            rank.sink.cleared()
            rank.flush()
            log.info(
                "rank %d: events on %s, replay on %s",
                rank.rank,
                rank.publisher.endpoint,
                rank.publisher.replay_endpoint or "(off)",
            )
            if rank.publisher.replay is not None:
                self._add_reader(loop, rank.publisher.replay, _replay_pump(rank.publisher))
        self._add_reader(loop, self._control, self._serve_control)
        await self._start_metrics()
        self._tasks.append(asyncio.create_task(self._drain_loop(), name="kvpubd-drain"))
        self._tasks.append(asyncio.create_task(self._reaper.run(), name="kvpubd-reaper"))
        log.info(
            "ready: %d rank(s), %d blocks of %d bytes each, control on %s",
            len(self.ranks),
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
        await self._exit.wait()

    async def shutdown(self) -> None:
        self._notifier.stopping("stopping")
        loop = asyncio.get_running_loop()
        for fd in self._readers:
            loop.remove_reader(fd)
        self._readers = []
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.metrics is not None:
            await self.metrics.close()
        if self._control is not None:  # stop taking requests first
            self._control.close(linger=0)
            self._control = None
            self._unlink_control_socket()
        for rank in self.ranks:
            seq = rank.flush()
            if seq is not None:
                log.info("rank %d: published the last batch, seq %d", rank.rank, seq)
        for rank in self.ranks:
            rank.publisher.close()
            rank.cache.pool.close()
        if self._curve is not None:
            self._curve.stop()
            self._curve = None
        if self._context is not None:
            # Closes what a failed start-up left open, then waits up to each socket's linger
            # (linger_ms for PUB) for queued messages to reach subscribers.
            self._context.destroy()
            self._context = None
        log.info("stopped")
        self._notifier.close()

    def _add_reader(
        self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket, drain: Callable
    ) -> None:
        fd = sock.getsockopt(zmq.FD)
        loop.add_reader(fd, drain)
        self._readers.append(fd)
        # Anything that arrived before the reader existed would not wake it.
        loop.call_soon(drain)

    async def _start_metrics(self) -> None:
        if self.metrics is None:
            return
        host, port = self.settings.metrics.host, self.settings.metrics.port
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
            f"serving {len(self.ranks)} rank(s), control on {self.control_endpoint}"
        )
        interval = watchdog_interval()
        if interval is not None:
            self._tasks.append(
                asyncio.create_task(self._watchdog(interval), name="kvpubd-watchdog")
            )
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
            if not self.paused:
                for rank in self.ranks:
                    rank.flush(new_tick=True)

    # -- control socket --------------------------------------------------------------------

    def _bind_control(self) -> zmq.Socket:
        assert self._context is not None
        endpoint = self.settings.control.endpoint
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        control = self.settings.control
        if control.curve_secret_key:
            self._curve = CurveServer(
                self._context, Path(control.curve_secret_key), Path(control.curve_authorized_keys)
            )
            self._curve.apply(sock)
        # Hard cap well above the protocol limit: larger frames cost a disconnect, not memory.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.settings.control.max_message_bytes + 1024)
        path = _ipc_path(endpoint)
        if path is not None:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Binding an ipc path silently takes it over from whoever holds it.
            if path.exists() and _answers_ping(endpoint):
                raise StartupError(f"control endpoint {endpoint} is in use by a running daemon")
        old_umask = os.umask(0o077)  # the socket file is created owner-only
        try:
            sock.bind(endpoint)
        finally:
            os.umask(old_umask)
        if path is not None:
            os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
        self.control_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    def _unlink_control_socket(self) -> None:
        path = _ipc_path(self.control_endpoint)
        if path is not None:
            path.unlink(missing_ok=True)

    def _serve_control(self) -> None:
        sock = self._control
        if sock is None:
            return
        for _ in range(CONTROL_BURST):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(zmq.NOBLOCK)
            reply = self.handle_frames(frames)
            if reply is not None:
                sock.send_multipart([frames[0], b"", reply], zmq.NOBLOCK)
            self._run_after_reply()
        asyncio.get_running_loop().call_soon(self._serve_control)

    def handle_frames(self, frames: list[bytes]) -> bytes | None:
        """Answer one ROUTER message ``[identity, b"", request]``; None for unusable framing."""
        if len(frames) < 2 or frames[1] != b"":
            log.debug("control: dropped a message without the empty delimiter")
            return None
        try:
            if len(frames) != 3:
                raise ProtocolError(
                    "bad_request", f"expected one request frame, got {len(frames) - 2}"
                )
            request = parse_request(frames[2], self.settings.control.max_message_bytes)
        except ProtocolError as exc:
            if self.metrics is not None:
                self.metrics.refused(exc.code)
            return error_reply(exc.request_id, exc.code, exc.message)
        return self.handle(request)

    def handle(self, request: Request) -> bytes:
        error_code: str | None = None
        try:
            if request.op == "pause" or request.op == "resume":
                self.paused = request.op == "pause"
                log.info("periodic drain %s", "paused" if self.paused else "resumed")
                return ok_reply(request.id, paused=self.paused)
            return ok_reply(request.id, **self._handlers[type(request)](request))
        except CacheError as exc:
            error_code = exc.code
            return error_reply(request.id, exc.code, exc.message)
        except Exception as exc:  # a bug: answer it, keep serving
            error_code = "internal"
            log.exception("control: %s failed", request.op)
            return error_reply(request.id, "internal", f"{type(exc).__name__}: {exc}")
        finally:
            if self.metrics is not None:
                self.metrics.control(request.op, error_code)

    def _run_after_reply(self) -> None:
        work, self._after_reply = self._after_reply, []
        for step in work:
            step()

    def _rank(self, rank: int) -> Rank:
        if rank >= len(self.ranks):
            raise CacheError(
                "bad_request", f"rank: {rank} is not served (ranks: {len(self.ranks)})"
            )
        return self.ranks[rank]

    # -- operations ------------------------------------------------------------------------

    def _ping(self, request: Ping) -> dict[str, Any]:
        return {
            "version": __version__,
            "epoch": self.epoch,
            "ranks": len(self.ranks),
            "endpoints": [
                {
                    "rank": r.rank,
                    "events": r.publisher.endpoint,
                    "replay": r.publisher.replay_endpoint,
                }
                for r in self.ranks
            ],
        }

    def _stats(self, request: Stats) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "paused": self.paused,
            "ranks": [r.stats() for r in self.ranks],
        }

    def _store(self, request: Store) -> dict[str, Any]:
        rank = self._rank(request.rank)
        limit = self.settings.control.max_tokens_per_request
        if token_count(request.token_ids) > limit:
            raise CacheError(
                "too_large",
                f"token_ids: {token_count(request.token_ids)} tokens; the limit is {limit}",
            )
        if any(request.request_id in r.cache.leases for r in self.ranks):
            raise CacheError("duplicate_request", f"request {request.request_id!r} is already open")
        try:
            tokens = tokens_array(request.token_ids)
        except (ValueError, OverflowError) as exc:
            raise CacheError("bad_request", f"token_ids: {exc}") from None
        block_ids, cached = rank.cache.store(
            request.request_id, tokens, request.lora_id, request.lora_name, request.cache_salt
        )
        return {"rank": rank.rank, "block_ids": block_ids, "num_cached_tokens": cached}

    def _release(self, request: Release) -> dict[str, Any]:
        for rank in self.ranks:
            if request.request_id in rank.cache.leases:
                return {"rank": rank.rank, "released": rank.cache.release(request.request_id)}
        raise CacheError("unknown_request", f"request {request.request_id!r} is not open")

    def _reset(self, request: Reset) -> dict[str, Any]:
        targets = self.ranks if request.rank is None else [self._rank(request.rank)]
        if not request.force:
            busy = [r for r in targets if r.cache.leases]
            if busy:
                open_requests = sum(len(r.cache.leases) for r in busy)
                raise CacheError(
                    "busy",
                    f"{open_requests} open request(s) pin blocks on rank(s) "
                    f"{', '.join(str(r.rank) for r in busy)}; release them or pass force",
                )
        started = time.perf_counter()
        markers = []
        for rank in targets:
            retired = rank.cache.reset()
            rank.resets += 1
            seq = rank.flush() if self.settings.events.flush_on_reset else None
            markers.append({"rank": rank.rank, "seq": seq})
            # Tearing down a large index and zeroing blocks wait until the reply is out.
            self._after_reply.append(rank.cache.pool.scrub_pending)
            self._reaper.retire(*retired)
        if self.metrics is not None:
            self.metrics.reset_done(time.perf_counter() - started)
        log.info(
            "reset rank(s) %s in %.0f us: markers %s",
            ", ".join(str(r.rank) for r in targets),
            (time.perf_counter() - started) * 1e6,
            ", ".join(f"{m['rank']}:{m['seq']}" for m in markers),
        )
        return {"markers": markers}

    def _snapshot(self, request: Snapshot) -> dict[str, Any]:
        rank = self._rank(request.rank)
        # Publish what is captured first, so the snapshot is exactly the state at its seq.
        rank.flush()
        wire_format = self.settings.events.wire_format
        return {
            "rank": rank.rank,
            "seq": rank.publisher.last_seq,
            "epoch": self.epoch,
            "events": [event_to_wire(e, wire_format) for e in rank.cache.snapshot()],
        }

    def _pool_info(self, request: PoolInfo) -> dict[str, Any]:
        rank = self._rank(request.rank)
        return {"rank": rank.rank, **rank.cache.pool.info()}

    def _checksum(self, request: Checksum) -> dict[str, Any]:
        rank = self._rank(request.rank)
        pool = rank.cache.pool
        if len(request.block_ids) > pool.num_blocks:
            raise CacheError("too_large", f"block_ids: at most {pool.num_blocks} ids")
        bad = [b for b in request.block_ids if b >= pool.num_blocks]
        if bad:
            raise CacheError(
                "bad_request", f"block_ids: {bad[0]} is not a block (pool has {pool.num_blocks})"
            )
        return {"rank": rank.rank, "checksums": pool.checksum(request.block_ids)}


class StartupError(RuntimeError):
    """The daemon cannot start as configured."""


def _create_metrics(service: Service) -> Metrics:
    from kvpubd.daemon.metrics import Metrics  # prometheus-client only where metrics are on

    return Metrics(lambda: service.ranks, lambda: service.paused)


def _answers_ping(endpoint: str) -> bool:
    """Whether a daemon answers a ping there (with a bare DEALER: the daemon never imports
    the client library)."""
    import msgpack

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", msgpack.packb({"op": "ping"})], zmq.NOBLOCK)
        return bool(sock.poll(500))
    except zmq.ZMQError:  # nothing listening: the message could not even be queued
        return False
    finally:
        sock.close()
        context.term()


def _replay_pump(publisher: Publisher) -> Callable[[], None]:
    """Reader callback for a replay socket: serve replays a chunk at a time, coming back on a
    later loop turn while any remain, so resets and ticks never wait behind a long replay."""
    loop = asyncio.get_running_loop()

    def pump() -> None:
        if publisher.handle_replay():
            loop.call_soon(pump)

    return pump


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None


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
