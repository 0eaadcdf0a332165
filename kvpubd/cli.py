"""The ``kvpubd`` command line.

Each command imports what it runs, inside the command: ``kvpubd serve`` loads the daemon and
never the client library, rich or the tools; ``kvpubd bench`` loads its sub-commands only when
it is the command given. Every mistake ends in one line on stderr and the exit statuses of
``kvpubd.exits`` (0 ok, 1 runtime failure, 2 usage or config, 130 interrupted, 143
terminated)."""

from __future__ import annotations

import enum
import errno
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvpubd import __version__, interrupts
from kvpubd.exits import (
    FAILURE,
    HUNG_UP,
    INTERRUPTED,
    OK,
    TERMINATED,
    USAGE,
    check_positive,
    fail,
)
from kvpubd.protocol.endpoints import (
    CONTROL_ENDPOINT_ENV,
    CURVE_KEY_ENV,
    SERVER_KEY_ENV,
    base_endpoint,
    check_endpoint,
    default_control_endpoint,
    missing_ipc_socket,
)

if TYPE_CHECKING:
    from kvpubd.client import ControlClient, Received
    from kvpubd.protocol.wire import Event

MAX_RANKS = 64  # as the daemon's cache.data_parallel_size allows

app = typer.Typer(
    help="kvpubd: a KV-cache sidecar that publishes cache events over ZeroMQ, resets at once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: flags without a <bool>, long names wrapped, not cut
)


def _show_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit(OK)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_show_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """kvpubd: a KV-cache sidecar that publishes cache events over ZeroMQ, resets at once."""


ControlOption = Annotated[
    str | None,
    typer.Option(
        "--control",
        "-c",
        # The variable that sets the daemon's own endpoint (the systemd unit and the image set it).
        envvar=CONTROL_ENDPOINT_ENV,
        show_default=f"the daemon's default ipc socket, {default_control_endpoint()}",
        help="Control endpoint of the daemon.",
    ),
]
TimeoutOption = Annotated[float, typer.Option(help="Seconds to wait for the daemon's reply.")]
CurveKeyOption = Annotated[
    Path | None,
    typer.Option(
        "--curve-key",
        envvar=CURVE_KEY_ENV,
        help="This client's secret certificate (NAME.key_secret), for a daemon with CURVE on.",
    ),
]
ServerKeyOption = Annotated[
    Path | None,
    typer.Option(
        "--server-key",
        envvar=SERVER_KEY_ENV,
        help="The daemon's public certificate (NAME.key), for a daemon with CURVE on.",
    ),
]


def _endpoint(option: str, value: str) -> str:
    try:
        return check_endpoint(value)
    except ValueError as exc:
        raise fail(f"{option}: {exc}", USAGE) from None


def _curve(curve_key: Path | None, server_key: Path | None) -> tuple[Path, Path] | None:
    """Both certificates, checked readable; None for a daemon without CURVE."""
    if curve_key is None and server_key is None:
        return None
    if curve_key is None or server_key is None:
        raise fail("CURVE needs both --curve-key and --server-key", USAGE)
    from kvpubd.protocol.auth import AuthError, load_public_certificate, load_secret_certificate

    try:
        load_secret_certificate(curve_key)
        load_public_certificate(server_key)
    except AuthError as exc:
        raise fail(str(exc), USAGE) from None
    return curve_key, server_key


def _client(
    control: str | None,
    timeout: float,
    curve_key: Path | None,
    server_key: Path | None,
) -> ControlClient:
    """A control client for a command, every argument checked first (exit 2 when wrong)."""
    from_env = control is not None and control == os.environ.get(CONTROL_ENDPOINT_ENV)
    endpoint = _endpoint(
        CONTROL_ENDPOINT_ENV if from_env else "--control", control or default_control_endpoint()
    )
    check_positive("--timeout", timeout)
    curve = _curve(curve_key, server_key)
    from kvpubd.client import ControlClient

    return ControlClient(endpoint, timeout, curve=curve)


def _unreachable_hint(endpoint: str, curve: object) -> str:
    if missing_ipc_socket(endpoint):
        return "is the daemon running?"
    if curve is None:
        return (
            "is the daemon running? If it has CURVE on, pass --curve-key and --server-key "
            f"(or {CURVE_KEY_ENV} and {SERVER_KEY_ENV})"
        )
    return "is the daemon running, and is this client's public key in its authorised keys?"


class ResetTierOption(str, enum.Enum):
    """What ``kvpubd reset --tier`` clears (the control protocol's ``tier``)."""

    all = "all"
    gpu = "gpu"


@contextmanager
def _talking_to(client: ControlClient) -> Iterator[None]:
    """One line and exit 1 when the daemon refuses or does not answer."""
    from kvpubd.client import ControlError, ControlTimeout, SubscriberError

    try:
        yield
    except ControlTimeout as exc:
        raise fail(f"{exc} ({_unreachable_hint(client.endpoint, client.curve)})") from None
    except (ControlError, SubscriberError) as exc:
        raise fail(str(exc)) from None


@app.command()
def serve(
    config: Annotated[
        Path | None,
        typer.Option("--config", help="TOML config file; KVPUBD_* variables override it."),
    ] = None,
    log_level: Annotated[
        str | None,
        typer.Option(
            help="debug, info, warning or error, in any case.",
            show_default="service.log_level from the config",
        ),
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
    import logging

    import zmq

    from kvpubd.daemon import logs, serve_config
    from kvpubd.daemon.process_service import run
    from kvpubd.daemon.service import StartupError, TaskFailed
    from kvpubd.daemon.settings import ConfigError

    try:
        resolved = serve_config.resolve(
            config, log_level=log_level, kv_events_config=kv_events_config
        )
    except ConfigError as exc:
        raise fail(f"config error: {exc}", USAGE) from None
    logs.configure(resolved.settings.service.log_level)
    for message in resolved.warnings():
        logging.getLogger("kvpubd").warning("%s", message)
    try:
        run(resolved.settings, resolved.load, resolved.start_lines())
    except ConfigError as exc:  # what only starting can tell, e.g. the pool and /dev/shm
        raise fail(f"cannot start: {exc}", USAGE) from None
    except (OSError, zmq.ZMQError, StartupError) as exc:  # e.g. an endpoint already in use
        raise fail(f"cannot start: {exc}") from None
    except TaskFailed as exc:
        raise fail(f"stopped: {exc}") from None


@app.command()
def keys(
    directory: Annotated[Path, typer.Argument(help="Where to write the certificates.")],
    name: Annotated[
        str, typer.Option(help="Certificate name: NAME.key and NAME.key_secret.")
    ] = "kvpubd",
    force: Annotated[
        bool,
        typer.Option(help="Replace existing certificates (clients of the old key are locked out)."),
    ] = False,
) -> None:
    """Write a CURVE certificate pair: NAME.key (public) and NAME.key_secret (owner-only).

    The daemon takes the secret one as control.curve_secret_key, a client as --curve-key;
    clients' NAME.key files go in the daemon's control.curve_authorized_keys directory."""
    from kvpubd.protocol.auth import create_keys

    if not name or "/" in name:
        raise fail(f"--name: {name!r} is not a file name", USAGE)
    if directory.exists() and not directory.is_dir():  # (mkdir would call it "exists")
        raise fail(f"{directory} is not a directory", USAGE)
    try:
        public, secret = create_keys(directory, name, force=force)
    except FileExistsError as exc:
        raise fail(
            f"{exc.filename} exists; pass --force to replace it (clients holding the old "
            "public key are then locked out)",
            USAGE,
        ) from None
    except OSError as exc:
        raise fail(f"cannot write certificates in {directory}: {exc.strerror}") from None
    typer.echo(f"public: {public}\nsecret: {secret}")


@app.command()
def reset(
    control: ControlOption = None,
    rank: Annotated[
        int | None, typer.Option(help="Reset only this rank.", show_default="all")
    ] = None,
    force: Annotated[bool, typer.Option(help="Reset even while requests pin blocks.")] = False,
    tier: Annotated[
        ResetTierOption,
        typer.Option(help="all: the pool and the host tier; gpu: the pool alone."),
    ] = ResetTierOption.all,
    timeout: TimeoutOption = 5.0,
    curve_key: CurveKeyOption = None,
    server_key: ServerKeyOption = None,
) -> None:
    """Clear the cache and publish AllBlocksCleared at once; print each rank's marker seq."""
    if rank is not None and not 0 <= rank < MAX_RANKS:
        raise fail(f"--rank: {rank} is not between 0 and {MAX_RANKS - 1}", USAGE)
    client = _client(control, timeout, curve_key, server_key)
    with client, _talking_to(client):
        markers = client.reset(rank, force=force, tier=tier.value).markers
    for marker in markers:
        if marker.seq is None:
            typer.echo(f"rank {marker.rank}: marker held back until the next tick")
        else:
            typer.echo(f"rank {marker.rank}: marker seq {marker.seq}")


@app.command()
def stats(
    control: ControlOption = None,
    timeout: TimeoutOption = 5.0,
    curve_key: CurveKeyOption = None,
    server_key: ServerKeyOption = None,
) -> None:
    """Print the daemon's counters as JSON."""
    client = _client(control, timeout, curve_key, server_key)
    with client, _talking_to(client):
        reply = client.stats()
    typer.echo(json.dumps(_reply_json(reply), indent=2))


@app.command()
def ping(
    control: ControlOption = None,
    timeout: TimeoutOption = 5.0,
    curve_key: CurveKeyOption = None,
    server_key: ServerKeyOption = None,
) -> None:
    """Check that the daemon answers; print its version, epoch and endpoints."""
    client = _client(control, timeout, curve_key, server_key)
    with client, _talking_to(client):
        reply = client.ping()
    typer.echo(json.dumps(_reply_json(reply)))


def _reply_json(reply: object) -> object:
    """A control reply (a msgspec struct) as JSON values, its fields in declaration order;
    bytes (publisher ids) in hex, as routers log them."""
    import msgspec

    return _hex_bytes(msgspec.to_builtins(reply, builtin_types=(bytes,)))


def _hex_bytes(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {key: _hex_bytes(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_hex_bytes(item) for item in value]
    return value


def _text(value: object) -> str:
    """A field for a text line: '-' for nothing, hex for bytes (hashes in bytes format)."""
    if value is None:
        return "-"
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def describe_event(event: Event) -> str:
    from kvpubd.protocol.wire import BlockRemoved, BlockStored

    if isinstance(event, BlockStored):
        return (
            f"BlockStored blocks={len(event.block_hashes)} "
            f"parent={_text(event.parent_block_hash)} first={_text(event.block_hashes[0])} "
            f"lora={_text(event.lora_id)} medium={_text(event.medium)}"
        )
    if isinstance(event, BlockRemoved):
        return f"BlockRemoved blocks={len(event.block_hashes)} first={_text(event.block_hashes[0])}"
    return type(event).__name__


def _json_value(value: object) -> object:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def event_json(event: Event) -> dict[str, object]:
    """The event's fields (its msgspec struct fields), bytes as hex."""
    fields = {name: _json_value(getattr(event, name)) for name in event.__struct_fields__}
    return {"type": type(event).__name__, **fields}


def _event_line(received: Received, event: Event, as_json: bool) -> str:
    # The rank the batch itself names (the payload's data_parallel_rank), else the socket's.
    rank = received.batch.data_parallel_rank
    rank = received.rank if rank is None else rank
    if as_json:
        return json.dumps({"rank": rank, "seq": received.seq, **event_json(event)})
    return f"rank={rank} seq={received.seq} {describe_event(event)}"


@app.command()
def subscribe(
    endpoint: Annotated[
        str,
        typer.Option(
            "--endpoint",
            "-e",
            help="The daemon's events endpoint: rank 0's, or (ipc) the base or any rank's, as "
            "ping prints it.",
        ),
    ] = "tcp://127.0.0.1:5557",
    replay_endpoint: Annotated[
        str,
        typer.Option(
            "--replay", help="Replay endpoint, given as --endpoint is; '' turns repair off."
        ),
    ] = "tcp://127.0.0.1:5657",
    ranks: Annotated[int, typer.Option(help="How many data-parallel ranks to follow.")] = 1,
    rank: Annotated[
        int | None,
        typer.Option(help="Follow only this rank.", show_default="ranks 0 to --ranks - 1"),
    ] = None,
    topic: Annotated[str, typer.Option(help="Topic prefix to subscribe to.")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per event.")] = False,
    count: Annotated[
        int | None, typer.Option(help="Exit after this many events.", show_default="run forever")
    ] = None,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for a replay or control reply.")
    ] = 5.0,
    control: Annotated[
        str | None,
        typer.Option(
            "--control",
            "-c",
            help="Control endpoint: checks the daemon's epoch on gaps and resynchronises from "
            "its snapshot when replay no longer holds the missing history.",
            show_default="off",
        ),
    ] = None,
    snapshot_endpoint: Annotated[
        str | None,
        typer.Option(
            "--snapshot",
            help="The daemon's snapshot endpoint (events.snapshot_endpoint), given as "
            "--endpoint is: each rank bootstraps from a snapshot and follows from there, "
            "bootstrapping again on a gap or a restart (instead of --replay and --control).",
            show_default="off",
        ),
    ] = None,
    curve_key: CurveKeyOption = None,
    server_key: ServerKeyOption = None,
) -> None:
    """Print every published event, one per line.

    Gaps are repaired through replay (or the snapshot, with --control; or a snapshot
    bootstrap, with --snapshot) and reported on stderr with resyncs, restarts and losses.
    Started before the daemon, it waits for it."""
    # Either the configured base or a rank's own endpoint as `ping` prints it.
    endpoint = base_endpoint(_endpoint("--endpoint", endpoint))
    if snapshot_endpoint:
        if control:
            raise fail("--snapshot replaces --control: pass one of them", USAGE)
        snapshot_endpoint = base_endpoint(_endpoint("--snapshot", snapshot_endpoint))
        replay_endpoint = ""  # a snapshot bootstrap repairs, not replay
    if replay_endpoint:
        replay_endpoint = base_endpoint(_endpoint("--replay", replay_endpoint))
    if not 1 <= ranks <= MAX_RANKS:
        raise fail(f"--ranks: {ranks} is not between 1 and {MAX_RANKS}", USAGE)
    if rank is not None and not 0 <= rank < MAX_RANKS:
        raise fail(f"--rank: {rank} is not between 0 and {MAX_RANKS - 1}", USAGE)
    if count is not None:
        check_positive("--count", count, integer=True)
    check_positive("--timeout", timeout)
    client = _client(control, timeout, curve_key, server_key) if control else None
    followed = [rank] if rank is not None else list(range(ranks))
    try:
        _print_events(
            endpoint,
            replay_endpoint,
            followed,
            topic,
            as_json,
            count,
            timeout,
            client,
            snapshot_endpoint or None,
        )
    except BrokenPipeError:
        # The reader went away (`kvpubd subscribe | head -3`): that is how this ends.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        if client is not None:
            client.close()


def _print_events(
    endpoint: str,
    replay_endpoint: str,
    ranks: list[int],
    topic: str,
    as_json: bool,
    count: int | None,
    timeout: float,
    control: ControlClient | None,
    snapshot_endpoint: str | None = None,
) -> None:
    from kvpubd.client import ControlError, ControlTimeout, Subscriber, SubscriberError

    def note(message: str) -> None:
        typer.echo(f"# {message}", err=True)

    repair = "replay" if replay_endpoint else "the snapshot"
    # A snapshot bootstrap replaces replay and control; catching a dropped tail is its
    # heartbeat's job, not an idle replay's.
    repair_options: dict[str, Any] = (
        {"snapshot_endpoint": snapshot_endpoint, "snapshot_timeout": timeout}
        if snapshot_endpoint
        else {"control": control, "replay_timeout": timeout, "idle_check": 1.0}
    )
    seen = 0
    try:
        with Subscriber(
            endpoint,
            replay_endpoint or None,
            ranks=ranks,
            topic=topic,
            # idle_check (replay): finds a tail the PUB dropped while nothing else is published
            **repair_options,
            mirror=False,  # printing needs no copy of the cache
            on_gap=lambda rank, first, seq: note(
                f"gap on rank {rank}: seqs {first}..{seq - 1} missing, repairing through {repair}"
            ),
            on_resync=lambda rank, seq: note(
                f"rank {rank}: bootstrapped from its snapshot at seq {seq}; following from there"
                if snapshot_endpoint
                else f"rank {rank}: history gone; mirror rebuilt (snapshot or reset marker) at "
                f"seq {seq}"
            ),
            on_restart=lambda rank, reason: note(
                f"rank {rank}: daemon restart ({reason}); following the new run from its "
                "first retained batch"
            ),
        ) as subscriber:
            lost = dict.fromkeys(subscriber.ranks, 0)
            waiting, first = False, True
            while True:
                try:
                    batches = subscriber.catch_up() if first else subscriber.receive(0.1)
                except TimeoutError as exc:
                    # As the library does: the request is kept and asked again.
                    if not waiting:
                        hint = ""
                        if isinstance(exc, ControlTimeout) and control is not None:
                            hint = f" ({_unreachable_hint(control.endpoint, control.curve)})"
                        note(f"waiting for the daemon: {exc}{hint}")
                        waiting = True
                    time.sleep(0.2)  # a missing socket fails at once: do not spin
                    continue
                finally:
                    first = False
                if waiting and batches:
                    note("the daemon answers")
                    waiting = False
                for received in batches:
                    now_lost = subscriber.rank_counters(received.rank).lost
                    if now_lost != lost[received.rank]:
                        note(
                            f"rank {received.rank}: {now_lost - lost[received.rank]} batch(es) "
                            "lost: replay no longer holds them (pass --control to "
                            "resynchronise from the snapshot)"
                        )
                        lost[received.rank] = now_lost
                    for event in received.batch.events:
                        typer.echo(_event_line(received, event, as_json))
                        seen += 1
                        if count is not None and seen >= count:
                            return
    except (ControlError, SubscriberError) as exc:
        raise fail(str(exc)) from None


@app.command()
def demo(
    duration: Annotated[float, typer.Option(help="Seconds the demo runs (at least 2).")] = 10.0,
    rate: Annotated[float, typer.Option(help="Requests per second of the load.")] = 200.0,
) -> None:
    """Run a daemon, a load and a subscriber here on CPU, live, with a reset; then summarize."""
    if not 2 <= duration <= 3600:
        raise fail(f"--duration: {duration} is not between 2 and 3600 seconds", USAGE)
    if not 0 < rate <= 10_000:
        raise fail(f"--rate: {rate} is not between 0 and 10000 requests per second", USAGE)
    from kvpubd.tools.demo import run_demo

    raise typer.Exit(run_demo(duration=duration, rate=rate))


# loadgen fails (exit 1) when more than this share of its stores were refused or unanswered.
LOADGEN_MAX_ERROR_RATE = 0.10


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
    curve_key: CurveKeyOption = None,
    server_key: ServerKeyOption = None,
) -> None:
    """Drive a running daemon with a shared-prefix workload: store, hold, release.

    Prints progress on stderr and a summary; exits 1 when more than 10 % of the stores
    failed."""
    from kvpubd.tools.loadgen import LoadGenerator, LoadStats, Workload, parse_mix

    try:
        mix = parse_mix(prompt_mix)
    except ValueError as exc:
        raise fail(f"--prompt-mix: {exc}", USAGE) from None
    check_positive("--rate", rate)
    check_positive("--duration", duration)
    if not 0 <= hold < float("inf"):
        raise fail(f"--hold: {hold} is not a number of seconds >= 0", USAGE)
    client = _client(control, timeout, curve_key, server_key)

    def progress(stats: LoadStats, elapsed: float) -> None:
        typer.echo(f"loadgen: {elapsed:.0f}/{duration:g} s, {stats.progress()}", err=True)

    interrupted = False
    with client, _talking_to(client):
        generator = LoadGenerator(client, Workload(mix, seed), rate=rate, hold=hold, seed=seed)
        try:
            generator.run(duration, on_progress=progress)
        except KeyboardInterrupt:
            interrupted = True  # run() released what was open; report what was done
    stats = generator.stats
    summary = stats.as_dict()
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        typer.echo(
            f"{stats.progress()} in {stats.elapsed_s:.1f} s ({stats.rate:.1f} stored/s), "
            f"prefix hit rate {stats.hit_rate:.1%}"
        )
    if interrupted:
        raise typer.Exit(INTERRUPTED)
    if stats.error_rate > LOADGEN_MAX_ERROR_RATE or not stats.requests:
        raise fail(
            f"{stats.error_rate:.0%} of the stores failed (more than "
            f"{LOADGEN_MAX_ERROR_RATE:.0%}): see the errors above"
        )


BENCH_HELP = "Measure a real daemon started here: reset, throughput, publisher, index, kernels."


def _add_bench(argv: list[str]) -> None:
    """``bench`` with its commands when it is the command run; otherwise only its name and
    help (for ``kvpubd --help``), so that no other command pays for importing it."""
    if argv[:1] == ["bench"]:
        from kvpubd.tools.bench import bench_app

        app.add_typer(bench_app, name="bench", help=BENCH_HELP)
        return

    @app.command("bench", help=BENCH_HELP, add_help_option=False)
    def bench_placeholder() -> None:  # pragma: no cover - only listed, never run
        raise fail("run `kvpubd bench --help`", USAGE)


def _usage_error_type() -> type[Exception]:
    try:  # typer >= 0.20 carries its own click
        from typer._click.exceptions import ClickException
    except ImportError:  # pragma: no cover - older typer, with click installed
        from click.exceptions import ClickException  # type: ignore[no-redef]
    return ClickException


def _identity(file: int | str) -> tuple[int, int] | None:
    """(device, inode) of an open fd or a path; None when there is none (stdout closed)."""
    try:
        stat = os.fstat(file) if isinstance(file, int) else os.stat(file)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _reader_gone(stdout_at_start: tuple[int, int] | None) -> bool:
    """stdout is a pipe whose reader has closed it (`kvpubd ... | head -1`), or a library
    that saw that has pointed stdout at /dev/null already (rich does, then exits 1)."""
    import select

    now = _identity(1)
    if now is None:
        return False
    if now != stdout_at_start and now == _identity(os.devnull):
        return True
    poller = select.poll()
    poller.register(1, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _os_error_line(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):  # e.g. `> /dev/full`
        return f"cannot write: {exc.strerror}"
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run(argv: list[str]) -> int:
    usage_error = _usage_error_type()
    try:
        code = app(args=argv, prog_name="kvpubd", standalone_mode=False)
    except usage_error as exc:
        context = getattr(exc, "ctx", None)
        where = context.command_path if context is not None else "kvpubd"
        message = exc.format_message()  # type: ignore[attr-defined]
        if message:  # (none when the help was shown for a bare command)
            typer.echo(f"{where}: {message} (see --help)", err=True)
        code = getattr(exc, "exit_code", USAGE)
    sys.stdout.flush()  # a failure to write the output belongs to this command
    return code if isinstance(code, int) else OK


def main() -> None:
    """Run the command line; exits with the status of ``kvpubd.exits``."""
    argv = sys.argv[1:]
    if argv[:1] != ["serve"]:  # the daemon takes SIGTERM as its normal stop
        interrupts.terminate_like_interrupt()
    stdout_at_start = _identity(1)
    try:
        _add_bench(argv)  # (imports bench when it runs: Ctrl-C may come meanwhile)
        code = _run(argv)
    except KeyboardInterrupt:
        code = INTERRUPTED
    except SystemExit:
        # typer and rich end a write into a closed pipe with SystemExit(1)
        if not _reader_gone(stdout_at_start):
            raise
        code = OK
        _silence_stdout()
    except OSError as exc:
        if _reader_gone(stdout_at_start):  # like `subscribe | head`: the reader has what it wanted
            code = OK
        else:  # e.g. a full disk under `kvpubd subscribe > events.log`
            typer.echo(f"kvpubd: {_os_error_line(exc)}", err=True)
            code = FAILURE
        _silence_stdout()
    if code == INTERRUPTED:
        code = interrupts.exit_status()
        ended = {TERMINATED: "terminated", HUNG_UP: "hung up"}.get(code, "interrupted")
        typer.echo(f"kvpubd: {ended}", err=True)
    sys.exit(code)
