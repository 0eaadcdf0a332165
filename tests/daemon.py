"""The real daemon as a subprocess for tests, with small test defaults."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvpubd.tools.launcher import DaemonProcess, toml_value, write_config

__all__ = ["Daemon", "toml_value", "wait_for", "write_config"]

TEST_DEFAULTS: dict[str, dict[str, Any]] = {
    "cache": {"num_blocks": 256, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
    "service": {"log_level": "debug", "linger_ms": 2000},
    # Tests count batches exactly; the heartbeat tests turn it on.
    "events": {"heartbeat_ms": 0},
}


T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T | None], timeout: float = 10.0, what: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns something truthy (so never None), or fail after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Daemon(DaemonProcess):
    """A ``kvpubd serve`` child on private ipc endpoints (or loopback tcp ports, for consumers
    that speak only tcp); ``overrides`` beat TEST_DEFAULTS."""

    def __init__(
        self,
        overrides: dict[str, dict[str, Any]] | None = None,
        curve: tuple[Path, Path] | None = None,
        transport: str = "ipc",
    ) -> None:
        merged = {section: dict(values) for section, values in TEST_DEFAULTS.items()}
        for section, values in (overrides or {}).items():
            merged.setdefault(section, {}).update(values)
        super().__init__(merged, transport=transport, curve=curve)

    def first_seq(self, rank: int = 0) -> int:
        """The seq of the rank's first batch in this run (its start-up marker)."""
        with self.client() as client:
            return int(client.stats().ranks[rank].first_seq)
