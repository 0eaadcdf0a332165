"""The ``kvpubd`` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kvpubd import __version__
from kvpubd.client import ControlClient, ControlError, ControlTimeout
from kvpubd.client.subscriber import Subscriber, SubscriberError
from kvpubd.protocol.config import (
    ConfigError,
    Settings,
    default_control_endpoint,
    load_settings,
)
from kvpubd.protocol.wire import BlockRemoved, BlockStored, Event

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
        # The variable that sets the daemon's own endpoint (the systemd unit and the image set it).
        envvar="KVPUBD_CONTROL__ENDPOINT",
        help="Control endpoint of the daemon [default: the daemon's default ipc socket].",
    ),
]
TimeoutOption = Annotated[float, typer.Option(help="Seconds to wait for the daemon's reply.")]


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"kvpubd: {message}", err=True)
    return typer.Exit(code)


CurveKeyOption = Annotated[
    Path | None,
    typer.Option(
        "--curve-key",
        envvar="KVPUBD_CURVE_KEY",
        help="This client's secret certificate, for a daemon with CURVE on.",
    ),
]
ServerKeyOption = Annotated[
    Path | None,
    typer.Option(
        "--server-key",
        envvar="KVPUBD_SERVER_KEY",
        help="The daemon's public certificate, for a daemon with CURVE on.",
    ),
]


def _curve(curve_key: Path | None, server_key: Path | None) -> tuple[Path, Path] | None:
    if curve_key is None and server_key is None:
        return None
    if curve_key is None or server_key is None:
        raise _fail("CURVE needs both --curve-key and --server-key", code=2)
    return curve_key, server_key


def _call(
    control: str | None,
    timeout: float,
    op: str,
    curve: tuple[Path, Path] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    from kvpubd.protocol.auth import AuthError

    try:
        client = ControlClient(control or default_control_endpoint(), timeout, curve=curve)
    except AuthError as exc:
        raise _fail(str(exc), code=2) from None
    with client:
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
    kv_events_config: Annotated[
        str | None,
        typer.Option(
            "--kv-events-config",
            help="vLLM's --kv-events-config JSON (or @file): its fields set [events] over "
            "--config; KVPUBD_* env still wins.",
        ),
    ] = None,
) -> None:
    """Run the daemon until SIGTERM or SIGINT."""
    import zmq

    from kvpubd.daemon import logs
    from kvpubd.daemon.pool import PoolDoesNotFit, check_device
    from kvpubd.daemon.service import StartupError, TaskFailed, run
    from kvpubd.protocol.auth import check_curve_settings
    from kvpubd.protocol.vllm_config import load_kv_events_config

    try:
        vllm = load_kv_events_config(kv_events_config) if kv_events_config else None
        settings = load_settings(config, {"events": vllm.events} if vllm else None)
        check_device(settings.cache.device)
        check_curve_settings(settings.control)
    except ConfigError as exc:
        raise _fail(f"config error: {exc}", code=2) from None
    except ValueError as exc:
        raise _fail(f"config error: cache.device: {exc}", code=2) from None
    if log_level is not None and log_level.lower() not in logs.LEVELS:
        raise _fail(f"--log-level: {log_level!r} is not one of {', '.join(logs.LEVELS)}", code=2)
    logs.configure(log_level or settings.service.log_level)

    def reload_settings() -> Settings:
        """SIGHUP: the config as it is now; --log-level stays in force over the file's."""
        fresh = load_settings(config, {"events": vllm.events} if vllm else None)
        if log_level is None:
            return fresh
        service = fresh.service.model_copy(update={"log_level": log_level.lower()})
        return fresh.model_copy(update={"service": service})

    # Logged once the daemon holds its endpoint: a refused second daemon says one line.
    start_lines = [f"kvpubd {__version__}: config {config if config else '(defaults)'}"]
    if vllm is not None:
        start_lines.append(vllm.describe())
    try:
        run(settings, reload_settings, start_lines)
    except PoolDoesNotFit as exc:
        raise _fail(f"cannot start: {exc}", code=2) from None
    except (OSError, zmq.ZMQError, StartupError) as exc:  # e.g. an endpoint already in use
        raise _fail(f"cannot start: {exc}", code=1) from None
    except TaskFailed as exc:
        raise _fail(f"stopped: {exc}", code=1) from None


@app.command()
def keys(
    directory: Annotated[Path, typer.Argument(help="Where to write the certificates.")],
    name: Annotated[str, typer.Option(help="Certificate name: NAME.key and NAME.key_secret.")] = (
        "kvpubd"
    ),
) -> None:
    """Write a CURVE certificate pair (public NAME.key, owner-only NAME.key_secret) for
    control.curve_secret_key (the daemon) or --curve-key (a client); put clients' NAME.key
    files in the daemon's control.curve_authorized_keys directory."""
    from kvpubd.protocol.auth import create_keys

    public, secret = create_keys(directory, name)
    typer.echo(f"public: {public}\nsecret: {secret}")


@app.command()
def reset(
    control: ControlOption = None,
    rank: Annotated[int | None, typer.Option(help="Reset only this rank [default: all].")] = None,
    force: Annotated[bool, typer.Option(help="Reset even while requests pin blocks.")] = False,
    timeout: TimeoutOption = 5.0,
    curve_key: CurveKeyOption = None,
    server_key: ServerKeyOption = None,
) -> None:
    """Clear the cache and publish AllBlocksCleared at once; print each rank's marker seq."""
    fields: dict[str, Any] = {"force": force}
    if rank is not None:
        fields["rank"] = rank
    curve = _curve(curve_key, server_key)
    for marker in _call(control, timeout, "reset", curve, **fields)["markers"]:
        typer.echo(f"rank {marker['rank']}: marker seq {marker['seq']}")


@app.command()
def stats(
    control: ControlOption = None,
    timeout: TimeoutOption = 5.0,
    curve_key: CurveKeyOption = None,
    server_key: ServerKeyOption = None,
) -> None:
    """Print the daemon's counters as JSON."""
    reply = _call(control, timeout, "stats", _curve(curve_key, server_key))
    reply.pop("ok", None)
    reply.pop("id", None)
    typer.echo(json.dumps(reply, indent=2))


@app.command()
def ping(
    control: ControlOption = None,
    timeout: TimeoutOption = 5.0,
    curve_key: CurveKeyOption = None,
    server_key: ServerKeyOption = None,
) -> None:
    """Check that the daemon answers; print its version, epoch and endpoints."""
    reply = _call(control, timeout, "ping", _curve(curve_key, server_key))
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
    control: Annotated[
        str | None,
        typer.Option(
            "--control",
            "-c",
            help="Control endpoint: checks the daemon's epoch on gaps and resynchronises from "
            "its snapshot when replay no longer holds the missing history [default: off].",
        ),
    ] = None,
) -> None:
    """Print every published event, one per line; repair gaps through replay (or the snapshot,
    with --control) and report gaps, resyncs, restarts and losses on stderr."""
    try:
        _print_events(endpoint, replay_endpoint, ranks, topic, as_json, count, timeout, control)
    except TimeoutError as exc:
        raise _fail(f"{exc} (is the daemon running?)") from None
    except (ControlError, SubscriberError) as exc:
        raise _fail(str(exc)) from None


def _print_events(
    endpoint: str,
    replay_endpoint: str,
    ranks: int,
    topic: str,
    as_json: bool,
    count: int | None,
    timeout: float,
    control: str | None = None,
) -> None:
    def note(message: str) -> None:
        typer.echo(f"# {message}", err=True)

    repair = "replay" if replay_endpoint else "the snapshot"
    seen = 0
    with Subscriber(
        endpoint,
        replay_endpoint or None,
        control=control,
        ranks=ranks,
        topic=topic,
        replay_timeout=timeout,
        control_timeout=timeout,
        idle_check=1.0,  # finds a tail the PUB dropped while nothing else is published
        mirror=False,  # printing needs no copy of the cache
        on_gap=lambda rank, first, seq: note(
            f"gap on rank {rank}: seqs {first}..{seq - 1} missing, repairing through {repair}"
        ),
        on_resync=lambda rank, seq: note(
            f"rank {rank}: history gone; mirror rebuilt (snapshot or reset marker) at seq {seq}"
        ),
        on_restart=lambda rank, reason: note(
            f"rank {rank}: daemon restart ({reason}); following the new run from its first "
            "retained batch"
        ),
    ) as subscriber:
        lost = dict.fromkeys(subscriber.ranks, 0)
        try:
            for received in subscriber:
                rank = received.rank
                now_lost = subscriber.rank_counters(rank).lost
                if now_lost != lost[rank]:
                    note(
                        f"rank {rank}: {now_lost - lost[rank]} batch(es) lost: replay no longer "
                        "holds them (pass --control to resynchronise from the snapshot)"
                    )
                    lost[rank] = now_lost
                for event in received.batch.events:
                    if as_json:
                        line = json.dumps({"rank": rank, "seq": received.seq, **event_json(event)})
                    else:
                        line = f"rank={rank} seq={received.seq} {describe_event(event)}"
                    typer.echo(line)
                    seen += 1
                    if count is not None and seen >= count:
                        return
        except KeyboardInterrupt:
            pass


@app.command()
def demo(
    duration: Annotated[float, typer.Option(help="Seconds the demo runs (at least 2).")] = 10.0,
    rate: Annotated[float, typer.Option(help="Requests per second of the load.")] = 200.0,
) -> None:
    """Run a daemon, a load and a subscriber here on CPU, live, with a reset; then summarize."""
    from kvpubd.tools.demo import run_demo

    if not 2 <= duration <= 3600:
        raise _fail(f"--duration: {duration} is not between 2 and 3600 seconds", code=2)
    if not 0 < rate <= 10_000:
        raise _fail(f"--rate: {rate} is not between 0 and 10000 requests per second", code=2)
    raise typer.Exit(run_demo(duration=duration, rate=rate))


@app.command()
def loadgen(
    control: ControlOption = None,
    rate: Annotated[float, typer.Option(help="Requests per second (Poisson arrivals).")] = 50.0,
    duration: Annotated[float, typer.Option(help="Seconds to run.")] = 10.0,
    prompt_mix: Annotated[
        str, typer.Option(help="Weights of the prompt kinds chat, doc and unique.")
    ] = "chat=5,doc=3,unique=2",
    hold: Annotated[
        float, typer.Option(help="Seconds each request stays open, pinning its blocks.")
    ] = 0.1,
    seed: Annotated[int, typer.Option(help="Seed of the prompts.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    timeout: TimeoutOption = 5.0,
) -> None:
    """Drive a running daemon with a shared-prefix workload: store, hold, release."""
    from kvpubd.tools.loadgen import LoadGenerator, Workload, parse_mix

    try:
        mix = parse_mix(prompt_mix)
    except ValueError as exc:
        raise _fail(f"--prompt-mix: {exc}", code=2) from None
    for name, value, low in (("--rate", rate, 0.0), ("--duration", duration, 0.0)):
        if not low < value < float("inf"):
            raise _fail(f"{name}: {value} must be a positive number", code=2)
    if not 0 <= hold < float("inf"):
        raise _fail(f"--hold: {hold} must be >= 0", code=2)
    with ControlClient(control or default_control_endpoint(), timeout=timeout) as client:
        try:
            generator = LoadGenerator(client, Workload(mix, seed), rate=rate, hold=hold, seed=seed)
            try:
                generator.run(duration)
            except KeyboardInterrupt:
                generator.release_all()
        except ControlTimeout as exc:
            raise _fail(f"{exc} (is the daemon running?)") from None
    summary = generator.stats.as_dict()
    if as_json:
        typer.echo(json.dumps(summary))
        return
    errors = ", ".join(f"{code} {n}" for code, n in sorted(summary["errors"].items())) or "none"
    typer.echo(
        f"{summary['requests']} requests in {summary['elapsed_s']:.1f} s "
        f"({summary['rate']:.1f}/s), prefix hit rate {summary['hit_rate']:.1%}, "
        f"errors: {errors}"
    )


def _add_bench() -> None:
    from kvpubd.tools.bench import bench_app

    app.add_typer(bench_app, name="bench")


_add_bench()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--version":
        print(__version__)
        return
    app()
