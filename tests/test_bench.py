"""`kvpubd bench` runs end to end and reports what it claims (not how fast: no thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest


def bench(*args: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "kvpubd", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_bench_reset_reports_every_size_the_baseline_and_the_floor() -> None:
    result = bench("reset", "--sizes", "0,100", "--resets", "3", "--idle-ms", "1")
    for part in (result["sizes"], result["baseline"]):
        assert set(part) == {"0", "100"}
        for row in part.values():
            assert row["n"] >= 3 and 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
    assert result["floor"]["n"] == 3


def test_bench_throughput_counts_blocks_without_gaps() -> None:
    result = bench("throughput", "--requests", "20", "--window", "4", "--num-blocks", "4096")
    assert result["gaps"] == 0 and result["dropped_stored_blocks"] == 0
    assert result["blocks"] > 0 and result["blocks_per_s"] > 0


def test_bench_publisher_and_index() -> None:
    publisher = bench("publisher", "--batches", "20", "--events-per-batch", "5", "--rounds", "1")
    assert publisher["events_per_s"] > 0 and publisher["floor_events_per_s"] > 0
    index = bench("index", "--blocks", "4096", "--chain", "16", "--rounds", "20")
    assert index["blocks"] == 4096 and index["ops_per_s"] > 0 and index["bytes_per_block"] > 0


@pytest.mark.parametrize("load", ["snapshot", "replay-flood", "big-store", "idle-conns"])
def test_bench_reset_under_load_reports_idle_and_loaded(load: str) -> None:
    result = bench(
        "reset",
        "--under",
        load,
        "--sizes",
        "0,64",
        "--resets",
        "3",
        "--idle-ms",
        "1",
        "--reset-timeout",
        "10",
        "--snapshot-blocks",
        "512",
        "--flood-processes",
        "1",
        "--idle-connections",
        "30",
    )
    assert result["under"] == load
    assert set(result["sizes"]) == {"0", "64"}
    for phases in result["sizes"].values():
        assert set(phases) == {"idle", "loaded"}
        for row in phases.values():
            assert "error" not in row, row["error"]
            assert row["n"] == 3 and row["reply"]["n"] == 3
            assert 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
    # Every load process reported what it did, and did something.
    reports = result["load"]
    assert len(reports) == 1
    for report in reports:
        assert report["load"] == load
        done = {
            "snapshot": "ops",
            "big-store": "ops",
            "replay-flood": "requests_sent",
            "idle-conns": "held_at_end",
        }[load]
        assert report[done] > 0
    assert result["daemon"]["alive_at_end"]
