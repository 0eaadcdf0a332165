"""Prometheus metrics of one daemon, served over HTTP from the daemon's own event loop.

Counters the daemon already keeps (batches, dropped stores, resets, replay requests) and the
pool's gauges are read from the ranks at scrape time; events by type and control requests are
counted here as plain integers on the loop, so publishing costs no locks. Each ``Metrics`` has
its own ``CollectorRegistry``: several daemons can run in one process (tests do).

The HTTP endpoint is an asyncio server on the daemon's loop, not prometheus-client's thread:
a scrape then sees one consistent state between two handlers, and a stuck loop stops answering
scrapes too."""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_left
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvpubd import __version__
from kvpubd.protocol.control import RankStats
from kvpubd.protocol.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, RelayedStored

log = logging.getLogger(__name__)

EVENT_TYPES: dict[type, str] = {
    BlockStored: "BlockStored",
    RelayedStored: "BlockStored",
    BlockRemoved: "BlockRemoved",
    AllBlocksCleared: "AllBlocksCleared",
}
# Control requests refused before their op was known (not msgpack, unknown op, bad fields).
INVALID_OP = "invalid"
# Reset handler time: tens of microseconds for small pools, milliseconds for large ones.
RESET_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
HTTP_LIMIT = 16 * 1024  # bytes of request line and headers a scrape may send
HTTP_TIMEOUT_S = 5.0  # a client that sends no complete request in this time is dropped
HTTP_BACKLOG = 16  # connections the kernel queues before we accept (and count) them
# Connections served at once (the daemon sets it to its per-listener cap); more are closed at once.
HTTP_MAX_CONNECTIONS = 64


def _peer_host(writer: asyncio.StreamWriter) -> str:
    """The client's host ("" where the transport does not tell)."""
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


class RankLike(Protocol):
    """What the collector reads of a rank (kvpubd.daemon.service.Rank)."""

    rank: int

    def stats(self) -> RankStats: ...


class Metrics:
    """The daemon's metrics. ``ranks`` returns the served ranks; ``paused`` tells whether the
    periodic drain is paused."""

    def __init__(
        self,
        ranks: Callable[[], Sequence[RankLike]],
        paused: Callable[[], bool] = lambda: False,
        health: Callable[[], str | None] = lambda: None,
        refresh: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """``health`` returns None while the daemon is healthy, else why it is not;
        ``refresh``, where given, is awaited before each scrape is answered (a service of rank
        processes reads its workers' stats then)."""
        self.registry = CollectorRegistry()
        self._ranks = ranks
        self._paused = paused
        self._health = health
        self._refresh = refresh
        self.max_connections = HTTP_MAX_CONNECTIONS
        self.connections = 0
        self._by_peer: dict[str, int] = {}  # connections served now, by client host
        self.connections_refused = 0
        # (rank, event type) -> events published; control op -> requests; (op, code) -> errors.
        self.events: dict[tuple[int, str], int] = {}
        self.requests: dict[str, int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        # Per bucket of RESET_BUCKETS (and +Inf): resets that took at most its bound, not
        # cumulated; kept here rather than in a prometheus Histogram, which would add a
        # `_created` series that the text format shows as a gauge of its own.
        self.reset_counts = [0] * (len(RESET_BUCKETS) + 1)
        self.reset_sum = 0.0
        self.registry.register(_StateCollector(self))
        ProcessCollector(registry=self.registry)
        self._server: asyncio.AbstractServer | None = None
        self.url = ""

    # -- hooks, called on the daemon's loop --------------------------------------------------

    def published(self, rank: int, events: Iterable[Event]) -> None:
        counts = self.events
        # Counter counts in C: about 4 % of encoding time for a full 50 000-event batch.
        for kind, count in Counter(map(type, events)).items():
            key = (rank, EVENT_TYPES[kind])
            counts[key] = counts.get(key, 0) + count

    def control(self, op: str, error_code: str | None = None) -> None:
        """One control request answered; ``error_code`` when it was refused."""
        self.requests[op] = self.requests.get(op, 0) + 1
        if error_code is not None:
            key = (op, error_code)
            self.errors[key] = self.errors.get(key, 0) + 1

    def refused(self, error_code: str) -> None:
        """A control request refused before its op was known."""
        self.control(INVALID_OP, error_code)

    def reset_done(self, seconds: float) -> None:
        self.reset_counts[bisect_left(RESET_BUCKETS, seconds)] += 1
        self.reset_sum += seconds

    def event_counts(self, rank: int) -> dict[str, int]:
        """Events ``rank`` published, by type."""
        return {kind: count for (r, kind), count in self.events.items() if r == rank}

    # -- HTTP endpoint -----------------------------------------------------------------------

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port``; returns the URL of the metrics page."""
        self._server = await asyncio.start_server(
            self._answer, host, port, limit=HTTP_LIMIT, backlog=HTTP_BACKLOG
        )
        bound = self._server.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}/metrics"
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer_host(writer)
        held = self._by_peer.get(peer, 0)
        # Each connection holds a file descriptor: a flood must not use them up; nor may one
        # host hold more than a quarter of them (it once held all, and /healthz, a liveness
        # probe, failed for everyone else).
        if self.connections >= self.max_connections or held >= max(1, self.max_connections // 4):
            self.connections_refused += 1
            writer.transport.abort()
            return
        self.connections += 1
        self._by_peer[peer] = held + 1
        try:
            head = await asyncio.wait_for(_read_head(reader), HTTP_TIMEOUT_S)
            if self._refresh is not None and _path_of(head) in METRICS_PATHS:
                await self._refresh()  # (not for /healthz: it reads no stats)
            status, content_type, body = self.page(head)
            method = head.split(b" ", 1)[0]
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if method != b"HEAD":
                writer.write(body)
            await asyncio.wait_for(writer.drain(), HTTP_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # an incomplete, oversized or idle request gets no answer
        except ConnectionError:
            pass
        except Exception:  # a bug: keep the daemon serving
            log.exception("metrics: a scrape failed")
        finally:
            self.connections -= 1
            left = self._by_peer.pop(peer) - 1
            if left:
                self._by_peer[peer] = left
            writer.transport.abort()  # nothing is left to send: free the fd now

    def page(self, head: bytes) -> tuple[str, str, bytes]:
        """(status, content type, body) for one request's line and headers."""
        lines = head.decode("latin-1").split("\r\n")  # as _read_head joins them
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", "text/plain", b"bad request line\n"
        if parts[0] not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET and HEAD\n"
        path = _path_of(head)
        if path == "/healthz":
            problem = self._health()
            if problem is None:
                return "200 OK", "text/plain", b"ok\n"
            return "503 Service Unavailable", "text/plain", f"{problem}\n".encode()
        if path not in METRICS_PATHS:
            return "404 Not Found", "text/plain", b"metrics are at /metrics, health at /healthz\n"
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        try:
            encoder, content_type = choose_encoder(accept)
        except (TypeError, ValueError):  # e.g. "version=abc": prometheus-client cannot parse it
            encoder, content_type = choose_encoder("")  # the plain text format, as for no Accept
        return "200 OK", content_type, encoder(self.registry)


class _StateCollector(Collector):
    """Reads the daemon's state at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self.metrics
        ranks = [r.stats() for r in metrics._ranks()]

        info = GaugeMetricFamily(
            "kvpubd_build_info", "Always 1; the daemon's version.", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info
        cumulative, buckets = 0, []
        for bound, count in zip([*RESET_BUCKETS, float("inf")], metrics.reset_counts, strict=True):
            cumulative += count
            # prometheus_client leaves floatToGoString unannotated.
            buckets.append((floatToGoString(bound), cumulative))  # type: ignore[no-untyped-call]
        yield HistogramMetricFamily(
            "kvpubd_reset_duration_seconds",
            "Time the reset handler took, from the request to the marker handed to ZeroMQ.",
            buckets=buckets,
            sum_value=metrics.reset_sum,
        )
        yield GaugeMetricFamily(
            "kvpubd_paused",
            "1 while the periodic drain is paused.",
            value=int(metrics._paused()),
        )

        events = CounterMetricFamily(
            "kvpubd_events_published",
            "Events published, by rank and type (the startup and reset markers included).",
            labels=["rank", "type"],
        )
        for stats in ranks:
            for kind in dict.fromkeys(EVENT_TYPES.values()):  # each name once
                events.add_metric([str(stats.rank), kind], stats.events_by_type.get(kind, 0))
        yield events

        # Named after the stats keys: kvpubd_<key>, counters with _total.
        for key, help_text in (
            ("batches_published", "Batches published (one seq each)."),
            (
                "dropped_stored_blocks",
                "Stored blocks not published: over the per-tick cap, or under a dropped parent.",
            ),
            ("resets", "Resets of the rank's cache."),
            ("replay_requests", "Replay requests answered."),
            ("replays_refused", "Replay requests refused: max_replays were streaming."),
            ("snapshot_requests", "Requests to the snapshot endpoint (vLLM's protocol)."),
            ("upstream_batches", "Engine batches taken (live or replayed) in upstream mode."),
            ("upstream_replayed", "Engine batches taken from its replay socket (a gap repaired)."),
            ("upstream_lost", "Engine batches lost for good (then AllBlocksCleared)."),
            ("upstream_restarts", "Engine restarts seen (then AllBlocksCleared)."),
            ("upstream_malformed", "Engine messages that did not decode (skipped)."),
            (
                "upstream_dropped_by_reset",
                "Engine events dropped after a reset, as from before its clear.",
            ),
            ("upstream_fences_timed_out", "Resets after which the engine did not clear in time."),
            (
                "upstream_duplicate_blocks",
                "Blocks the engine stored again while live (not repeated).",
            ),
            (
                "upstream_unknown_removals",
                "Blocks the engine removed that it never stored (not published).",
            ),
            (
                "upstream_skipped_blocks",
                "Engine blocks not kept: not dense, past max_blocks, or under a parent not live.",
            ),
            (
                "snapshots_unavailable",
                "Snapshot requests answered -2 (unavailable now): a failed build, or older "
                "snapshots still held by replies to clients that do not read.",
            ),
        ):
            yield _per_rank(CounterMetricFamily, key, help_text, ranks)

        for key, help_text in (
            ("first_seq", "Seq of the run's first batch: its origin, new at every start."),
            ("seq", "Seq of the last batch published (first_seq - 1 before the first)."),
            ("blocks_capacity", "Blocks in the pool."),
            ("blocks_used", "Blocks allocated (cached or pinned)."),
            ("blocks_pinned", "Blocks pinned by open requests."),
            ("blocks_free", "Blocks free for allocation."),
            ("blocks_cached", "Blocks in the prefix index."),
            ("blocks_published", "Blocks whose BlockStored was published and not removed."),
            ("requests_open", "Store requests not yet released."),
            ("events_pending", "Events captured, not yet published."),
            ("host_blocks_capacity", "Slots of the host tier (0: off)."),
            ("host_blocks_cached", "Blocks on the host tier."),
            ("host_blocks_held", "Host tier blocks a store under way will copy back."),
        ):
            yield _per_rank(GaugeMetricFamily, key, help_text, ranks)
        for key, help_text in (
            ("blocks_capacity", "Blocks in the group's pool (hybrid caches)."),
            ("blocks_free", "Blocks free for allocation in the group's pool."),
            ("blocks_cached", "Blocks in the group's index."),
            ("blocks_pinned", "The group's blocks pinned by open requests."),
            ("blocks_published", "The group's blocks whose BlockStored is published, not removed."),
        ):
            yield _per_group(key, help_text, ranks)

        requests = CounterMetricFamily(
            "kvpubd_control_requests",
            f"Control requests answered, by op ({INVALID_OP!r}: refused before the op was known).",
            labels=["op"],
        )
        for op, count in sorted(metrics.requests.items()):
            requests.add_metric([op], count)
        yield requests
        errors = CounterMetricFamily(
            "kvpubd_control_errors",
            "Control requests refused, by op and error code.",
            labels=["op", "code"],
        )
        for (op, code), count in sorted(metrics.errors.items()):
            errors.add_metric([op, code], count)
        yield errors
        yield CounterMetricFamily(
            "kvpubd_metrics_connections_refused",
            "Connections to this endpoint closed at once: max connections were open.",
            value=metrics.connections_refused,
        )


def _per_group(key: str, help_text: str, ranks: list[RankStats]) -> Metric:
    metric = GaugeMetricFamily(f"kvpubd_group_{key}", help_text, labels=["rank", "group"])
    for stats in ranks:
        for group in stats.groups:
            metric.add_metric([str(stats.rank), str(group.group_idx)], getattr(group, key))
    return metric


def _per_rank(
    family: type[CounterMetricFamily] | type[GaugeMetricFamily],
    key: str,
    help_text: str,
    ranks: list[RankStats],
) -> Metric:
    metric = family(f"kvpubd_{key}", help_text, labels=["rank"])
    for stats in ranks:
        metric.add_metric([str(stats.rank)], getattr(stats, key))
    return metric


METRICS_PATHS = ("/metrics", "/")


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """A request's line and headers, up to the empty line, each line's end taken as CRLF or a
    bare LF (RFC 9112 lets a server accept both; a probe written with printf sends LF, and got
    no answer), joined with CRLF. Bounded as one line is (LimitOverrunError past HTTP_LIMIT)."""
    lines: list[bytes] = []
    size = 0
    while True:
        line = await reader.readuntil(b"\n")
        size += len(line)
        if size > HTTP_LIMIT:
            raise asyncio.LimitOverrunError("request head too large", size)
        line = line.rstrip(b"\r\n")
        if not line:
            return b"\r\n".join(lines) + b"\r\n\r\n"
        lines.append(line)


def _path_of(head: bytes) -> str:
    """The path of a request's target ("" for a request line that has none); of an
    absolute-form target (``http://host/metrics``), its path."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3:
        return ""
    target = parts[1].split(b"?", 1)[0]
    if b"://" in target:
        target = b"/" + target.split(b"://", 1)[1].partition(b"/")[2]
    return target.decode("latin-1")
