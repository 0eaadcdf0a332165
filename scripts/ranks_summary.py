"""What `scripts/h200-bench.sh ranks` measured, against the targets: blocks/s and the service's
CPU per block at each rank count, the 8-rank rate over vLLM's bare publisher (target >= 1.5x,
0 gaps, every batch decoded by vLLM's types), and each rank's reset -> marker p99 at 8 ranks,
idle and under load (target <= 5 ms on every rank).

    python3 scripts/ranks_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESET_P99_TARGET_US = 5000
RATE_TARGET = 1.5


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def main(out: Path) -> None:
    runs = [(f"{r} on", out / f"ranks-{r}.json") for r in (1, 2, 4, 8)]
    runs.append(("8 off", out / "ranks-8-off.json"))
    print("ranks  blocks/s   service us/block  parent us/block  sender busy  gaps  decoded by")
    for label, path in runs:
        run = _load(path)
        if run is None:
            print(f"{label:6} (no result: {path.name})")
            continue
        print(
            f"{label:6} {run['blocks_per_s']:>9,}  {run['daemon_cpu_us_per_block']:>16}  "
            f"{run['parent_cpu_us_per_block']:>15}  {run['sender_cpu_busy_max']:>11}  "
            f"{run['gaps'] + run['undecodable_batches']:>4}  {run['decoded_by']}"
        )
    eight, publisher = _load(out / "ranks-8.json"), _load(out / "ranks-publisher-d4.json")
    if eight and publisher and "vllm_blocks_per_s" in publisher:
        ratio = eight["blocks_per_s"] / publisher["vllm_blocks_per_s"]
        verdict = "met" if ratio >= RATE_TARGET else "missed"
        print(
            f"8 ranks: {eight['blocks_per_s']:,} blocks/s = {ratio:.2f}x vLLM's publisher "
            f"({publisher['vllm_blocks_per_s']:,}); target {RATE_TARGET}x: {verdict}"
        )
    resets = _load(out / "ranks-8-resets.json")
    if resets is None:
        return
    per_rank = resets["per_rank_resets"]
    for phase in per_rank["phases"]:
        label = f"{phase['load_fraction']:.0%} load" if phase["load_fraction"] else "idle"
        p99s = [row["p99_us"] for row in phase["per_rank"]]
        verdict = "met" if max(p99s) <= RESET_P99_TARGET_US else "missed"
        rate = f", {phase['stores_per_s']} stores/s" if phase["load_fraction"] else ""
        print(
            f"resets, {label}{rate}: n {phase['rounds']}, per-rank p99 "
            f"{min(p99s) / 1000:.2f}-{max(p99s) / 1000:.2f} ms (slowest rank p99 "
            f"{phase['slowest_rank']['p99_us'] / 1000:.2f} ms, max "
            f"{phase['slowest_rank']['max_us'] / 1000:.2f} ms), missing markers "
            f"{phase['missing_markers']}; target p99 <= 5 ms on every rank: {verdict}"
        )
        floor = phase.get("floor")
        if floor:
            floors = [row["p99_us"] for row in floor["per_rank"]]
            print(
                f"  the same fan-out in bare pyzmq, alternated: per-rank p99 "
                f"{min(floors) / 1000:.2f}-{max(floors) / 1000:.2f} ms (slowest rank p99 "
                f"{floor['slowest_rank']['p99_us'] / 1000:.2f} ms, max "
                f"{floor['slowest_rank']['max_us'] / 1000:.2f} ms)"
            )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out"))
