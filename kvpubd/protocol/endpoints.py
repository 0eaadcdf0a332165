"""ZeroMQ endpoints as daemon and clients name them, and the environment variables they read.
Light on purpose (no pydantic): every client and every command imports it."""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV_PREFIX = "KVPUBD_"
# Variables only the clients read (the daemon's own are KVPUBD_<SECTION>__<KEY>).
CURVE_KEY_ENV = "KVPUBD_CURVE_KEY"
SERVER_KEY_ENV = "KVPUBD_SERVER_KEY"
CONTROL_ENDPOINT_ENV = "KVPUBD_CONTROL__ENDPOINT"
CLIENT_ENV = (CURVE_KEY_ENV, SERVER_KEY_ENV)


def default_runtime_dir() -> Path:
    """Owner-only directory for the control socket: $XDG_RUNTIME_DIR/kvpubd or /tmp/kvpubd-<uid>."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "kvpubd"
    return Path(f"/tmp/kvpubd-{os.getuid()}")


def default_control_endpoint() -> str:
    return f"ipc://{default_runtime_dir() / 'control.sock'}"


def check_endpoint(value: str) -> str:
    """``value`` if it is a usable ZeroMQ endpoint; ValueError saying what is wrong."""
    if not re.match(r"^(tcp|ipc|inproc)://.+", value):
        raise ValueError(f"{value!r} is not a ZeroMQ endpoint (tcp://, ipc:// or inproc://)")
    if value.startswith("tcp://") and tcp_port(value) is None:
        raise ValueError(f"{value!r} needs a numeric port (tcp://host:port)")
    return value


def tcp_port(endpoint: str) -> int | None:
    """The port of a tcp endpoint, or None for ipc/inproc and unparseable ports."""
    if not endpoint.startswith("tcp://"):
        return None
    _, _, port = endpoint.rpartition(":")
    return int(port) if port.isdigit() and 0 < int(port) <= 65535 else None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Per-rank endpoint: tcp gets base_port + rank, ipc/inproc get the suffix _dp<rank>."""
    port = tcp_port(endpoint)
    if port is not None:
        host = endpoint.rpartition(":")[0]
        return f"{host}:{port + rank}"
    return f"{endpoint}_dp{rank}"


def engine_rank_endpoint(endpoint: str, rank: int) -> str:
    """An engine's endpoint for data-parallel ``rank``, as vLLM offsets its publisher's: rank
    0's as given, then tcp port + rank (a port 0 is left to the OS) or the suffix _dp<rank>."""
    if rank == 0 or tcp_port(endpoint) == 0:
        return endpoint
    return rank_endpoint(endpoint, rank)


_RANK_SUFFIX = re.compile(r"_dp\d+$")


def base_endpoint(endpoint: str) -> str:
    """The base ``rank_endpoint`` was given, from an ipc or inproc endpoint that already names
    a rank (``ipc:///run/kvpubd/events_dp0``, as ``ping`` reports it), so that what ``ping``
    prints can be passed back. Others are returned as they are (tcp: rank 0's port is the
    base)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return _RANK_SUFFIX.sub("", endpoint)
    return endpoint


# While a daemon's ipc listener is at its connection cap, its socket file lies renamed with
# this suffix: new connections fail and are retried until it is back.
CAPPED_SUFFIX = ".capped"


def missing_ipc_socket(endpoint: str) -> str | None:
    """The path of an ipc endpoint whose socket file does not exist (None otherwise): nobody
    can answer there, so waiting for a reply is pointless. A listener at its connection cap
    is there: it answers once connections close."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    if path.startswith("@") or os.path.exists(path):  # "@": Linux abstract namespace
        return None
    if os.path.exists(path + CAPPED_SUFFIX):
        return None
    return path
