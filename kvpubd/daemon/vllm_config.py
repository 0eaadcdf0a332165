"""vLLM's ``--kv-events-config`` JSON (its ``KVEventsConfig``), mapped onto kvpubd's [events].

An operator who already runs vLLM with ``--kv-events-config '{...}'`` passes the same JSON to
``kvpubd serve --kv-events-config``. Each field present sets the matching [events] key; absent
fields leave kvpubd's own settings alone. What kvpubd cannot honour is refused (a config error)
and what has no meaning here is ignored and said so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvpubd.daemon.settings import ConfigError, EventsConfig, describe_validation_error

# KVEventsConfig's fields that map onto [events] keys of the same meaning and name.
MAPPED = (
    "publisher",
    "endpoint",
    "replay_endpoint",
    "snapshot_endpoint",
    "buffer_steps",
    "hwm",
    "topic",
)
# Fields that have no counterpart here, with why.
IGNORED = {
    "max_queue_size": "kvpubd has no queue between capture and publisher (each tick publishes)",
    # vLLM's snapshot caps (its recorder shares the engine's GIL): kvpubd builds snapshots a
    # slice per loop turn and sends them in chunks, whatever their size.
    "snapshot_max_blocks": "kvpubd serves snapshots of any size, in chunks",
    "snapshot_max_response_bytes": "kvpubd serves snapshots of any size, in chunks",
}
CHECKED = ("enable_kv_cache_events",)
FIELDS = (*CHECKED, *MAPPED, *IGNORED)


@dataclass(frozen=True)
class KvEventsMapping:
    """The [events] keys the JSON sets, and the notes on what it ignores."""

    events: dict[str, Any]
    ignored: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One log line: what was taken over, what was ignored."""
        taken = ", ".join(f"events.{k} = {v!r}" for k, v in self.events.items()) or "nothing"
        ignored = "; ".join(self.ignored) or "nothing"
        return f"kv-events-config: mapped {taken}; ignored {ignored}"


def load_kv_events_config(value: str) -> KvEventsMapping:
    """Parse ``value`` (JSON, or ``@path`` of a JSON file) and map it; raise ConfigError."""
    text = value
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"kv-events-config: {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"kv-events-config: not valid JSON: {exc}") from None
    except RecursionError:  # json.loads recurses once per nesting level
        raise ConfigError("kv-events-config: nested too deeply to be vLLM's config") from None
    return map_kv_events_config(data)


def map_kv_events_config(data: Any) -> KvEventsMapping:
    """Map a decoded KVEventsConfig object onto [events] keys; raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError("kv-events-config: expected a JSON object (vLLM's KVEventsConfig)")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"kv-events-config: unknown key {unknown[0]!r} (KVEventsConfig has {', '.join(FIELDS)})"
        )
    enable = data.get("enable_kv_cache_events", True)
    if enable is not True:
        raise ConfigError(
            f"kv-events-config: enable_kv_cache_events is {json.dumps(enable)}: "
            "with it vLLM publishes nothing; kvpubd exists to publish (set it to true)"
        )
    events = {key: data[key] for key in MAPPED if key in data}
    if events.get("publisher", "") is None:
        del events["publisher"]  # vLLM's null: its default, here kvpubd's own setting
    for optional in ("replay_endpoint", "snapshot_endpoint"):
        if optional in events and events[optional] is None:
            events[optional] = ""  # vLLM's null: no such socket
    try:
        EventsConfig.model_validate(events)
    except ValidationError as exc:
        raise ConfigError(f"kv-events-config: {describe_validation_error(exc)}") from None
    ignored = [f"{key} ({why})" for key, why in IGNORED.items() if key in data]
    return KvEventsMapping(events, ignored)
