"""CPU time of a running service from /proc (Linux): the daemon process and, with
``service.rank_processes``, its rank worker processes (its children)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

WORKER_MODULE = b"kvpubd.daemon.rank_worker"  # what a rank worker runs: python -m this


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far; 0 for one that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The live children of ``pid`` (each of its threads' children: a worker is started from
    the thread that runs the service's loop)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return sorted(set(found))


def rank_workers(pid: int) -> list[int]:
    """The children of ``pid`` that are rank workers (other children, such as
    multiprocessing's resource tracker, are part of the service but not workers)."""
    found = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if WORKER_MODULE in cmdline.split(b"\0"):
            found.append(child)
    return found


@dataclass
class CpuReading:
    """CPU seconds so far of each daemon (parent) process and of each of their children (the
    rank workers, and anything else the daemon started)."""

    parents: dict[int, float]
    workers: dict[int, float]

    @classmethod
    def now(cls, daemon_pids: list[int]) -> CpuReading:
        workers = [child for pid in daemon_pids for child in children(pid)]
        return cls(
            {pid: cpu_seconds(pid) for pid in daemon_pids},
            {pid: cpu_seconds(pid) for pid in workers},
        )

    def since(self, before: CpuReading) -> tuple[float, float]:
        """(the parents' CPU seconds, the workers' CPU seconds) between ``before`` and this
        reading; a worker started in between counts from 0."""
        parents = sum(t - before.parents.get(pid, 0.0) for pid, t in self.parents.items())
        workers = sum(t - before.workers.get(pid, 0.0) for pid, t in self.workers.items())
        return parents, workers
