"""``kvpubd bench publisher``: the in-process publisher's events/s beside a bare pyzmq floor,
or (``--against-vllm``) blocks/s beside vLLM's own publisher; and ``kvpubd bench vllm-extract``,
which fetches vLLM's kv_events.py for that comparison."""

from __future__ import annotations

import json
import time
import zipfile
from typing import Annotated, Any

import msgpack
import numpy as np
import typer
import zmq
from rich.console import Console
from rich.table import Table

from kvpubd.exits import check_positive
from kvpubd.tools.bench_report import err


def _publisher_batches(count: int, events_per_batch: int, seed: int = 0) -> list[list[Any]]:
    """Realistic batches: 80 % BlockStored of 1-32 blocks of 16 tokens, 20 % BlockRemoved."""
    from kvpubd.protocol.wire import BlockRemoved, BlockStored

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(count):
        events: list[Any] = []
        for _ in range(events_per_batch):
            if rng.random() < 0.8:
                blocks = int(rng.integers(1, 33))
                events.append(
                    BlockStored(
                        block_hashes=rng.integers(0, 2**63, size=blocks).tolist(),
                        parent_block_hash=int(rng.integers(0, 2**63)),
                        token_ids=rng.integers(0, 150_000, size=16 * blocks).tolist(),
                        block_size=16,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                )
            else:
                events.append(
                    BlockRemoved(block_hashes=rng.integers(0, 2**63, size=4).tolist(), medium="GPU")
                )
        batches.append(events)
    return batches


def measure_publisher(batches: int, events_per_batch: int, rounds: int) -> dict[str, Any]:
    """``Publisher.publish(events)`` against the floor: msgpack-encoding the same events
    (pre-converted to their wire form) and sending them on a bare PUB. The publisher keeps
    each seq in a state file, as the daemon does under the default ``seq_origin``."""
    import tempfile
    from pathlib import Path

    from kvpubd.daemon.publisher import Publisher
    from kvpubd.daemon.seq_state import SeqState
    from kvpubd.protocol.wire import event_to_wire, pack_seq

    data = _publisher_batches(batches, events_per_batch)
    wire = [[event_to_wire(e, "map") for e in batch] for batch in data]
    total = batches * events_per_batch
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="kvpb") as tmp:
        seq_state = SeqState.open(Path(tmp) / "rank0.seq")
        publisher = Publisher.over_zmq(
            ctx,
            endpoint=f"ipc://{tmp}/ours",
            hwm=0,
            buffer_steps=batches,
            record_seq=seq_state.record,
        )
        floor_pub = ctx.socket(zmq.PUB)
        floor_pub.setsockopt(zmq.SNDHWM, 0)
        floor_pub.bind(f"ipc://{tmp}/floor")
        subs = []
        for endpoint in (f"ipc://{tmp}/ours", f"ipc://{tmp}/floor"):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            subs.append(sub)
        # Both PUBs deliver to a connected subscriber, drained between rounds.
        while not subs[0].poll(10):
            publisher.publish([])
        while not subs[1].poll(10):
            floor_pub.send_multipart([b"", pack_seq(0), msgpack.packb([0.0, [], 0])])

        def drain() -> None:
            for sub in subs:
                while sub.poll(0):
                    sub.recv_multipart()

        packer = msgpack.Packer(use_bin_type=True)
        ours, floor = [], []
        for _ in range(rounds):
            drain()
            start = time.perf_counter()
            for batch in data:
                publisher.publish(batch)
            ours.append(total / (time.perf_counter() - start))
            drain()
            start = time.perf_counter()
            for seq, batch in enumerate(wire):
                payload = packer.pack([time.time(), batch, 0])
                floor_pub.send_multipart([b"", pack_seq(seq), payload])
            floor.append(total / (time.perf_counter() - start))
        drain()
        publisher.close()
        seq_state.close()
        floor_pub.close(linger=0)
        for sub in subs:
            sub.close(linger=0)
    ctx.term()
    ours_median, floor_median = float(np.median(ours)), float(np.median(floor))
    return {
        "events_per_s": round(ours_median),
        "floor_events_per_s": round(floor_median),
        "ratio": round(ours_median / floor_median, 3),
        "batches": batches,
        "events_per_batch": events_per_batch,
        "rounds": rounds,
    }


def bench_publisher(
    batches: Annotated[int, typer.Option(help="Pre-built batches per round.")] = 2000,
    events_per_batch: Annotated[int, typer.Option(help="Events per batch (floor mode).")] = 20,
    rounds: Annotated[int, typer.Option(help="Alternating rounds (median reported).")] = 7,
    against_vllm: Annotated[
        bool,
        typer.Option(
            "--against-vllm",
            help="Beside vLLM's own ZmqEventPublisher on identical batches (8 BlockStored x 16 "
            "blocks x 16 tokens), each stream decoded in another process by vLLM's KVEventBatch. "
            "Needs vLLM's kv_events.py: $KVPUBD_VLLM_KV_EVENTS or "
            "~/.cache/kvpubd/vllm/kv_events.py (see `kvpubd bench vllm-extract`).",
        ),
    ] = False,
    decoders: Annotated[
        int,
        typer.Option(
            help="With --against-vllm: decoding processes per stream, sharing its batches "
            "(one decodes each batch). One process decodes more slowly than either publisher "
            "publishes; with enough of them the publishers set the rate.",
        ),
    ] = 1,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object on stdout.")
    ] = False,
) -> None:
    """In-process publisher events/s on identical pre-built batches, beside the floor: a plain
    loop that msgpack-encodes the same batches and sends them on a bare pyzmq PUB; or, with
    --against-vllm, blocks/s beside vLLM's own publisher."""
    for option, value in (
        ("--batches", batches),
        ("--events-per-batch", events_per_batch),
        ("--rounds", rounds),
        ("--decoders", decoders),
    ):
        check_positive(option, value, integer=True)
    if against_vllm:
        _bench_against_vllm(batches, rounds, decoders, as_json)
        return
    with err.status(f"publishing {rounds} x {batches} batches, ours and the floor"):
        result = measure_publisher(batches, events_per_batch, rounds)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(
        title=f"publisher: {batches} batches x {events_per_batch} events, median of {rounds}"
    )
    for column in ("kvpubd events/s", "floor events/s", "kvpubd / floor"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result['events_per_s']:,}", f"{result['floor_events_per_s']:,}", f"{result['ratio']:.0%}"
    )
    Console().print(table)


def _bench_against_vllm(batches: int, rounds: int, decoders: int, as_json: bool) -> None:
    from kvpubd.tools import vllm_peer, vllm_source

    path = vllm_source.kv_events_path()
    if not path.is_file():
        reason = (
            f"vLLM's kv_events.py not found at {path}: set {vllm_source.ENV_VAR} or run "
            "`kvpubd bench vllm-extract WHEEL`; comparison skipped"
        )
        err.print(f"kvpubd: {reason}")
        if as_json:
            typer.echo(json.dumps({"skipped": reason}))
        return
    with err.status(f"{rounds} alternating rounds of {batches} batches, kvpubd and vLLM"):
        result = vllm_peer.measure_against_vllm(batches, rounds, path, decoders)
    if as_json:
        typer.echo(json.dumps(result))
        return
    table = Table(
        title=f"publisher vs vLLM's ZmqEventPublisher: {batches} batches of {result['batch']}, "
        f"median of {rounds}, {decoders} decoding process(es) per stream",
        caption="blocks/s from the first publish to the last decode (vLLM's KVEventBatch); "
        "decoder busy: share of a round the busiest decoding process spent decoding (near "
        "100 %: the decoders, not the publisher, set the rate; add --decoders)",
    )
    for column in (
        "kvpubd blocks/s",
        "vLLM blocks/s",
        "kvpubd / vLLM",
        "paired rounds",
        "kvpubd CPU us/block",
        "vLLM CPU us/block",
        "CPU vLLM / kvpubd (paired)",
        "decoder busy kvpubd / vLLM",
    ):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result['kvpubd_blocks_per_s']:,}",
        f"{result['vllm_blocks_per_s']:,}",
        f"{result['ratio']:.2f}x",
        f"{result['paired_ratio']:.2f}x",
        f"{result['kvpubd_cpu_us_per_block']:.3f}",
        f"{result['vllm_cpu_us_per_block']:.3f}",
        f"{result['cpu_ratio']:.2f}x ({result['paired_cpu_ratio']:.2f}x)",
        f"{result['decoder_busy']['kvpubd']:.0%} / {result['decoder_busy']['vllm']:.0%}",
    )
    Console().print(table)


def bench_vllm_extract(
    wheel: Annotated[str, typer.Argument(help="A vLLM wheel (pip download vllm --no-deps).")],
) -> None:
    """Copy the vLLM files the comparisons load (kv_events.py, block_pool.py and what it runs
    on) out of a vLLM wheel, unmodified, to where they are looked for: $KVPUBD_VLLM_DIR, else
    ~/.cache/kvpubd/vllm/ ($KVPUBD_VLLM_KV_EVENTS for kv_events.py). Prints each file."""
    from pathlib import Path

    from kvpubd.tools import vllm_source

    try:
        written = vllm_source.extract_from_wheel(Path(wheel))
    except KeyError as exc:
        err.print(f"kvpubd: {wheel} is not a vLLM wheel with the files needed: {exc}")
        raise typer.Exit(1) from None
    except (OSError, zipfile.BadZipFile) as exc:
        err.print(f"kvpubd: cannot extract vLLM's files from {wheel}: {exc}")
        raise typer.Exit(1) from None
    for path in written:
        typer.echo(str(path))
