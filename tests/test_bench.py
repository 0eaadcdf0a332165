"""`kvpubd bench` runs end to end and reports what it claims (not how fast: no thresholds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from kvpubd.tools.vllm_blockpool import missing_files
from kvpubd.tools.vllm_source import DIR_ENV_VAR, ENV_VAR, kv_events_path

# Each test runs a benchmark command end to end (seconds each, minutes together), with
# daemons of its own: processes.
pytestmark = [pytest.mark.bench, pytest.mark.daemon_process]


def bench(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "kvpubd", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return cast(dict[str, Any], json.loads(result.stdout))


def test_bench_reset_reports_every_size_the_baseline_and_the_floor() -> None:
    result = bench("reset", "--sizes", "0,100", "--resets", "3", "--idle-ms", "1")
    for part in (result["sizes"], result["baseline"]):
        assert set(part) == {"0", "100"}
        for row in part.values():
            assert row["n"] >= 3 and 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
    assert result["floor"]["n"] == 3


def test_bench_reset_warns_of_a_small_sample_only_when_it_is_one() -> None:
    from kvpubd.tools.bench_reset import MIN_RESETS

    def stderr_of(resets: int) -> str:
        result = subprocess.run(
            [
                *(sys.executable, "-m", "kvpubd", "bench", "reset", "--sizes", "0"),
                *("--resets", str(resets), "--idle-ms", "0", "--json"),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert result.returncode == 0, result.stderr
        json.loads(result.stdout)  # the measurement is still made and printed
        return result.stderr

    assert f"{MIN_RESETS - 1} resets per size is too small a sample" in stderr_of(MIN_RESETS - 1)
    assert "too small a sample" not in stderr_of(MIN_RESETS)


def test_bench_throughput_counts_blocks_without_gaps() -> None:
    result = bench("throughput", "--requests", "20", "--window", "4", "--num-blocks", "4096")
    assert result["gaps"] == 0 and result["dropped_stored_blocks"] == 0
    assert result["blocks"] > 0 and result["blocks_per_s"] > 0
    assert result["hash_algorithm"] == "sha256"
    # The same prompts under the other hash: other hashes, the same prefixes shared.
    xxhash = bench("throughput", "--requests", "20", "--window", "4", "--num-blocks", "4096",
                   "--hash-algorithm", "xxhash")  # fmt: skip
    assert xxhash["hash_algorithm"] == "xxhash" and xxhash["gaps"] == 0
    assert xxhash["blocks"] == result["blocks"]


def test_bench_publisher_and_index() -> None:
    publisher = bench("publisher", "--batches", "20", "--events-per-batch", "5", "--rounds", "1")
    assert publisher["events_per_s"] > 0 and publisher["floor_events_per_s"] > 0
    index = bench("index", "--blocks", "4096", "--chain", "16", "--rounds", "20")
    assert index["blocks"] == 4096 and index["ops_per_s"] > 0 and index["bytes_per_block"] > 0


def test_bench_store_rtt_times_every_pair_into_a_churning_pool() -> None:
    result = bench("store-rtt", "--num-blocks", "1024", "--prompt-blocks", "16", "--rounds", "200")
    assert result["full_from_round"] == 64 and result["rounds"] == 200
    rtt = result["round_trip"]
    assert rtt["n"] == 200 and 0 < rtt["p50_us"] <= rtt["p99_us"] <= rtt["p999_us"] <= rtt["max_us"]
    assert all(0 <= number < 200 for number in result["slow_rounds"])


def test_bench_throughput_over_ranks_and_under_paced_load() -> None:
    """Two ranks: every rank's subscriber counts its blocks; then resets are timed under a
    paced load at two fractions of the measured rate."""
    # 100 requests: the daemon's CPU is read in 10 ms kernel ticks, and 20 requests' work could
    # read 0 ticks (CI did, as for the rank processes below).
    ranks = bench("throughput", "--requests", "100", "--window", "4", "--num-blocks", "4096",
                  "--ranks", "2")  # fmt: skip
    assert ranks["ranks"] == 2 and ranks["gaps"] == 0 and ranks["blocks"] > 0
    assert ranks["daemon_cpu_us_per_block"] > 0
    # The same requests over one single-rank daemon per rank: each rank's cache sees the same
    # prompts, so exactly the same blocks are published.
    apart = bench("throughput", "--requests", "100", "--window", "4", "--num-blocks", "4096",
                  "--ranks", "2", "--daemon-per-rank")  # fmt: skip
    assert (apart["daemons"], ranks["daemons"]) == (2, 1)
    assert apart["gaps"] == 0 and apart["blocks"] == ranks["blocks"]
    loaded = bench("throughput", "--requests", "20", "--window", "4", "--num-blocks", "4096",
                   "--load-fraction", "0.5", "--load-fraction", "0.9", "--resets", "3")  # fmt: skip
    rows = loaded["reset_under_load"]
    assert [row["load_fraction"] for row in rows] == [0.5, 0.9]
    for row in rows:
        assert row["n"] == 3 and 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
        # The count, not stores_per_s: a slow machine's rate rounds to 0.
        assert row["stores"] > 0 and row["stores_per_s"] is not None


SMALL_RUN = ("--requests", "20", "--window", "4", "--num-blocks", "4096")


def test_bench_throughput_through_one_service_of_rank_processes() -> None:
    """Two ranks in worker processes of one service: every block counted on its rank's
    stream, no gap; the workers' CPU counted with the parent's; the same blocks as with both
    ranks in the daemon's process and as with one sending process."""
    # 100 requests: the workers' ~90 ms of CPU is read in 10 ms kernel ticks, and at 20 requests
    # (~10 ms a worker) they could read 0 ticks where a fast machine did the work (CI did).
    run = ("--requests", "100", "--window", "4", "--num-blocks", "4096")
    result = bench("throughput", *run, "--ranks", "2", "--rank-processes", "on")
    assert (result["rank_processes"], result["rank_worker_processes"]) == (True, 2)
    assert result["senders"] == 2 and result["window_per_rank"] == 4
    assert result["gaps"] == 0 and result["undecodable_batches"] == 0 and result["blocks"] > 0
    # The workers' CPU is added to the service's, which may read 0 at kernel-tick granularity
    # (10 ms) on a run this short: the service only routes.
    assert result["daemon_cpu_us_per_block"] > result["parent_cpu_us_per_block"] >= 0
    one_process = bench("throughput", *run, "--ranks", "2", "--rank-processes", "off",
                        "--senders", "one")  # fmt: skip
    assert (one_process["rank_processes"], one_process["senders"]) == (False, 1)
    assert one_process["daemon_cpu_us_per_block"] == one_process["parent_cpu_us_per_block"]
    assert one_process["gaps"] == 0 and one_process["blocks"] == result["blocks"]


def test_bench_throughput_in_batches_stores_the_same_blocks() -> None:
    """Batch messages of stores and releases (an engine's scheduler step) through rank
    processes: the same blocks counted, no gap, no refusal."""
    batched = bench("throughput", *SMALL_RUN, "--ranks", "2", "--batch", "3",
                    "--rank-processes", "on")  # fmt: skip
    single = bench("throughput", *SMALL_RUN, "--ranks", "2")
    assert batched["batch"] == 3 and batched["rank_processes"] is True
    assert batched["gaps"] == 0 and batched["blocks"] == single["blocks"] > 0


def test_bench_per_rank_resets_fill_every_rank_and_time_each_ranks_marker() -> None:
    result = bench("throughput", *SMALL_RUN, "--ranks", "2", "--fill-blocks", "600",
                   "--load-fraction", "0.5", "--resets", "3", "--rank-processes", "on")  # fmt: skip
    resets = result["per_rank_resets"]
    assert (resets["ranks"], resets["rank_processes"], resets["gaps"]) == (2, True, 0)
    assert [phase["load_fraction"] for phase in resets["phases"]] == [0.0, 0.5]
    for phase in resets["phases"]:
        # Every rank held the fill before each reset, and published a marker for each.
        assert phase["cached_blocks_min"] == 600 and phase["missing_markers"] == 0
        assert [row["rank"] for row in phase["per_rank"]] == [0, 1]
        for row in [*phase["per_rank"], phase["slowest_rank"], phase["reply"]]:
            assert row["n"] == 3 and 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
        slowest = max(row["max_us"] for row in phase["per_rank"])
        assert phase["slowest_rank"]["max_us"] == slowest
        # The bare-pyzmq floor, a fan-out after each reset: each rank's marker every round.
        floor = phase["floor"]
        assert floor["missing_markers"] == 0 and [r["rank"] for r in floor["per_rank"]] == [0, 1]
        for row in [*floor["per_rank"], floor["slowest_rank"], floor["reply"]]:
            assert row["n"] == 3 and 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
    idle, loaded = resets["phases"]
    assert idle["stores"] == 0 and loaded["stores"] > 0


def test_bench_throughput_decodes_with_msgpack_without_vllms_file(tmp_path: Path) -> None:
    missing = tmp_path / "kv_events.py"
    result = bench("throughput", *SMALL_RUN, env={ENV_VAR: str(missing)})
    assert result["decoded_by"] == "msgpack" and result["blocks"] > 0 and result["gaps"] == 0


@pytest.mark.skipif(not kv_events_path().is_file(), reason="vLLM's kv_events.py not extracted")
def test_bench_throughput_decodes_every_block_with_vllms_types() -> None:
    result = bench("throughput", *SMALL_RUN, "--ranks", "2")
    assert result["decoded_by"] == "vllm" and result["undecodable_batches"] == 0
    plain = bench("throughput", *SMALL_RUN, "--ranks", "2",
                  env={ENV_VAR: "/nonexistent/kv_events.py"})  # fmt: skip
    assert plain["decoded_by"] == "msgpack" and plain["blocks"] == result["blocks"] > 0


def test_bench_against_vllm_is_skipped_cleanly_without_its_file(tmp_path: Path) -> None:
    missing = tmp_path / "kv_events.py"
    result = bench("publisher", "--against-vllm", env={"KVPUBD_VLLM_KV_EVENTS": str(missing)})
    assert str(missing) in result["skipped"]


@pytest.mark.skipif(not kv_events_path().is_file(), reason="vLLM's kv_events.py not extracted")
@pytest.mark.parametrize("decoders", [1, 3])
def test_bench_against_vllm_decodes_both_streams_with_vllms_types(decoders: int) -> None:
    # The bench itself checks that the decoders of a stream decoded every block once between
    # them, and that each received every batch; a miscount fails the run.
    result = bench(
        "publisher", "--against-vllm", "--batches", "20", "--rounds", "2",
        "--decoders", str(decoders),
    )  # fmt: skip
    assert result["decoders"] == decoders
    assert result["kvpubd_blocks_per_s"] > 0 and result["vllm_blocks_per_s"] > 0
    assert result["kvpubd_cpu_us_per_block"] > 0 and result["vllm_cpu_us_per_block"] > 0
    assert result["paired_cpu_ratio"] > 0
    assert all(0 < busy <= 1 for busy in result["decoder_busy"].values())


def test_bench_throughput_against_vllm_still_measures_the_daemon_without_its_files(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "nothing-here"
    env = {DIR_ENV_VAR: str(empty), ENV_VAR: str(empty / "kv_events.py")}
    # 40 requests: with 10, the daemon's CPU time could read 0 (kernel ticks of 10 ms).
    result = bench("throughput", "--requests", "40", "--window", "4", "--num-blocks", "4096",
                   "--against-vllm", env=env)  # fmt: skip
    assert result["blocks"] > 0 and result["daemon_cpu_us_per_block"] > 0
    assert str(empty / "block_pool.py") in result["vllm_blockpool"]["skipped"]


@pytest.mark.skipif(bool(missing_files()), reason="vLLM's files not extracted")
def test_bench_throughput_against_vllm_sets_vllms_pool_beside_the_daemon() -> None:
    result = bench("throughput", "--requests", "40", "--window", "4", "--num-blocks", "4096",
                   "--hash-algorithm", "xxhash", "--against-vllm")  # fmt: skip
    beside = result["vllm_blockpool"]
    # The same prompts in a pool as large: the same blocks stored.
    assert beside["vllm_stored_blocks"] == result["blocks"]
    daemon_us = result["daemon_cpu_us_per_block"]
    if daemon_us:
        assert beside["ratio"] == pytest.approx(beside["vllm_us_per_block"] / daemon_us, abs=1e-3)
    else:
        # The daemon's CPU is read in the kernel's ticks (10 ms): a short run may read 0,
        # and then there is no ratio rather than a division by zero.
        assert beside["ratio"] is None


@pytest.mark.skipif(bool(missing_files()), reason="vLLM's files not extracted")
def test_bench_blockpool_reports_both_hashes_and_their_ratios() -> None:
    result = bench("blockpool", "--requests", "10", "--num-blocks", "8192")
    rows = result["results"]
    assert [row["hash_algorithm"] for row in rows] == ["sha256", "xxhash"]
    for row in rows:
        vllm, ours = row["vllm"], row["kvpubd"]
        assert vllm["stored_blocks"] == ours["stored_blocks"] > 0
        assert row["ratio"] == pytest.approx(vllm["us_per_block"] / ours["us_per_block"], abs=1e-3)


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


def test_bench_soak_runs_its_loads_without_a_divergence() -> None:
    """A short soak of three loads (the small stores pipelined through the shared request
    loop): each load reports what it did, nothing diverged or failed, the daemon lived."""
    loads = ["small-stores", "vanishing-clients", "snapshots"]
    result = bench("soak", "--duration", "5", *(arg for load in loads for arg in ("--load", load)))
    assert result["ok"] and result["divergences"] == [] and result["resets_lost"] == 0
    reports = {report["load"]: report for report in result["loads"]}
    assert sorted(reports) == sorted(loads)
    assert reports["small-stores"]["ops"] > 0 and reports["snapshots"]["ops"] > 0
    assert reports["vanishing-clients"]["rounds"] > 0
    assert result["checkpoints"] >= 1 and result["daemon"]["alive_at_end"]
    assert set(result["checkpoint_answer_s_max"]) == {"replay", "snapshot"}


def test_bench_snapshot_rebuilds_every_cached_block_for_every_client() -> None:
    """Cold and warm requests, then clients at once: every reply's events are the blocks
    cached (the bench exits 1 otherwise), and each size reports its sizes and memory."""
    rounds, clients, requests = 2, 2, 2
    result = bench("snapshot", "--sizes", "0,300", "--rounds", str(rounds),
                   "--clients", str(clients), "--requests", str(requests))  # fmt: skip
    assert (result["clients"], result["requests_per_client"]) == (clients, requests)
    assert set(result["sizes"]) == {"0", "300"}
    for size, row in result["sizes"].items():
        assert row["problems"] == []
        # Each round after the first publishes one new block first (a change to build).
        assert row["events"] == row["blocks"] == int(size) + rounds - 1
        assert row["chunks"] >= 1 and row["reply_bytes"] > 0
        for phase in ("cold", "warm"):
            assert row[phase]["n"] == rounds
            assert 0 < row[phase]["p50_ms"] <= row[phase]["p99_ms"] <= row[phase]["max_ms"]
        concurrent = row["concurrent"]
        assert concurrent["requests"] + concurrent["unavailable"] == clients * requests
        assert concurrent["wrong_events"] == concurrent["malformed"] == 0
        assert concurrent["reply_bytes"] == row["reply_bytes"]
        rss = row["rss_mib"]
        assert rss["filled"] > 0 and 0 < rss["before"] <= rss["peak"] <= rss["hwm"]
        assert row["daemon"]["alive"]
        # Every request reached the daemon: the single ones and the clients'.
        assert row["daemon"]["snapshot_requests"] == 2 * rounds + clients * requests


def test_bench_reset_under_snapshot_endpoint_clients() -> None:
    """The snapshot-endpoint load: several REQ clients of the load rank, each in its own
    process, whose replies hold every block that rank caches."""
    clients = 2
    result = bench(
        "reset", "--under", "snapshot-endpoint", "--sizes", "0,64", "--resets", "3",
        "--idle-ms", "1", "--reset-timeout", "10", "--snapshot-blocks", "512",
        "--snapshot-clients", str(clients),
    )  # fmt: skip
    assert result["under"] == "snapshot-endpoint"
    for phases in result["sizes"].values():
        for row in phases.values():
            assert "error" not in row, row["error"]
            assert row["n"] == 3 and row["timeouts"] == 0
    reports = result["load"]
    assert [report["load"] for report in reports] == ["snapshot-endpoint"] * clients
    summary = result["snapshot_clients"]
    assert summary["clients"] == clients and summary["requests"] > 0
    assert summary["wrong_events"] == summary["malformed"] == 0
    # 512 one-block stores in the replies: far more than a reply of an empty rank.
    assert summary["reply_bytes"] > 512 * 16
    assert result["daemon"]["alive_at_end"]


def test_bench_host_tier_fills_both_tiers_promotes_and_keeps_the_host_tier_on_resets() -> None:
    result = bench("host-tier", "--pool-blocks", "2048", "--host-blocks", "4096", "--resets", "3")
    assert result["host_blocks_cached"] == result["host_blocks_after"] == 4096
    assert result["promoted_fraction"] == 1.0  # every block of those prompts came back
    assert result["reset"]["n"] == 3 and result["reset"]["p50_us"] > 0


def test_bench_groups_publishes_both_groups_and_times_resets_of_each_layout() -> None:
    result = bench(
        "groups",
        *("--requests", "60", "--num-blocks", "65536", "--window-tokens", "64"),
        *("--fill-blocks", "1024", "--resets", "3"),
    )
    one, two = result["one_group"], result["two_groups"]
    assert one["gaps"] == two["gaps"] == 0
    # No eviction (60 prompts of at most 512 blocks): every block is stored in both groups.
    assert two["blocks"] == 2 * one["blocks"]
    for layout in (one, two):
        assert layout["reset"]["0"]["n"] == 3 and layout["reset"]["1024"]["p50_us"] > 0


@pytest.mark.skipif(not kv_events_path().is_file(), reason="vLLM's kv_events.py not extracted")
def test_bench_relay_counts_every_event_on_both_streams_and_times_resets() -> None:
    # 2 stores x 4 blocks a batch into an engine pool of 32 blocks: from batch 4 on, each
    # batch also evicts 8 blocks, one BlockRemoved each.
    result = bench(
        "relay", "--batches", "12", "--paced-batches", "3", "--paced-interval-ms", "1",
        "--stores-per-batch", "2", "--blocks-per-store", "4", "--engine-pool-blocks", "32",
        "--resets", "3", "--idle-ms", "1", "--loaded-resets", "2",
    )  # fmt: skip
    for phase, batches in (("saturated", 12), ("paced", 3)):
        report = result[phase]
        first = 0 if phase == "saturated" else 12
        evictions = sum(8 for i in range(first, first + batches) if i >= 4)
        assert report["expected"] == {
            "events": 2 * batches + evictions,
            "stored_blocks": 8 * batches,
            "removed_blocks": evictions,
        }
        for stream in ("engine", "kvpubd"):
            got = report[stream]
            # kvpubd republished each block of the engine once: no store repeated, no removal
            # dropped, nothing lost, no marker (removals back to back go out as one event,
            # and batches that came together as one batch).
            blocks = ("stored_blocks", "removed_blocks")
            assert {k: got[k] for k in blocks} == {k: report["expected"][k] for k in blocks}
            assert got["events_per_s"] > 0
            assert got["missing_seqs"] == 0 and got["markers"] == 0
        assert report["engine"]["events"] == report["expected"]["events"]
        assert report["engine"]["batches"] == batches
        assert report["lost_batches"] == {"engine": 0, "kvpubd": 0}
        assert report["added_latency"]["n"] == batches
    assert result["resets"]["n"] == 3 and result["resets"]["reply"]["n"] == 3
    # While the engine publishes 12 more at 90 % of kvpubd's saturated rate: the first reset
    # once kvpubd relays them, a second if they last.
    busy = result["loaded_resets"]
    assert 1 <= busy["n"] <= 2 and busy["reply"]["n"] == busy["n"]


def test_bench_relay_is_skipped_cleanly_without_vllms_file(tmp_path: Path) -> None:
    missing = tmp_path / "kv_events.py"
    result = bench("relay", env={ENV_VAR: str(missing)})
    assert str(missing) in result["skipped"]
