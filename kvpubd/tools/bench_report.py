"""What every bench reports with: latency percentiles of its samples, and the console on
stderr for progress and messages (stdout carries the result alone)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.console import Console

err = Console(stderr=True)


def percentile(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q)) if samples else float("nan")


def summary(samples_ns: list[int]) -> dict[str, Any]:
    us = [s / 1000 for s in samples_ns]
    return {
        "n": len(us),
        "p50_us": round(percentile(us, 50), 1),
        "p99_us": round(percentile(us, 99), 1),
        "max_us": round(max(us), 1) if us else None,
    }
