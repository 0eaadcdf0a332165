"""``kvpubd bench``: measurements of a real daemon, the way its users will judge it. Each
command lives with its measurement in a module of its own; this one only assembles them."""

from __future__ import annotations

import typer

from kvpubd.tools.bench_blockpool import bench_blockpool
from kvpubd.tools.bench_groups import bench_groups
from kvpubd.tools.bench_host_tier import bench_host_tier
from kvpubd.tools.bench_index import bench_index
from kvpubd.tools.bench_kernels_command import bench_kernels
from kvpubd.tools.bench_publisher import bench_publisher, bench_vllm_extract
from kvpubd.tools.bench_relay import bench_relay
from kvpubd.tools.bench_reset import bench_reset
from kvpubd.tools.bench_snapshot import bench_snapshot
from kvpubd.tools.bench_store_rtt import bench_store_rtt
from kvpubd.tools.bench_throughput import bench_throughput
from kvpubd.tools.bench_tiers import bench_tiers
from kvpubd.tools.soak import bench_soak

bench_app = typer.Typer(
    help="Measure a real daemon (started here, on loopback).",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help: flags without a <bool>, long names wrapped, not cut
)
# In this order in `kvpubd bench --help`.
bench_app.command("reset")(bench_reset)
bench_app.command("kernels")(bench_kernels)
bench_app.command("tiers")(bench_tiers)
bench_app.command("index")(bench_index)
bench_app.command("store-rtt")(bench_store_rtt)
bench_app.command("publisher")(bench_publisher)
bench_app.command("vllm-extract")(bench_vllm_extract)
bench_app.command("throughput")(bench_throughput)
bench_app.command("relay")(bench_relay)
bench_app.command("blockpool")(bench_blockpool)
bench_app.command("snapshot")(bench_snapshot)
bench_app.command("soak")(bench_soak)
bench_app.command("host-tier")(bench_host_tier)
bench_app.command("groups")(bench_groups)
