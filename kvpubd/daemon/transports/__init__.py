"""How a rank's batches travel: the ``Transport`` protocol and the registry ``events.publisher``
names one from (as vLLM's ``EventPublisherFactory`` does).

The history (``kvpubd.daemon.history``) numbers, encodes and keeps each batch, then hands it to
its transport's ``send``; a transport that serves replays reads the history's ring. A new
transport is one module with a factory taking a ``TransportSetup``, and one line in
``TRANSPORTS``: the pipeline, the service and the operations see only this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpubd.daemon.transports.null import NullTransport
from kvpubd.daemon.transports.zmq import ZmqTransport
from kvpubd.protocol.config import ConfigError, Settings

if TYPE_CHECKING:
    from zmq import Context, Socket

    from kvpubd.daemon.history import History

__all__ = [
    "TRANSPORTS",
    "Listener",
    "Transport",
    "TransportSetup",
    "check_transport",
    "create_transport",
]

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
    context: Context[
        Socket[bytes]
    ]  # the daemon's ZeroMQ context (its I/O threads), for transports on ZeroMQ


TransportFactory = Callable[[TransportSetup], Transport]

# events.publisher -> the factory of that transport.
TRANSPORTS: dict[str, TransportFactory] = {
    "zmq": ZmqTransport.from_setup,
    "null": NullTransport.from_setup,
}


def check_transport(name: str) -> None:
    """Raise ConfigError unless ``name`` is a registered transport."""
    if name not in TRANSPORTS:
        raise ConfigError(
            f"events.publisher: {name!r} is no transport kvpubd has ({', '.join(TRANSPORTS)})"
        )


def create_transport(setup: TransportSetup) -> Transport:
    """The transport ``events.publisher`` names, for ``setup.rank``; ConfigError if none."""
    name = setup.settings.events.publisher
    check_transport(name)
    return TRANSPORTS[name](setup)
