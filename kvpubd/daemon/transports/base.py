"""What every transport is: the ``Transport`` protocol, and the ``TransportSetup`` a factory
builds one rank's transport from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpubd.daemon.settings import Settings

if TYPE_CHECKING:
    from zmq import Context, Socket

    from kvpubd.daemon.history import History, Snapshots

# A bound socket whose connections the service caps (see conn_cap): (socket, endpoint as
# bound, what it is: "events", "replay").
Listener = tuple["Socket[bytes]", str, str]


class Transport(Protocol):
    """Where a rank's batches go. ``send`` is the hot path: once per batch, nothing more than
    the send itself; ``endpoint`` and ``replay_endpoint`` (as bound; "" for none) and the
    replay counters are what ``ping`` and ``stats`` report."""

    @property
    def endpoint(self) -> str: ...

    @property
    def replay_endpoint(self) -> str: ...

    @property
    def replay_requests(self) -> int: ...

    @property
    def replays_refused(self) -> int: ...

    @property
    def snapshot_endpoint(self) -> str:
        """The snapshot endpoint as bound; "" where the transport serves none."""
        ...

    @property
    def snapshot_requests(self) -> int: ...

    @property
    def snapshots_unavailable(self) -> int: ...

    def send(self, seq_frame: bytes, payload: bytes) -> None:
        """One batch: its seq (8 bytes, big-endian; ``wire.unpack_seq``) and its payload."""
        ...

    def listeners(self) -> list[Listener]:
        """The sockets it accepts connections on, for the service's connection caps."""
        ...

    def start(self) -> None:
        """Serve from the running loop (replay requests); called once the loop runs."""
        ...

    def stop(self) -> None:
        """Stop serving from the loop; ``send`` still works (shutdown's last batch)."""
        ...

    def close(self) -> None:
        """Release everything it holds (sockets, socket files)."""
        ...


@dataclass(frozen=True)
class TransportSetup:
    """What a factory builds one rank's transport from."""

    rank: int
    settings: Settings
    history: History  # what the transport sends, and replays from
    # The daemon's ZeroMQ context (its I/O threads), for transports on ZeroMQ.
    context: Context[Socket[bytes]]
    # The rank's shared snapshot job (a new one once the last is stale), for a transport that
    # serves snapshots; None where nothing can build one.
    snapshots: Snapshots | None = None
