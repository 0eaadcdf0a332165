"""One rank of a service of rank processes: ``python -m kvpubd.daemon.rank_worker``, started
by the service (rank_processes), never by hand.

A worker is a one-rank daemon (the same ``Service``): it owns the rank's cache, pool, event
sink, publisher, replay and snapshot endpoints, and takes control requests from its service
over a private ipc endpoint. It talks to the service over two pipes as well:

- stdin, from the service: one JSON line with what to run (``WorkerSpec``), then lines of
  ``ping N`` (answered ``pong N`` from the loop: the service's watchdog of a hung worker) and
  ``level LEVEL`` (SIGHUP's log level). End of file: the service is gone, and so the worker
  stops (publishing what its rank captured, as on SIGTERM).
- stdout, to the service: ``ready`` once every socket is bound and the startup marker is
  published, then the pongs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import Any

import msgspec

from kvpubd.daemon import logs
from kvpubd.daemon.service import Service, StartupError, TaskFailed, WorkerRole
from kvpubd.daemon.settings import Settings

log = logging.getLogger("kvpubd")

READY = b"ready\n"
# Bytes of one line from the service, at most (the spec carries the whole configuration).
MAX_LINE_BYTES = 1 << 20
# What queued events get when the service is gone (killed outright): its endpoints are let go
# of at once, for the service started again.
ORPHANED_LINGER_MS = 100


class WorkerSpec(msgspec.Struct, frozen=True):
    """What the service tells a worker to run: the service's settings (as a dict, with the
    service's own control endpoint: pool segments and seq state are named after it), the rank,
    the private endpoint its control requests come in on, and the service's epoch."""

    settings: dict[str, Any]
    rank: int
    control_endpoint: str
    epoch: int
    count_events: bool = False


def worker_settings(service_settings: Settings, rank: int) -> Settings:
    """The settings of ``rank``'s worker: that rank alone, no metrics endpoint (the service
    serves one for all ranks), no CURVE and no orphan release (the service does both for its
    clients; the worker's only client is the service)."""
    cache = service_settings.cache.model_copy(
        update={"data_parallel_start_rank": rank, "data_parallel_size": 1}
    )
    control = service_settings.control.model_copy(
        update={"curve_secret_key": "", "curve_authorized_keys": "", "release_orphans": False}
    )
    metrics = service_settings.metrics.model_copy(update={"port": 0})
    service = service_settings.service.model_copy(update={"rank_processes": "off"})
    return service_settings.model_copy(
        update={"cache": cache, "control": control, "metrics": metrics, "service": service}
    )


class ServiceLink:
    """The worker's end of its pipes to the service (see the module's docstring)."""

    def __init__(self, service: Service, pending: bytes = b"", stdin: int = 0, stdout: int = 1):
        """``pending``: what was read from stdin after the spec's line."""
        self._service = service
        self._stdin = stdin
        self._stdout = stdout
        self._buffer = pending

    def start(self) -> None:
        os.set_blocking(self._stdin, False)
        # A pong must never block the loop (the service reads them as they come anyway).
        os.set_blocking(self._stdout, False)
        loop = asyncio.get_running_loop()
        loop.add_reader(self._stdin, self._read)
        if self._buffer:
            loop.call_soon(self._lines, b"")

    def stop(self) -> None:
        asyncio.get_running_loop().remove_reader(self._stdin)

    def say(self, line: bytes) -> None:
        # The service gone: stdin's end of file stops the worker.
        with contextlib.suppress(OSError):
            os.write(self._stdout, line)

    def _read(self) -> None:
        try:
            chunk = os.read(self._stdin, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            log.warning("the service is gone; stopping")
            self.stop()
            # Its endpoints let go of at once: a service started again right away (systemd's
            # Restart=) found them held for the whole linger, and exited 1.
            self._service.request_exit(linger_ms=ORPHANED_LINGER_MS)
            return
        self._lines(chunk)

    def _lines(self, chunk: bytes) -> None:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > MAX_LINE_BYTES:
            self._buffer = b""
        for line in lines:
            self._command(line.decode(errors="replace"))

    def _command(self, line: str) -> None:
        word, _, argument = line.partition(" ")
        if word == "ping":
            self.say(f"pong {argument}\n".encode())
        elif word == "level":
            logs.set_level(argument)
            log.info("SIGHUP: log level %s", argument)
        elif line:
            log.warning("unknown line from the service: %.80r", line)


def read_spec(stdin: int = 0) -> tuple[bytes, bytes]:
    """The spec's line from stdin, and what followed it (read with it)."""
    data = b""
    while b"\n" not in data:
        chunk = os.read(stdin, 65536)
        if not chunk or len(data) > MAX_LINE_BYTES:
            break
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


async def run_worker(spec: WorkerSpec, settings: Settings, pending: bytes) -> None:
    role = WorkerRole(spec.control_endpoint, spec.epoch, spec.count_events)
    service = Service(settings, worker=role)
    link = ServiceLink(service, pending)
    link.start()

    def started() -> None:
        if service.ready:
            link.say(READY)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, service.request_exit)
    # The service forwards SIGHUP's log level over stdin: a signal here changes nothing.
    loop.add_signal_handler(signal.SIGHUP, lambda: None)
    try:
        await service.lifetime(started)
    finally:
        link.stop()


def main() -> None:
    line, pending = read_spec()
    try:
        spec = msgspec.json.decode(line, type=WorkerSpec)
        settings = worker_settings(Settings.model_validate(spec.settings), spec.rank)
    except (msgspec.DecodeError, ValueError) as exc:
        sys.stderr.write(f"kvpubd rank worker: unusable spec on stdin: {exc}\n")
        raise SystemExit(2) from None
    logs.configure(settings.service.log_level, tag=f"kvpubd rank {spec.rank}")
    work = run_worker(spec, settings, pending)
    try:
        if settings.service.loop == "uvloop":
            import uvloop

            uvloop.run(work)
        else:
            asyncio.run(work)
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        raise SystemExit(1) from None
    except TaskFailed as exc:
        log.error("stopped: %s", exc)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()


__all__ = ["READY", "ServiceLink", "WorkerSpec", "main", "worker_settings"]
