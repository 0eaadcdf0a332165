"""What ``kvpubd serve`` runs with, resolved once: the TOML file, vLLM's ``--kv-events-config``,
the KVPUBD_* variables and ``--log-level``, checked against this machine (the pool's device,
the CURVE files). Every problem is one ConfigError naming the key; nothing starts before all
of it is known to be usable."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvpubd import __version__
from kvpubd.daemon.curve import check_curve_settings
from kvpubd.daemon.pool import check_device
from kvpubd.daemon.settings import (
    ConfigError,
    Settings,
    env_overrides,
    load_settings,
    log_level_option,
    unknown_env,
)
from kvpubd.daemon.transports import check_transport
from kvpubd.daemon.vllm_config import KvEventsMapping, load_kv_events_config


@dataclass(frozen=True)
class ServeConfig:
    path: Path | None
    # --log-level: wins over service.log_level, also on reload.
    log_level: str | None
    kv_events: KvEventsMapping | None
    # The resolved settings (--log-level applied).
    settings: Settings

    def load(self) -> Settings:
        """The settings as the sources say now (SIGHUP); raises ConfigError."""
        return _settings(self.path, self.log_level, self.kv_events)

    def start_lines(self) -> list[str]:
        """Logged once the daemon holds its endpoint: where the settings came from."""
        overrides = env_overrides(os.environ)
        lines = [
            f"kvpubd {__version__}: config {self.path if self.path else '(defaults)'}"
            + (f", overridden by {', '.join(overrides)}" if overrides else "")
        ]
        if self.kv_events is not None:
            lines.append(self.kv_events.describe())
        return lines

    def warnings(self) -> list[str]:
        """KVPUBD_* variables nobody reads (typos)."""
        return unknown_env(os.environ)


def _settings(
    path: Path | None, log_level: str | None, kv_events: KvEventsMapping | None
) -> Settings:
    settings = load_settings(path, {"events": kv_events.events} if kv_events else None)
    if log_level is None:
        return settings
    service = settings.service.model_copy(update={"log_level": log_level})
    return settings.model_copy(update={"service": service})


def resolve(
    path: Path | None,
    *,
    log_level: str | None = None,
    kv_events_config: str | None = None,
) -> ServeConfig:
    """Read and check everything ``serve`` needs (KVPUBD_* from this process's environment);
    raises ConfigError (one line)."""
    level = log_level_option(log_level) if log_level is not None else None
    kv_events = load_kv_events_config(kv_events_config) if kv_events_config else None
    if kv_events is not None and "publisher" in kv_events.events:
        try:
            check_transport(kv_events.events["publisher"])
        except ConfigError as exc:
            raise ConfigError(f"kv-events-config: {exc}") from None
    settings = _settings(path, level, kv_events)
    check_transport(settings.events.publisher)
    try:
        check_device(settings.cache.device)
    except ValueError as exc:
        raise ConfigError(f"cache.device: {exc}") from None
    for device in settings.cache.rank_devices:
        try:
            check_device(device)
        except ValueError as exc:
            raise ConfigError(f"cache.rank_devices: {exc}") from None
    check_curve_settings(settings.control)
    return ServeConfig(path, level, kv_events, settings)
