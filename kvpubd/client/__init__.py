"""The client library: everything a process beside the daemon or a router needs.

- ``ControlClient`` / ``AsyncControlClient``: the control socket (store, release, reset, ...);
- ``Subscriber`` / ``AsyncSubscriber``: follow the event stream, repairing gaps by replay;
- ``Mirror``: the cache as a router sees it, rebuilt from published events alone;
- ``map_pool``: map the daemon's block pool into this process.

The client never imports the daemon: it speaks the protocol (``kvpubd.protocol``) only.
"""

from kvpubd.client.control import AsyncControlClient, ControlClient, ControlError, ControlTimeout
from kvpubd.client.mirror import Mirror, MirrorError
from kvpubd.client.pool import MappedPool, map_pool
from kvpubd.client.subscriber import (
    AsyncSubscriber,
    Counters,
    Subscriber,
    SubscriberError,
    SubscriberTimeout,
    replay,
)
from kvpubd.client.tracker import Received

__all__ = [
    "AsyncControlClient",
    "AsyncSubscriber",
    "ControlClient",
    "ControlError",
    "ControlTimeout",
    "Counters",
    "MappedPool",
    "Mirror",
    "MirrorError",
    "Received",
    "Subscriber",
    "SubscriberError",
    "SubscriberTimeout",
    "map_pool",
    "replay",
]
