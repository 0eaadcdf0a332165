"""Whether a daemon runs its ranks in worker processes: ``service.rank_processes`` "on",
"off", or "auto" (more than one rank, and a CPU for each worker and one for the service)."""

from __future__ import annotations

import pytest

from kvpubd.daemon.process_service import usable_cpus, uses_rank_processes
from kvpubd.daemon.settings import Settings


def settings(mode: str, ranks: int) -> Settings:
    return Settings(service={"rank_processes": mode}, cache={"data_parallel_size": ranks})


@pytest.mark.parametrize(
    ("ranks", "cpus", "expected"),
    [(1, 64, False), (2, 2, False), (2, 3, True), (8, 8, False), (8, 9, True), (8, 16, True)],
)
def test_auto_wants_a_cpu_per_worker_and_one_for_the_service(
    ranks: int, cpus: int, expected: bool
) -> None:
    assert uses_rank_processes(settings("auto", ranks), cpus) is expected


def test_on_and_off_are_what_they_say() -> None:
    assert uses_rank_processes(settings("on", 1), cpus=1)
    assert not uses_rank_processes(settings("off", 8), cpus=64)
    assert usable_cpus() >= 1
