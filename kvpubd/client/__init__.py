"""The client library: everything a process beside the daemon or a router needs.

- ``ControlClient`` / ``AsyncControlClient``: the control socket (store, release, reset, ...),
  answering with the typed replies of ``kvpubd.client.replies``;
- ``Subscriber`` / ``AsyncSubscriber``: follow the event stream, repairing gaps by replay (or,
  with ``snapshot_endpoint``, bootstrapping from a snapshot: ``kvpubd.client.bootstrap``);
- ``Mirror``: the cache as a router sees it, rebuilt from published events alone (a hybrid
  model's KV cache groups each apart: ``GroupKind``);
- ``map_pool``: map the daemon's block pool into this process (``map_host_tier``: its host
  tier);
- the events a batch holds (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, their
  union ``Event``, and ``EventBatch``), so that a consumer needs no other import.

The client never imports the daemon: it speaks the protocol (``kvpubd.protocol``) only.
"""

from kvpubd.client.control import AsyncControlClient, ControlClient, ControlTimeout
from kvpubd.client.mirror import GroupKind, Mirror, MirrorError
from kvpubd.client.pool import MappedPool, map_host_tier, map_pool
from kvpubd.client.replies import (
    BatchReply,
    ChecksumReply,
    ComputedReply,
    ControlError,
    HostTierInfo,
    Marker,
    PauseReply,
    PingReply,
    PoolInfo,
    RankEndpoints,
    RankStats,
    ReleaseReply,
    ResetReply,
    SnapshotReply,
    StatsReply,
    StoreReply,
    release_request,
    store_request,
)
from kvpubd.client.subscriber import (
    AsyncSubscriber,
    Counters,
    Subscriber,
    SubscriberError,
    SubscriberTimeout,
    replay,
)
from kvpubd.client.tracker import Received
from kvpubd.protocol.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch

__all__ = [
    "AllBlocksCleared",
    "AsyncControlClient",
    "AsyncSubscriber",
    "BatchReply",
    "BlockRemoved",
    "BlockStored",
    "ChecksumReply",
    "ComputedReply",
    "ControlClient",
    "ControlError",
    "ControlTimeout",
    "Counters",
    "Event",
    "EventBatch",
    "GroupKind",
    "HostTierInfo",
    "MappedPool",
    "Marker",
    "Mirror",
    "MirrorError",
    "PauseReply",
    "PingReply",
    "PoolInfo",
    "RankEndpoints",
    "RankStats",
    "Received",
    "ReleaseReply",
    "ResetReply",
    "SnapshotReply",
    "StatsReply",
    "StoreReply",
    "Subscriber",
    "SubscriberError",
    "SubscriberTimeout",
    "map_host_tier",
    "map_pool",
    "release_request",
    "replay",
    "store_request",
]
