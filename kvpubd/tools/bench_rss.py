"""The memory of a process a bench watches (the daemon child): its resident set now and at its
peak, from /proc/<pid>/status, read once or sampled on a thread while a phase runs."""

from __future__ import annotations

import threading
from types import TracebackType

SAMPLE_S = 0.02  # a peak between two samples is missed: 20 ms is short beside a snapshot


def memory_mib(pid: int) -> dict[str, float]:
    """``rss``: resident now (VmRSS); ``hwm``: the peak since the process started (VmHWM);
    in MiB. Empty once the process is gone."""
    values: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values["rss" if key == "VmRSS" else "hwm"] = round(
                        int(rest.split()[0]) / 1024, 1
                    )
    except OSError:
        return {}
    return values


class PeakRss:
    """While entered, samples ``pid``'s VmRSS every SAMPLE_S on a thread; ``peak_mib`` is the
    largest seen (VmHWM cannot tell one phase's peak from an earlier one's)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_mib = 0.0
        self.samples = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss sampler", daemon=True)

    def _sample(self) -> None:
        while True:
            rss = memory_mib(self.pid).get("rss")
            if rss is not None:
                self.peak_mib = max(self.peak_mib, rss)
                self.samples += 1
            if self._done.wait(SAMPLE_S):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._done.set()
        self._thread.join()
