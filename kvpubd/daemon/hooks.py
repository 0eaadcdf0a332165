"""What the daemon reports as it works, and the no-op stand-in used when metrics are off.

The pipeline and the control server call these hooks unconditionally; ``NullMetrics`` (like
vLLM's ``NullEventPublisher``) keeps ``if metrics is not None`` out of every hot path."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvpubd.protocol.wire import Event


class MetricsHooks(Protocol):
    def published(self, rank: int, events: Iterable[Event]) -> None: ...

    def control(self, op: str, error_code: str | None = None) -> None: ...

    def refused(self, error_code: str) -> None: ...

    def reset_done(self, seconds: float) -> None: ...

    def event_counts(self, rank: int) -> dict[str, int]: ...

    async def start(self, host: str, port: int) -> str: ...

    async def close(self) -> None: ...


class NullMetrics:
    """Metrics off: every hook does nothing."""

    def published(self, rank: int, events: Iterable[Event]) -> None:
        pass

    def control(self, op: str, error_code: str | None = None) -> None:
        pass

    def refused(self, error_code: str) -> None:
        pass

    def reset_done(self, seconds: float) -> None:
        pass

    def event_counts(self, rank: int) -> dict[str, int]:
        return {}

    async def start(self, host: str, port: int) -> str:
        return ""

    async def close(self) -> None:
        pass
