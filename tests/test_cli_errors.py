"""Every mistake a user can make on the command line ends in one line on stderr and the
documented exit status: 0 ok, 1 runtime failure, 2 usage or config, 130 interrupted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

import pytest

from kvpubd.client import Subscriber
from tests.daemon import Daemon, wait_for
from tests.test_cli import ENV, kvpubd, kvpubd_all

# Exit statuses and one-line errors of the command line: processes.
pytestmark = pytest.mark.process

BLOCK_SIZE = 16


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """Exit ``code``, nothing on stdout, one line on stderr naming each of ``words``."""
    assert result.returncode == code, (result.args, result.returncode, result.stderr)
    assert result.stdout == "", (result.args, result.stdout)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, (result.args, result.stderr)
    for word in words:
        assert word in lines[0], (result.args, lines[0])
    return lines[0]


def test_bad_endpoints_exit_2_for_every_client_command() -> None:
    """An endpoint without a scheme, wherever it comes from, is refused before anything is
    sent: one line naming the option (or the variable) and what is wrong, exit 2."""
    bad = "127.0.0.1:5557"
    cases = {
        "--control": [
            ["ping", "--control", bad],
            ["stats", "--control", bad],
            ["reset", "--control", bad],
            ["loadgen", "--control", bad],
            ["subscribe", "--control", bad],
        ],
        "--endpoint": [["subscribe", "--endpoint", bad]],
        "--replay": [["subscribe", "--replay", bad]],
    }
    argvs = [argv for argvs in cases.values() for argv in argvs]
    results = kvpubd_all(*argvs)
    options = [option for option, argvs in cases.items() for _ in argvs]
    for option, result in zip(options, results, strict=True):
        assert_one_line(result, 2, option, "is not a ZeroMQ endpoint")
    (from_env,) = kvpubd_all(["stats"], env={**ENV, "KVPUBD_CONTROL__ENDPOINT": "garbage"})
    assert_one_line(from_env, 2, "KVPUBD_CONTROL__ENDPOINT", "'garbage'")


BAD_ARGUMENTS: list[tuple[list[str], str]] = [
    (["bench", "reset", "--sizes", "abc"], "--sizes"),
    (["bench", "reset", "--sizes", "-5"], "--sizes"),
    (["bench", "reset", "--resets", "0"], "--resets"),
    (["bench", "reset", "--device", "gpu"], "--device"),
    (["bench", "index", "--blocks", "0"], "--blocks"),
    (["bench", "publisher", "--batches", "0"], "--batches"),
    (["bench", "throughput", "--window", "0"], "--window"),
    (["subscribe", "--count", "0"], "--count"),
    (["subscribe", "--count", "-5"], "--count"),
    (["subscribe", "--ranks", "0"], "--ranks"),
    (["subscribe", "--rank", "-1"], "--rank"),
    (["subscribe", "--count", "abc"], "--count"),
    (["reset", "--timeout", "0"], "--timeout"),
    (["reset", "--rank", "-1"], "--rank"),
    (["reset", "--rank", str(2**64)], "--rank"),  # once a msgpack OverflowError traceback
    (["ping", "--curve-key", "/nonexistent"], "--server-key"),
    (["serve", "--log-level", "bogus"], "--log-level"),
    (["serve", "--log-level", "warn"], "--log-level"),
    (["stats", "--bogus"], "--bogus"),
]


def test_bad_arguments_exit_2_with_one_line() -> None:
    """Bad bench sizes, counts, ranks, timeouts, devices, log levels and unknown options:
    one line naming the option, exit 2, before any daemon is started or asked."""
    results = kvpubd_all(*(argv for argv, _ in BAD_ARGUMENTS))
    for (_, option), result in zip(BAD_ARGUMENTS, results, strict=True):
        assert_one_line(result, 2, option)


def test_bench_device_without_cupy_exits_2() -> None:
    pytest.importorskip("numpy")
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    assert_one_line(kvpubd("bench", "reset", "--device", "cuda:0"), 2, "--device", "CuPy")


def test_keys_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    """A second `kvpubd keys DIR` keeps the secret key (clients trusting the public one keep
    working) and exits 2 naming --force; with --force it replaces both."""
    directory = tmp_path / "certs"
    first = kvpubd("keys", str(directory))
    assert first.returncode == 0, first.stderr
    secret = directory / "kvpubd.key_secret"
    before = secret.read_bytes()
    assert_one_line(kvpubd("keys", str(directory)), 2, "exists", "--force")
    assert secret.read_bytes() == before
    forced = kvpubd("keys", str(directory), "--force")
    assert forced.returncode == 0, forced.stderr
    assert secret.read_bytes() != before
    assert_one_line(kvpubd("keys", "/proc/kvpubd-certs"), 1, "/proc/kvpubd-certs")


def test_missing_ipc_socket_is_named(tmp_path: Path) -> None:
    """A control socket file that does not exist is reported as such, exit 1."""
    endpoint = f"ipc://{tmp_path}/control"
    assert_one_line(
        kvpubd("ping", "--control", endpoint), 1, f"no control socket at {tmp_path}/control"
    )


@pytest.fixture
def two_ranks() -> object:
    daemon = Daemon({"cache": {"data_parallel_size": 2}})
    try:
        yield daemon.start()
    finally:
        daemon.cleanup()


def test_subscribe_labels_events_with_the_payloads_rank(two_ranks: Daemon) -> None:
    """On a 2-rank daemon every printed event carries the rank its batch names, in text and
    JSON; --rank 1 follows rank 1 only."""
    with two_ranks.client() as client:
        client.store("r1", list(range(BLOCK_SIZE)), rank=1)
        client.snapshot(1)  # publishes it
        first = client.stats().ranks[1].first_seq  # rank 1's start-up marker
    base = ["subscribe", "--endpoint", two_ranks.events_endpoint]
    base += ["--replay", two_ranks.replay_endpoint]
    both, only_one, text = kvpubd_all(
        [*base, "--ranks", "2", "--json", "--count", "3"],
        [*base, "--rank", "1", "--json", "--count", "2"],
        [*base, "--rank", "1", "--count", "2"],
    )
    for result in (both, only_one, text):
        assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in both.stdout.splitlines()]
    assert sorted((line["rank"], line["type"]) for line in lines) == [
        (0, "AllBlocksCleared"),
        (1, "AllBlocksCleared"),
        (1, "BlockStored"),
    ]
    lines = [json.loads(line) for line in only_one.stdout.splitlines()]
    assert [(line["rank"], line["type"]) for line in lines] == [
        (1, "AllBlocksCleared"),
        (1, "BlockStored"),
    ]
    stored = text.stdout.splitlines()[1]
    # Text output: '-' for what is not there, never Python reprs.
    assert stored.startswith(f"rank=1 seq={first + 1} BlockStored blocks=1 parent=- ")
    assert "lora=-" in stored


def test_topic_is_honoured_on_replayed_batches() -> None:
    """A subscriber of another topic gets nothing, through replay included."""
    daemon = Daemon({"events": {"topic": "kv@pod-0"}})
    try:
        daemon.start()
        with Subscriber(daemon.events_endpoint, daemon.replay_endpoint, topic="kv@pod-1") as sub:
            assert sub.catch_up() == []
        with Subscriber(daemon.events_endpoint, daemon.replay_endpoint, topic="kv@") as sub:
            assert [b.seq for b in sub.catch_up()] == [daemon.first_seq()]
    finally:
        daemon.cleanup()


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvpubd", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def read_line(stream: IO[str] | None) -> str:
    assert stream is not None
    line = stream.readline()
    assert line, "the command ended early"
    return line


def test_subscribe_waits_for_the_daemon_then_prints(tmp_path: Path) -> None:
    """Started before the daemon, `subscribe` says it waits, then follows the daemon once it
    is up, as the library does."""
    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    proc = start("subscribe", "--endpoint", events, "--replay", replay, "--timeout", "0.3")
    daemon = Daemon({"events": {"endpoint": events, "replay_endpoint": replay}})
    try:
        assert read_line(proc.stderr).startswith("# waiting for the daemon")
        daemon.start()
        first = daemon.first_seq()
        assert read_line(proc.stdout).startswith(f"rank=0 seq={first} AllBlocksCleared")
    finally:
        proc.kill()
        proc.communicate()
        daemon.cleanup()


def test_ctrl_c_exits_130(daemon: Daemon) -> None:
    """Ctrl-C ends subscribe and loadgen with status 130 and one line; loadgen still prints
    what it did."""
    subscriber = start(
        "subscribe", "--endpoint", daemon.events_endpoint, "--replay", daemon.replay_endpoint
    )
    load = start("loadgen", "--control", daemon.control_endpoint, "--duration", "60")
    try:
        read_line(subscriber.stdout)  # caught up
        assert read_line(load.stderr).startswith("loadgen: ")  # running
        for proc in (subscriber, load):
            proc.send_signal(signal.SIGINT)
        _, sub_err = subscriber.communicate(timeout=30)
        load_out, load_err = load.communicate(timeout=30)
    finally:
        for proc in (subscriber, load):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert subscriber.returncode == 130, sub_err
    assert sub_err.strip().splitlines()[-1] == "kvpubd: interrupted"
    assert load.returncode == 130, load_err
    assert "stores sent" in load_out
    assert "Traceback" not in sub_err + load_err


def test_ctrl_c_while_the_command_line_is_imported_exits_130() -> None:
    """Ctrl-C arriving while ``kvpubd`` still imports its command line (typer, pydantic: the
    slow part of a start) ends it with 130 and one line, no traceback. The interrupt is raised
    where Python's SIGINT handler would raise it: inside that import."""
    program = (
        "import sys\n"
        "class CtrlC:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'typer':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, CtrlC())\n"
        "from kvpubd.__main__ import main\n"
        "main()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program, "ping"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip().splitlines() == ["kvpubd: interrupted"]


GAP_NOTE = r"# gap on rank 0: seqs \d+\.\.\d+ missing, repairing through replay"


def test_subscribe_into_a_closed_pipe_exits_0(daemon: Daemon) -> None:
    """`kvpubd subscribe | head -1`: when the reader goes, subscribe ends quietly with 0."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvpubd", "subscribe"),
            *("--endpoint", daemon.events_endpoint, "--replay", daemon.replay_endpoint),
        ],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    os.close(write_end)
    try:
        with os.fdopen(read_end) as reader:
            first = daemon.first_seq()
            assert reader.readline().startswith(f"rank=0 seq={first} ")  # `head -1`, then closes
        with daemon.client() as client:  # more lines to print, into the closed pipe

            def ended() -> bool:
                client.store(f"p{client.stats().ranks[0].seq}", list(range(BLOCK_SIZE)))
                client.reset(force=True)
                return proc.poll() is not None

            wait_for(ended, timeout=20, what="subscribe to end")
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    # Nothing but, at most, the note of a batch published before the SUB's subscription had
    # reached the PUB (ZeroMQ's slow joiner), repaired through replay.
    notes = [line for line in err.splitlines() if not re.fullmatch(GAP_NOTE, line)]
    assert notes == []


def test_loadgen_reports_sent_and_failed_and_fails_on_errors(start_daemon: object) -> None:
    """Against a pool too small for any prompt every store is refused: loadgen shows progress,
    reports stores sent against succeeded, and exits 1 with one line naming the rate."""
    daemon = start_daemon(cache={"num_blocks": 4})  # type: ignore[operator]
    result = kvpubd(
        "loadgen", "--control", daemon.control_endpoint, "--duration", "1.5", "--rate", "20"
    )
    assert result.returncode == 1, result.stderr
    (summary,) = result.stdout.splitlines()
    assert " stores sent, 0 succeeded, " in summary and "pool_exhausted" in summary, summary
    progress, failure = result.stderr.strip().splitlines()
    assert progress.startswith("loadgen: 1/1.5 s, ") and "stores sent" in progress
    assert failure.startswith("kvpubd: 100% of the stores failed"), failure


def test_help_shows_version_option_and_control_default() -> None:
    main, ping = kvpubd_all(["--help"], ["ping", "--help"])
    assert "--version" in main.stdout
    assert "control.sock" in ping.stdout  # where --control points by default
    assert " ." not in ping.stdout  # no markup eaten from the help texts


def _run_into(output: int | IO[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpubd", *args],
        stdout=output,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        timeout=60,
    )


def test_a_full_disk_under_the_output_is_one_line(daemon: Daemon) -> None:
    """`kvpubd stats > /dev/full` (a full disk under `subscribe > events.log`): exit 1 and
    one line, no traceback, for every command that prints."""
    control = ("--control", daemon.control_endpoint)
    streams = ("--endpoint", daemon.events_endpoint, "--replay", daemon.replay_endpoint)
    commands = [
        ["--version"],
        ["stats", *control],
        ["ping", *control],
        ["subscribe", *streams, "--count", "1"],
        ["bench", "index", "--blocks", "1000", "--json"],
    ]
    with open("/dev/full", "w") as full:
        for argv in commands:
            result = _run_into(full, *argv)
            assert result.returncode == 1, (argv, result.stderr)
            assert result.stderr.splitlines() == ["kvpubd: cannot write: No space left on device"]


def _first_lines_then_close(args: list[str], lines: int) -> subprocess.CompletedProcess[str]:
    """`kvpubd ARGS | head -LINES`."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpubd", *args],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    os.close(write_end)
    try:
        with os.fdopen(read_end) as reader:
            for _ in range(lines):
                assert reader.readline(), "the output ended early"
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(args, proc.returncode, "", err)


def test_a_reader_that_stops_early_ends_any_command_with_0() -> None:
    """`--help | head -1` and `demo | head -2` end quietly with 0, as `subscribe | head`."""
    for args, lines in ((["--help"], 1), (["demo", "--duration", "2"], 2)):
        result = _first_lines_then_close(args, lines)
        assert result.returncode == 0, (args, result.stderr)
        assert result.stderr == "", args


def test_config_mistakes_from_env_and_deep_nesting_are_one_line(tmp_path: Path) -> None:
    """A whole section given as JSON that is not an object, a config nested deeper than
    Python recurses, a tick that would spin an idle daemon: exit 2 and one line each."""
    deep_json = tmp_path / "deep.json"
    deep_json.write_text("[" * 100_000 + "]" * 100_000)
    deep_toml = tmp_path / "deep.toml"
    deep_toml.write_text("a = " + "[" * 100_000 + "]" * 100_000)
    cases = [
        ({"KVPUBD_EVENTS": "{not json"}, [], "KVPUBD_EVENTS"),
        ({}, ["--kv-events-config", f"@{deep_json}"], "kv-events-config"),
        ({}, ["--config", str(deep_toml)], str(deep_toml)),
        ({"KVPUBD_EVENTS__TICK_INTERVAL_MS": "0.000001"}, [], "events.tick_interval_ms"),
    ]
    for env, args, word in cases:
        (result,) = kvpubd_all(["serve", *args], env={**ENV, **env})
        assert_one_line(result, 2, "config error", word)


def test_help_shows_flags_as_flags_and_never_cuts_a_name() -> None:
    """Flags take no value (no `<bool>` after them), and at 80 columns (a pipe) the longest
    option names are wrapped, not cut."""
    narrow = {key: value for key, value in ENV.items() if key != "COLUMNS"}
    main, subscribe, throughput = kvpubd_all(
        ["--help"], ["subscribe", "--help"], ["bench", "throughput", "--help"], env=narrow
    )
    for result in (main, subscribe, throughput):
        assert result.returncode == 0, result.stderr
        assert "<bool>" not in result.stdout
        assert "…" not in result.stdout
    assert "--no-daemon-per-rank" in throughput.stdout


def test_keys_into_a_file_says_it_is_not_a_directory(tmp_path: Path) -> None:
    target = tmp_path / "a-file"
    target.write_text("")
    for force in ([], ["--force"]):
        line = assert_one_line(kvpubd("keys", str(target), *force), 2, "is not a directory")
        assert "--force" not in line


def test_subscribe_takes_back_the_ipc_endpoints_ping_prints(start_daemon: object) -> None:
    """ipc ranks bind `<endpoint>_dp<rank>`; `ping` prints those; passed back to `subscribe`
    (for two ranks, or one of them), they reach the same sockets."""
    daemon: Daemon = start_daemon(cache={"data_parallel_size": 2})  # type: ignore[operator]
    ping = kvpubd("ping", "--control", daemon.control_endpoint)
    assert ping.returncode == 0, ping.stderr
    endpoints = json.loads(ping.stdout)["endpoints"]
    first = [daemon.first_seq(rank) for rank in (0, 1)]
    for printed, args, ranks in (
        (endpoints[0], ["--ranks", "2"], [0, 1]),  # rank 0's, as the base port is for tcp
        (endpoints[1], ["--rank", "1"], [1]),  # rank 1's own
    ):
        assert printed["events"].endswith(f"_dp{ranks[0]}")
        result = kvpubd(
            "subscribe",
            *("--endpoint", printed["events"], "--replay", printed["replay"]),
            *args,
            *("--count", str(len(ranks)), "--timeout", "2"),
            timeout=20,
        )
        assert result.returncode == 0, result.stderr
        assert sorted(result.stdout.splitlines()) == [
            f"rank={rank} seq={first[rank]} AllBlocksCleared" for rank in ranks
        ]
