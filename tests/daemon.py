"""Start the real daemon as a subprocess on private ipc endpoints, for tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpubd.client import ControlClient, ControlTimeout, Subscriber

START_TIMEOUT = 20.0


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> None:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        lines.append("")
    path.write_text("\n".join(lines))


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Daemon:
    """A running ``kvpubd serve`` with its own socket directory.

    ``overrides`` maps section -> key -> value on top of the test defaults."""

    def __init__(self, overrides: dict[str, dict[str, Any]] | None = None) -> None:
        # ipc paths are limited to ~107 bytes: keep the directory short.
        self.dir = Path(tempfile.mkdtemp(prefix="kvp", dir="/tmp"))
        self.events_endpoint = f"ipc://{self.dir}/events"
        self.replay_endpoint = f"ipc://{self.dir}/replay"
        self.control_endpoint = f"ipc://{self.dir}/control"
        sections: dict[str, dict[str, Any]] = {
            "events": {
                "endpoint": self.events_endpoint,
                "replay_endpoint": self.replay_endpoint,
            },
            "control": {"endpoint": self.control_endpoint},
            "cache": {"num_blocks": 256, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
            "service": {"log_level": "debug", "linger_ms": 2000},
        }
        for section, values in (overrides or {}).items():
            sections.setdefault(section, {}).update(values)
        self.settings = sections
        self.config_path = self.dir / "kvpubd.toml"
        write_config(self.config_path, sections)
        self.log_path = self.dir / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def ranks(self) -> int:
        return int(self.settings["cache"].get("data_parallel_size", 1))

    def start(self) -> Daemon:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the daemon
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpubd", "serve", "--config", str(self.config_path)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + START_TIMEOUT
        with self.client(timeout=0.2) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    self.epoch = client.ping()["epoch"]
                    return self
                except ControlTimeout:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"daemon did not answer:\n{self.log()}") from None

    def client(self, timeout: float = 5.0) -> ControlClient:
        return ControlClient(self.control_endpoint, timeout=timeout)

    def subscriber(self, **kwargs: Any) -> Subscriber:
        kwargs.setdefault("ranks", self.ranks)
        return Subscriber(self.events_endpoint, self.replay_endpoint, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal the daemon and wait; returns its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon ignored signal {sig}:\n{self.log()}") from None
        self._log.close()
        return self.proc.returncode

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
