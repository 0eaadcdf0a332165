"""File descriptors: the daemon's one resource that strangers can use up.

Every TCP connection to a PUB, replay or metrics port costs an fd, and libzmq aborts the whole
process (``Too many open files``, SIGABRT) when an ipc listener's accept finds none left. So
the soft limit is raised to the hard one at start-up, and ``fd_budget`` says how many
connections the listeners may hold between them, keeping a reserve for everything else."""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("kvpubd")

# Fds kept free beyond those open at start-up (half the limit): control clients, ZAP, and
# the overshoot of a connection flood before its listener stops accepting.
FD_RESERVE_MIN = 64
FD_RESERVE_FRACTION = 0.5
# Below this the reserve leaves the listeners no connections at all: a start would only
# fail later, at the first few clients (libzmq aborts when an accept finds no fd).
MIN_FD_LIMIT = 128
# Below this a start is warned: libzmq's IO thread accepts an ipc listener's connections as
# fast as they come, before the loop has heard of them and closed the listener at its cap, and
# a burst of a few hundred (one local process's) used up a reserve of 64-128 and aborted the
# daemon (TCP listeners survive that: their accept takes EMFILE).
SAFE_FD_LIMIT = 1024


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (capped by the kernel's nr_open);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("file descriptors: cannot raise the limit %d to %d: %s", soft, target, exc)
            return soft
        log.info("file descriptors: limit raised from %d to %d (the hard limit)", soft, target)
        return target
    return soft


def fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _nr_open() if soft == resource.RLIM_INFINITY else soft


def open_fds() -> int:
    """Fds this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir itself opened
    except OSError:  # pragma: no cover - no /proc (not Linux)
        return 64


def fd_budget(listeners: int) -> int:
    """Connections each of ``listeners`` listeners may hold: what the limit leaves after the
    fds open now and a reserve, shared evenly; at least 1."""
    limit = fd_limit()
    reserve = max(FD_RESERVE_MIN, int(limit * FD_RESERVE_FRACTION))
    spare = limit - open_fds() - reserve
    return max(1, spare // max(1, listeners))


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as handle:
            return int(handle.read())
    except (OSError, ValueError):  # pragma: no cover - not Linux
        return 1 << 20
