"""The null transport (``events.publisher = "null"``, vLLM's ``NullEventPublisher``): batches
go nowhere, while the history still numbers and keeps them (seqs, stats, the seq state file
and snapshots stay as with any transport)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpubd.daemon.transports.base import Listener, TransportSetup


class NullTransport:
    endpoint = ""
    replay_endpoint = ""
    replay_requests = 0
    replays_refused = 0
    snapshot_endpoint = ""
    snapshot_requests = 0
    snapshots_unavailable = 0

    @classmethod
    def from_setup(cls, setup: TransportSetup) -> NullTransport:
        return cls()

    def send(self, seq_frame: bytes, payload: bytes) -> None:
        pass

    def listeners(self) -> list[Listener]:
        return []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def close(self) -> None:
        pass
