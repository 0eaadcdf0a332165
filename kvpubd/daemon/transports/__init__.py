"""How a rank's batches travel: the ``Transport`` protocol and the registry ``events.publisher``
names one from (as vLLM's ``EventPublisherFactory`` does).

The history (``kvpubd.daemon.history``) numbers, encodes and keeps each batch, then hands it to
its transport's ``send``; a transport that serves replays reads the history's ring. A new
transport is one module with a factory taking a ``TransportSetup``, and one line in
``TRANSPORTS``: the pipeline, the service and the operations see only this protocol.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpubd.daemon.settings import ConfigError
from kvpubd.daemon.transports.base import Listener, Transport, TransportSetup
from kvpubd.daemon.transports.null import NullTransport
from kvpubd.daemon.transports.zmq import ZmqTransport

__all__ = [
    "TRANSPORTS",
    "Listener",
    "Transport",
    "TransportSetup",
    "check_transport",
    "create_transport",
]

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
