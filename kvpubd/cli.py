"""The ``kvpubd`` command line."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvpubd import __version__
from kvpubd.client import ControlClient, ControlError, ControlTimeout, Subscriber
from kvpubd.config import ConfigError, default_control_endpoint, load_settings
from kvpubd.wire import BlockRemoved, BlockStored, Event

app = typer.Typer(
    help="kvpubd: a KV-cache sidecar that publishes cache events over ZeroMQ, resets at once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ControlOption = Annotated[
    str | None,
    typer.Option(
        "--control",
        "-c",
        help="Control endpoint of the daemon [default: the daemon's default ipc socket].",
    ),
]
TimeoutOption = Annotated[float, typer.Option(help="Seconds to wait for the daemon's reply.")]


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"kvpubd: {message}", err=True)
    return typer.Exit(code)


def _call(control: str | None, timeout: float, op: str, **fields: Any) -> dict[str, Any]:
    with ControlClient(control or default_control_endpoint(), timeout=timeout) as client:
        try:
            return client.call(op, **fields)
        except ControlTimeout as exc:
            raise _fail(f"{exc} (is the daemon running?)") from None
        except ControlError as exc:
            raise _fail(str(exc)) from None


@app.command()
def serve(
    config: Annotated[
        Path | None,
        typer.Option("--config", help="TOML config file; KVPUBD_* env overrides it."),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="debug, info, warning or error [default: from config].")
    ] = None,
) -> None:
    """Run the daemon until SIGTERM or SIGINT."""
    import zmq

    from kvpubd.pool import check_device
    from kvpubd.service import StartupError, run

    try:
        settings = load_settings(config)
        check_device(settings.cache.device)
    except ConfigError as exc:
        raise _fail(f"config error: {exc}", code=2) from None
    except ValueError as exc:
        raise _fail(f"config error: cache.device: {exc}", code=2) from None
    level = (log_level or settings.service.log_level).upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("kvpubd").info(
        "kvpubd %s: config %s", __version__, config if config else "(defaults)"
    )
    try:
        run(settings)
    except (OSError, zmq.ZMQError, StartupError) as exc:  # e.g. an endpoint already in use
        raise _fail(f"cannot start: {exc}", code=1) from None


@app.command()
def reset(
    control: ControlOption = None,
    rank: Annotated[int | None, typer.Option(help="Reset only this rank [default: all].")] = None,
    force: Annotated[bool, typer.Option(help="Reset even while requests pin blocks.")] = False,
    timeout: TimeoutOption = 5.0,
) -> None:
    """Clear the cache and publish AllBlocksCleared at once; print each rank's marker seq."""
    fields: dict[str, Any] = {"force": force}
    if rank is not None:
        fields["rank"] = rank
    for marker in _call(control, timeout, "reset", **fields)["markers"]:
        typer.echo(f"rank {marker['rank']}: marker seq {marker['seq']}")


@app.command()
def stats(control: ControlOption = None, timeout: TimeoutOption = 5.0) -> None:
    """Print the daemon's counters as JSON."""
    reply = _call(control, timeout, "stats")
    reply.pop("ok", None)
    reply.pop("id", None)
    typer.echo(json.dumps(reply, indent=2))


@app.command()
def ping(control: ControlOption = None, timeout: TimeoutOption = 5.0) -> None:
    """Check that the daemon answers; print its version, epoch and endpoints."""
    reply = _call(control, timeout, "ping")
    typer.echo(json.dumps({k: v for k, v in reply.items() if k not in ("ok", "id")}))


def describe_event(event: Event) -> str:
    if isinstance(event, BlockStored):
        return (
            f"BlockStored blocks={len(event.block_hashes)} parent={event.parent_block_hash} "
            f"first={event.block_hashes[0]} lora={event.lora_id} medium={event.medium}"
        )
    if isinstance(event, BlockRemoved):
        return f"BlockRemoved blocks={len(event.block_hashes)} first={event.block_hashes[0]}"
    return "AllBlocksCleared"


def event_json(event: Event) -> dict[str, Any]:
    fields = {
        name: (value.hex() if isinstance(value, bytes) else value)
        for name, value in ((n, getattr(event, n)) for n in getattr(event, "__slots__", ()))
    }
    for key in ("block_hashes",):
        if key in fields:
            fields[key] = [h.hex() if isinstance(h, bytes) else h for h in fields[key]]
    return {"type": type(event).__name__, **fields}


@app.command()
def subscribe(
    endpoint: Annotated[
        str, typer.Option("--endpoint", "-e", help="The daemon's events endpoint (rank 0's port).")
    ] = "tcp://127.0.0.1:5557",
    replay_endpoint: Annotated[
        str, typer.Option("--replay", help="Replay endpoint (rank 0's port); '' turns repair off.")
    ] = "tcp://127.0.0.1:5657",
    ranks: Annotated[int, typer.Option(help="How many data-parallel ranks to follow.")] = 1,
    topic: Annotated[str, typer.Option(help="Topic prefix to subscribe to.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per event.")] = False,
    count: Annotated[
        int | None, typer.Option(help="Exit after this many events [default: run forever].")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a replay to finish.")] = 5.0,
) -> None:
    """Print every published event, one per line; report gaps and repair them through replay."""
    try:
        _print_events(endpoint, replay_endpoint, ranks, topic, as_json, count, timeout)
    except TimeoutError as exc:
        raise _fail(f"{exc} (is the daemon running?)") from None


def _print_events(
    endpoint: str,
    replay_endpoint: str,
    ranks: int,
    topic: str,
    as_json: bool,
    count: int | None,
    timeout: float,
) -> None:
    seen = 0
    with Subscriber(
        endpoint, replay_endpoint or None, ranks=ranks, topic=topic, replay_timeout=timeout
    ) as subscriber:
        gaps = 0
        try:
            for received in subscriber:
                if subscriber.counters.gaps != gaps:
                    gaps = subscriber.counters.gaps
                    typer.echo(
                        f"# gap on rank {received.rank}: repaired through replay "
                        f"(gaps {gaps}, lost {subscriber.counters.lost})",
                        err=True,
                    )
                for event in received.batch.events:
                    if as_json:
                        line = json.dumps(
                            {"rank": received.rank, "seq": received.seq, **event_json(event)}
                        )
                    else:
                        line = f"rank={received.rank} seq={received.seq} {describe_event(event)}"
                    typer.echo(line)
                    seen += 1
                    if count is not None and seen >= count:
                        return
        except KeyboardInterrupt:
            pass


def _add_bench() -> None:
    from kvpubd.bench import bench_app

    app.add_typer(bench_app, name="bench")


_add_bench()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--version":
        print(__version__)
        return
    app()
