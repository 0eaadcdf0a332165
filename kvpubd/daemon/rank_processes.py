"""The rank worker processes of a service: starting one, knowing when it is ready, pinging its
loop, stopping it, and noticing at once when it dies.

A worker's stdin and stdout are pipes to the service (see rank_worker): the spec goes in, then
pings and log levels; ``ready`` and pongs come out. Its stdout closing is how the service
learns of its death, whatever killed it; its stdin closing is how a worker learns of the
service's. Workers run in sessions of their own: a Ctrl-C on the terminal reaches the service,
which stops them in order (each publishes what its rank captured first)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping

import msgspec

from kvpubd.daemon.rank_worker import READY, WorkerSpec

log = logging.getLogger("kvpubd")

# Environment a worker does not inherit: systemd's notify and watchdog belong to the service
# (a worker that sent READY=1 would confuse systemd), and the service passes the settings
# whole, so KVPUBD_* variables (already applied) are not read twice.
_NOT_INHERITED = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")


def worker_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    return {
        key: value
        for key, value in environ.items()
        if key not in _NOT_INHERITED and not key.startswith("KVPUBD_")
    }


class WorkerFailed(RuntimeError):
    """A worker could not start (its exit status and log say why)."""


class RankProcess:
    """One worker. ``on_exit(returncode)`` is called once its process ended, unless the
    service stopped it."""

    def __init__(self, spec: WorkerSpec, on_exit: Callable[[int], None]) -> None:
        self.spec = spec
        self.rank = spec.rank
        self._on_exit = on_exit
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._stopping = False
        self.last_pong = time.monotonic()
        self._pings = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self, timeout_s: float) -> None:
        """Start the worker and wait until it is ready; WorkerFailed if it exits first or
        takes longer than ``timeout_s``."""
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvpubd.daemon.rank_worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=worker_environment(),
            start_new_session=True,
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(msgspec.json.encode(self.spec) + b"\n")
        self._watch = asyncio.create_task(self._read_stdout(), name=f"kvpubd rank {self.rank}")
        ready = asyncio.create_task(self._ready.wait())
        try:
            await asyncio.wait(
                {ready, self._watch}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ready.cancel()
        if not self._ready.is_set():
            if self.running:
                self.kill()
                await self._proc.wait()
                raise WorkerFailed(f"rank {self.rank}: not ready within {timeout_s:g} s")
            raise WorkerFailed(
                f"rank {self.rank}: the worker exited with status {self._proc.returncode} "
                "before it was ready (its log says why)"
            )
        self.last_pong = time.monotonic()

    async def _read_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        stdout = self._proc.stdout
        while True:
            try:
                line = await stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):  # a line too long: not ours
                continue
            if not line:
                break
            if line == READY:
                self._ready.set()
            elif line.startswith(b"pong "):
                self.last_pong = time.monotonic()
        returncode = await self._proc.wait()
        if not self._stopping and self._ready.is_set():
            self._on_exit(returncode)

    def say(self, line: str) -> None:
        """A line to the worker (a ping, a log level); lost if it is gone."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            return
        with contextlib.suppress(ConnectionError, OSError):
            proc.stdin.write(line.encode() + b"\n")

    def ping(self) -> None:
        self._pings += 1
        self.say(f"ping {self._pings}")

    def abandon(self) -> None:
        """Kill a worker given up on: its exit is not reported (the caller handles it)."""
        self._stopping = True
        self.kill()

    def kill(self) -> None:
        if self.running:
            assert self._proc is not None
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the worker publishes what its rank captured, then exits), SIGKILL after
        ``timeout_s``; its exit status (None if it never started)."""
        self._stopping = True
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.error(
                    "rank %d: the worker did not stop within %g s; killed", self.rank, timeout_s
                )
                self.kill()
                await proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        return proc.returncode
