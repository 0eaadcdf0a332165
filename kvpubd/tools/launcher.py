"""Start ``kvpubd serve`` as a child process with its own config and sockets (benchmarks,
demos and tests use it; each daemon gets a private directory)."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import zmq

from kvpubd.client import ControlClient, ControlTimeout, Subscriber
from kvpubd.interrupts import interrupts_deferred, interrupts_ignored
from kvpubd.protocol.endpoints import missing_ipc_socket

PORT_CLASH_RETRIES = 3
ADDRESS_IN_USE = "Address already in use"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Loaded here, not in the forked child (which must only call it).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def dies_with_this_process(also: Callable[[], None] | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies, however it
    dies (SIGKILL included), so no child daemon outlives its tool. The kernel ties it to the
    *thread* that forks, so it is set only when the main thread starts the child (the main
    thread lives as long as the process); from other threads only ``also`` runs."""
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return also
    parent = os.getpid()
    prctl = _prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal
            os.kill(os.getpid(), signal.SIGTERM)
        if also is not None:
            also()

    return preexec


def run_tied(parent: int, target: Callable[..., None], *args: Any) -> None:
    """A spawned child's entry point: it gets SIGTERM when ``parent`` (the tool) dies, however
    it dies, then runs ``target(*args)``. A child waiting on a daemon or a pipe that will never
    answer (a tool killed with SIGKILL) ran on for good. Start it from the main thread (the
    kernel ties the signal to the thread that forks)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would signal
            os.kill(os.getpid(), signal.SIGTERM)
    target(*args)


def tied(target: Callable[..., None], args: tuple[Any, ...]) -> dict[str, Any]:
    """``Process(**tied(target, args), ...)``: ``target(*args)`` in a child that dies with this
    process (run_tied)."""
    return {"target": run_tied, "args": (os.getpid(), target, *args)}


def live_subscriber(
    endpoint: str, poll_ms: int = 20
) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    """A context and a SUB socket that keeps everything (RCVHWM 0) from ``endpoint``, returned
    once the first message is waiting (the caller publishes until then)."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not sub.poll(poll_ms):
        pass
    return ctx, sub


def free_tcp_ports(count: int) -> list[int]:
    """Ports the OS reports free now (a later bind can still race; fine for local tools)."""
    return free_tcp_port_runs([1] * count)


def free_tcp_port_runs(widths: list[int], attempts: int = 200) -> list[int]:
    """One base port per width such that base .. base + width - 1 are all free now and no two
    runs overlap (a daemon's ranks bind consecutive ports). Every port is held bound until all
    runs are found, so the runs cannot collide with each other; a later bind can still race
    with another process, which ``DaemonProcess.start`` answers with fresh ports."""
    held: list[socket.socket] = []
    bases: list[int] = []

    def hold(port: int) -> bool:
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            return False
        held.append(sock)
        return True

    try:
        for width in widths:
            for _ in range(attempts):
                first = socket.socket()
                first.bind(("127.0.0.1", 0))
                base = first.getsockname()[1]
                held.append(first)
                if base + width - 1 <= 65535 and all(
                    hold(port) for port in range(base + 1, base + width)
                ):
                    bases.append(base)
                    break
            else:
                raise OSError(f"no run of {width} free loopback ports after {attempts} tries")
        return bases
    finally:
        for sock in held:
            sock.close()


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    if isinstance(value, dict):  # an inline table (e.g. one of cache.groups)
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return repr(value)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> None:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        lines.append("")
    path.write_text("\n".join(lines))


DaemonT = TypeVar("DaemonT", bound="DaemonProcess")


class DaemonProcess:
    """A ``kvpubd serve`` child. ``transport`` "ipc" puts every socket in a private directory;
    "tcp" uses free loopback ports. ``overrides`` maps section -> key -> value;
    ``events.snapshot_endpoint = True`` picks a private snapshot endpoint as for the others."""

    def __init__(
        self,
        overrides: dict[str, dict[str, Any]] | None = None,
        transport: str = "ipc",
        curve: tuple[Path, Path] | None = None,
    ) -> None:
        # (client secret certificate, daemon public certificate) when CURVE is on.
        self.curve = curve
        # ipc paths are limited to ~107 bytes: keep the directory short.
        self.dir = Path(tempfile.mkdtemp(prefix="kvp", dir="/tmp"))
        self.transport = transport
        sections: dict[str, dict[str, Any]] = {
            "events": {},
            "control": {},
            "cache": {},
            "service": {},
        }
        for section, values in (overrides or {}).items():
            sections.setdefault(section, {}).update(values)
        # Seq state beside the sockets: private to this daemon, and kept across its restarts.
        sections["events"].setdefault("seq_state_dir", str(self.dir))
        # Endpoints the caller chose stay; the others are picked (and re-picked on a clash).
        self._chosen = {
            (section, key)
            for section, values in sections.items()
            for key in values
            if key in ("endpoint", "replay_endpoint")
            or (key == "snapshot_endpoint" and values[key] is not True)
        }
        self._snapshots = sections["events"].get("snapshot_endpoint") is True
        self.settings = sections
        self.config_path = self.dir / "kvpubd.toml"
        self._pick_endpoints()
        self.log_path = self.dir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.epoch: int | None = None
        self._log: IO[bytes] | None = None

    @property
    def ranks(self) -> int:
        return int(self.settings["cache"].get("data_parallel_size", 1))

    @property
    def served(self) -> list[int]:
        """The ranks served, from ``cache.data_parallel_start_rank``."""
        start = int(self.settings["cache"].get("data_parallel_start_rank", 0))
        return list(range(start, start + self.ranks))

    def _pick_endpoints(self) -> None:
        """Private endpoints (fresh free ports for tcp: one run of ``ranks`` ports each for
        events and replay), written into the config file."""
        if self.transport == "tcp":
            events, replay, control, snapshot = free_tcp_port_runs(
                [self.ranks, self.ranks, 1, self.ranks]
            )
            # Each rank binds the base port plus its rank: the run starts at the first rank's.
            first = self.served[0]
            picked = {
                ("events", "endpoint"): f"tcp://127.0.0.1:{events - first}",
                ("events", "replay_endpoint"): f"tcp://127.0.0.1:{replay - first}",
                ("control", "endpoint"): f"tcp://127.0.0.1:{control}",
                ("events", "snapshot_endpoint"): f"tcp://127.0.0.1:{snapshot - first}",
            }
        else:
            picked = {
                ("events", "endpoint"): f"ipc://{self.dir}/events",
                ("events", "replay_endpoint"): f"ipc://{self.dir}/replay",
                ("control", "endpoint"): f"ipc://{self.dir}/control",
                ("events", "snapshot_endpoint"): f"ipc://{self.dir}/snapshot",
            }
        if not self._snapshots:
            picked.pop(("events", "snapshot_endpoint"))
        for (section, key), endpoint in picked.items():
            if (section, key) not in self._chosen:
                self.settings[section][key] = endpoint
        self.events_endpoint = self.settings["events"]["endpoint"]
        self.replay_endpoint = self.settings["events"]["replay_endpoint"]
        self.control_endpoint = self.settings["control"]["endpoint"]
        self.snapshot_endpoint: str = self.settings["events"].get("snapshot_endpoint", "")
        write_config(self.config_path, self.settings)

    def start(
        self: DaemonT, timeout: float = 20.0, preexec_fn: Callable[[], None] | None = None
    ) -> DaemonT:
        """Start the child and wait until it answers ping; ``preexec_fn`` runs in the child
        before it executes (e.g. to set resource limits). On a first start over tcp, a port
        that another process took since it was picked gets fresh ports and another try (a
        restart keeps its ports: consumers are connected to them)."""
        for attempt in range(PORT_CLASH_RETRIES + 1):
            try:
                return self._start_once(timeout, preexec_fn)
            except RuntimeError as error:
                clash = ADDRESS_IN_USE in str(error) and self.epoch is None
                if not clash or self.transport != "tcp" or attempt == PORT_CLASH_RETRIES:
                    raise
                self._pick_endpoints()
        raise AssertionError("unreachable")

    def _start_once(
        self: DaemonT, timeout: float, preexec_fn: Callable[[], None] | None
    ) -> DaemonT:
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the daemon
        with interrupts_deferred():  # until self.proc holds the child, so that it can be stopped
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvpubd", "serve", "--config", str(self.config_path)],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=dies_with_this_process(preexec_fn),
            )
        deadline = time.monotonic() + timeout
        with self.client(timeout=0.2) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    self.epoch = client.ping().epoch
                    return self
                except ControlTimeout:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"daemon did not answer:\n{self.log()}") from None
                    if missing_ipc_socket(self.control_endpoint):
                        time.sleep(0.01)  # not bound yet: the ping failed at once, poll gently

    def client(self, timeout: float = 5.0) -> ControlClient:
        return ControlClient(self.control_endpoint, timeout=timeout, curve=self.curve)

    def subscriber(self, **kwargs: Any) -> Subscriber:
        kwargs.setdefault("ranks", self.served)
        return Subscriber(self.events_endpoint, self.replay_endpoint, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the child and wait; returns its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"daemon ignored signal {sig}:\n{self.log()}") from None
        if self._log is not None:
            self._log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> DaemonProcess:
        try:
            return self.start()
        except BaseException:  # Ctrl-C or SIGTERM while it starts: __exit__ would not run
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        # A second Ctrl-C must not leave the daemon, its shm segment or its directory behind.
        with interrupts_ignored():
            try:
                if self.alive():
                    self.stop()
            finally:
                self.cleanup()
