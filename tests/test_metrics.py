"""The Prometheus endpoint: scraped over real HTTP while a real daemon runs a shared-prefix load,
its counters equal what a subscriber received; per-daemon registries; bad HTTP input."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import msgpack
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpubd.client import ControlError
from kvpubd.daemon.service import Service
from kvpubd.daemon.settings import Settings
from kvpubd.tools.launcher import free_tcp_ports, write_config
from kvpubd.tools.loadgen import DEFAULT_MIX, LoadGenerator, Workload, parse_mix
from tests.daemon import Daemon, wait_for
from tests.streams import Tap

StartDaemon = Callable[..., Daemon]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, accept: str | None = None) -> tuple[str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def samples(text: str) -> Samples:
    """Every sample of an exposition, parsed by prometheus-client's own parser."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def counters(found: Samples) -> Samples:
    return {key: v for key, v in found.items() if key[0].endswith("_total")}


def start_with_metrics(start_daemon: StartDaemon) -> tuple[Daemon, str]:
    port = free_tcp_ports(1)[0]
    daemon = start_daemon(metrics={"port": port})
    return daemon, f"http://127.0.0.1:{port}/metrics"


def test_scrapes_during_load_match_what_a_subscriber_saw(start_daemon: StartDaemon) -> None:
    daemon, url = start_with_metrics(start_daemon)
    with daemon.client() as client, daemon.subscriber() as sub:
        tap = Tap(sub)
        tap.go_live(client)
        before = samples(scrape(url)[1])

        stop = threading.Event()
        results = {}

        def load() -> None:
            with daemon.client() as load_client:
                generator = LoadGenerator(
                    load_client, Workload(parse_mix(DEFAULT_MIX), seed=3), rate=300, hold=0.05
                )
                results["stats"] = generator.run(60, stop.is_set)

        thread = threading.Thread(target=load)
        thread.start()
        try:
            during: list[Samples] = []
            reset_at = 3
            while len(during) < 6:
                # Scrape once more events were published: the load is running.
                seen = len(tap.history)

                def loaded(seen: int = seen) -> bool:
                    return len(tap.history) > seen + 5

                tap.until(loaded, what="load's batches")
                assert thread.is_alive()
                during.append(samples(scrape(url)[1]))
                if len(during) == reset_at:
                    client.reset(force=True)
        finally:
            stop.set()
            thread.join()
        load_stats = results["stats"]
        assert load_stats.requests > 0

        # Refused requests, each of a different kind.
        client._send_raw([b"\xc1"])  # not msgpack
        assert cast(dict[str, Any], client._recv_raw())["error"]["code"] == "bad_request"
        with pytest.raises(ControlError, match="unknown_op"):
            client._call("frobnicate")
        with pytest.raises(ControlError, match="bad_request"):
            client.store("bad-rank", [1] * 16, rank=7)
        # A snapshot publishes whatever is still captured; nothing publishes after it.
        tap.through({0: client.snapshot(0).seq})
        stats = client.stats().ranks[0]
        after = samples(scrape(url)[1])

    # Counters never go down between scrapes.
    for earlier, later in zip([before, *during], [*during, after], strict=True):
        for metric, count in counters(earlier).items():
            assert later.get(metric, 0.0) >= count, metric

    # What the subscriber received: every seq of the run, once.
    history = tap.history
    first = stats.first_seq
    assert [b.seq for b in history] == list(range(first, first + len(history)))
    by_type = Counter(type(e).__name__ for b in history for e in b.batch.events)
    for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        assert value(after, "kvpubd_events_published_total", rank="0", type=kind) == by_type[kind]
    assert by_type["AllBlocksCleared"] == 2  # the start and the reset
    assert value(after, "kvpubd_batches_published_total", rank="0") == len(history)
    assert value(after, "kvpubd_seq", rank="0") == history[-1].seq == stats.seq
    assert value(after, "kvpubd_resets_total", rank="0") == 1
    assert value(after, "kvpubd_reset_duration_seconds_count") == 1
    assert (
        value(after, "kvpubd_dropped_stored_blocks_total", rank="0") == stats.dropped_stored_blocks
    )
    assert value(after, "kvpubd_replay_requests_total", rank="0") == stats.replay_requests >= 1
    # Every number `stats` reports is exported under its own name: kvpubd_<key> (a gauge) or
    # kvpubd_<key>_total (a counter); events_published is split by type.
    for key, number in msgspec.structs.asdict(stats).items():
        if key == "rank" or not isinstance(number, int):
            continue
        if key == "events_published":
            exported = sum(
                value(after, "kvpubd_events_published_total", rank="0", type=kind)
                for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
            )
        else:
            names = (f"kvpubd_{key}", f"kvpubd_{key}_total")
            rank0 = frozenset({("rank", "0")})
            found = [v for (name, labels), v in after.items() if name in names and labels == rank0]
            assert len(found) == 1, f"stats key {key}: no metric of its name"
            exported = found[0]
        assert exported == number, key
    assert value(after, "kvpubd_blocks_used", rank="0") > 0
    assert "kvpubd_build_info" in {name for name, _ in after}
    # The reset histogram comes without a `_created` series (which the text format shows as a
    # gauge of its own).
    assert not [name for name, _ in after if name.endswith("_created")]

    # Control requests since the first scrape: the load's, the reset, the refused three (and
    # the snapshot and stats of the test itself).
    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("kvpubd_control_requests_total", op="store") == load_stats.sent["store"] + 1
    assert delta("kvpubd_control_requests_total", op="release") == load_stats.sent["release"]
    assert delta("kvpubd_control_requests_total", op="reset") == 1
    assert delta("kvpubd_control_requests_total", op="invalid") == 2
    assert delta("kvpubd_control_errors_total", op="invalid", code="bad_request") == 1
    assert delta("kvpubd_control_errors_total", op="invalid", code="unknown_op") == 1
    assert delta("kvpubd_control_errors_total", op="store", code="bad_request") == 1
    for (op, code), count in load_stats.failed.items():  # pool_exhausted, unknown_request
        assert delta("kvpubd_control_errors_total", op=op, code=code) == count


def test_http_edges(start_daemon: StartDaemon) -> None:
    """Only GET/HEAD of /metrics; OpenMetrics on request; an oversized request is dropped."""
    _, url = start_with_metrics(start_daemon)
    content_type, text = scrape(url)
    assert content_type.startswith("text/plain")
    assert "kvpubd_build_info" in text
    content_type, text = scrape(url, accept="application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")
    # A version prometheus-client cannot parse got no answer and a logged traceback.
    for accept in ("application/openmetrics-text; version=abc", "text/plain; version=x.y"):
        content_type, text = scrape(url, accept=accept)
        assert content_type.startswith("text/plain") and "kvpubd_build_info" in text

    with urllib.request.urlopen(url.replace("/metrics", "/healthz"), timeout=10) as health:
        assert health.status == 200 and health.read() == b"ok\n"

    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(url.replace("/metrics", "/nope"), timeout=10)
    assert missing.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as post:
        urllib.request.urlopen(urllib.request.Request(url, data=b"x"), timeout=10)
    assert post.value.code == 405
    with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10) as head:
        assert head.status == 200 and int(head.headers["Content-Length"]) > 0
        assert head.read() == b""

    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        assert sock.recv(4096) == b""  # closed without an answer
    assert "kvpubd_build_info" in scrape(url)[1]  # and the daemon still serves

    # Lines ended by a bare LF (a probe written with printf: no answer before) and an
    # absolute-form target (404 before): both are HTTP a server may take.
    for request, answer in (
        (b"GET /healthz HTTP/1.0\n\n", b"ok\n"),
        (b"GET http://127.0.0.1/healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"ok\n"),
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request)
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(answer), (request, reply)


async def test_daemons_in_one_process_keep_their_own_metrics(tmp_path: Path) -> None:
    """Two Services on one loop: each registry reports only its own daemon."""
    ports = free_tcp_ports(2)
    services = []
    for name, port in zip("ab", ports, strict=True):
        settings = Settings(
            events={"endpoint": f"ipc://{tmp_path}/{name}-ev", "replay_endpoint": ""},
            control={"endpoint": f"ipc://{tmp_path}/{name}-ctl"},
            cache={"num_blocks": 16, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
            metrics={"port": port},
        )
        services.append(Service(settings))
    try:
        for service in services:
            await service.startup()
        store = {"op": "store", "id": 1, "request_id": "r", "token_ids": list(range(48))}
        assert services[0].control is not None
        reply = services[0].control.handle_frames([b"peer", b"", msgpack.packb(store)])
        assert reply is not None and msgpack.unpackb(reply)["ok"]
        services[0].pipelines[0].flush()
        found = [
            samples((await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics"))[1])
            for port in ports
        ]
    finally:
        for service in services:
            await service.shutdown()
    stored = [
        value(f, "kvpubd_events_published_total", rank="0", type="BlockStored") for f in found
    ]
    assert stored == [1, 0]
    assert [value(f, "kvpubd_control_requests_total", op="store") for f in found] == [1, 0]
    assert [value(f, "kvpubd_blocks_pinned", rank="0") for f in found] == [3, 0]


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpubd", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.process
def test_metrics_port_in_use_exits_1_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "c.toml"
        write_config(
            config,
            {
                "events": {"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
                "control": {"endpoint": f"ipc://{tmp_path}/ctl"},
                "metrics": {"port": port},
            },
        )
        result = serve(config)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvpubd: cannot start: metrics endpoint 127.0.0.1:{port}:"), last
    assert not (tmp_path / "ctl").exists()  # nothing left behind


@pytest.mark.process
def test_metrics_port_inside_the_event_ports_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    write_config(
        config,
        {
            "events": {"endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6100"},
            "cache": {"data_parallel_size": 4},
            "metrics": {"port": 6002},
        },
    )
    result = serve(config)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "kvpubd: config error: metrics.port: ports 6002..6002 overlap events.endpoint "
        "ports 6000..6003"
    )


@pytest.mark.daemon_process
def test_metrics_are_off_by_default(daemon: Daemon) -> None:
    assert Settings().metrics.port == 0
    wait_for(lambda: "ready:" in daemon.log(), what="the ready line")
    assert "metrics on" not in daemon.log()


async def test_healthz_fails_when_the_drain_loop_is_gone(tmp_path: Path) -> None:
    port = free_tcp_ports(1)[0]
    settings = Settings(
        events={"endpoint": f"ipc://{tmp_path}/ev", "replay_endpoint": ""},
        control={"endpoint": f"ipc://{tmp_path}/ctl"},
        cache={"num_blocks": 16, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
        metrics={"port": port},
    )
    service = Service(settings)
    url = f"http://127.0.0.1:{port}/healthz"

    def status() -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    try:
        await service.startup()
        assert await asyncio.to_thread(status) == (200, b"ok\n")
        for task in service._tasks:
            if task.get_name() == "kvpubd drain loop":
                task.cancel()
        await asyncio.sleep(0)
        assert await asyncio.to_thread(status) == (503, b"the drain loop is not running\n")
    finally:
        await service.shutdown()
