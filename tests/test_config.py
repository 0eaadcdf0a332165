"""Configuration: TOML file, KVPUBD_* environment overrides, one-line errors, the shipped file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvpubd.daemon.settings import ConfigError, Settings, load_settings, log_level_option
from kvpubd.protocol.endpoints import rank_endpoint
from tests.daemon import Daemon, write_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "config" / "kvpubd.toml"
SECTIONS = ("events", "control", "cache", "service")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No KVPUBD_* variable from the caller leaks in; the default control socket lives in
    tmp_path, so a daemon that got as far as binding it would leave a trace there."""
    for name in list(os.environ):
        if name.startswith("KVPUBD_"):
            monkeypatch.delenv(name)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    yield


def serve(config: Path, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvpubd serve --config FILE`` with the current environment."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "kvpubd", "serve", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ),
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"kvpubd serve --config {config} did not exit: it accepted it"
        ) from None


def assert_config_error(result: subprocess.CompletedProcess[str], *names: str) -> str:
    """Exit status 2 and exactly one line of output, naming each of ``names``."""
    output = result.stdout + result.stderr
    lines = output.splitlines()
    assert result.returncode == 2, f"exit {result.returncode}: {output}"
    assert len(lines) == 1, f"expected one line, got:\n{output}"
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def assert_nothing_bound(tmp_path: Path) -> None:
    """The daemon binds its ranks' sockets, then creates the control socket's directory under
    $XDG_RUNTIME_DIR; neither may have happened."""
    assert list((tmp_path / "runtime").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "runtime") == ["bad.toml"]


def private_endpoints(tmp_path: Path) -> dict[str, str]:
    return {
        "endpoint": f"ipc://{tmp_path}/events",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
    }


BAD_FILES: dict[str, tuple[str, str]] = {
    # case: (TOML text; "{ev}" / "{rp}" are private ipc endpoints), the key the error must name
    "unknown-key": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\nbogus = 1\n',
        "events.bogus",
    ),
    "unknown-section": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\n[bogus]\nx = 1\n',
        "bogus",
    ),
    "wrong-type": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\n[cache]\nnum_blocks = "many"\n',
        "cache.num_blocks",
    ),
    "bad-enum": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\nwire_format = "xml"\n',
        "events.wire_format",
    ),
    "out-of-range": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\n[cache]\nblock_size = 0\n',
        "cache.block_size",
    ),
    "bad-endpoint": (
        '[events]\nendpoint = "localhost:5557"\nreplay_endpoint = "{rp}"\n',
        "events.endpoint",
    ),
    "overlapping-ports": (
        '[events]\nendpoint = "tcp://127.0.0.1:6000"\nreplay_endpoint = "tcp://127.0.0.1:6002"\n'
        "[cache]\ndata_parallel_size = 4\n",
        "events.replay_endpoint",
    ),
    # Rank 3 of a daemon serving 1 from start rank 3 binds base + 3: the control port.
    "start-rank-overlaps": (
        '[events]\nendpoint = "tcp://127.0.0.1:6000"\nreplay_endpoint = "tcp://127.0.0.1:6100"\n'
        '[control]\nendpoint = "tcp://127.0.0.1:6003"\n[cache]\ndata_parallel_start_rank = 3\n',
        "control.endpoint",
    ),
    "start-rank-past-65535": (
        '[events]\nendpoint = "tcp://127.0.0.1:65530"\nreplay_endpoint = "{rp}"\n'
        "[cache]\ndata_parallel_start_rank = 10\n",
        "events.endpoint",
    ),
    # Once exit 1, "in use by a running daemon" naming the daemon's own pid.
    "events-and-replay-on-one-ipc-path": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{ev}"\n',
        "events.replay_endpoint",
    ),
    # Both once exit 1 at bind ("in use by a running daemon", its own pid; "address in use").
    "snapshot-on-the-events-ipc-path": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\nsnapshot_endpoint = "{ev}"\n',
        "events.snapshot_endpoint",
    ),
    "snapshot-ports-overlap-the-events": (
        '[events]\nendpoint = "tcp://127.0.0.1:6000"\nreplay_endpoint = "{rp}"\n'
        'snapshot_endpoint = "tcp://127.0.0.1:6000"\n',
        "events.snapshot_endpoint",
    ),
    # Values libzmq cannot take once failed at bind with a traceback.
    "hwm-past-a-c-int": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\nhwm = 2147483648\n',
        "events.hwm",
    ),
    "message-bytes-past-1-gib": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\n'
        "[control]\nmax_message_bytes = 9223372036854775807\n",
        "control.max_message_bytes",
    ),
    "ranks-past-the-last": (
        '[events]\nendpoint = "{ev}"\nreplay_endpoint = "{rp}"\n'
        "[cache]\ndata_parallel_start_rank = 60\ndata_parallel_size = 8\n",
        "cache.data_parallel_start_rank",
    ),
}


@pytest.mark.process
@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_exits_2_with_one_line_naming_the_key(tmp_path: Path, case: str) -> None:
    """A config file with an unknown key, a wrong type, a bad enum or range, or overlapping
    port ranges stops ``serve`` with status 2 and one line naming the dotted key, before any
    socket is bound (the service section asks for debug logs: starting would print more)."""
    text, key = BAD_FILES[case]
    ev, rp = private_endpoints(tmp_path).values()
    text = text.format(ev=ev, rp=rp) + '[service]\nlog_level = "debug"\n'
    config = tmp_path / "bad.toml"
    config.write_text(text)
    line = assert_config_error(serve(config), key)
    assert re.search(rf"(^|\W){re.escape(key)}:", line), line
    assert_nothing_bound(tmp_path)


@pytest.mark.process
def test_missing_file_exits_2_naming_it(tmp_path: Path) -> None:
    """A config path that does not exist: status 2, one line naming the path."""
    missing = tmp_path / "bad.toml"
    assert_config_error(serve(missing), str(missing))
    assert list((tmp_path / "runtime").iterdir()) == []


@pytest.mark.process
def test_invalid_toml_exits_2_naming_the_file(tmp_path: Path) -> None:
    """A file that is not TOML: status 2, one line naming the file."""
    config = tmp_path / "bad.toml"
    config.write_text('[events\nendpoint = "tcp://*:5557"\n')
    assert_config_error(serve(config), str(config))
    assert_nothing_bound(tmp_path)


@pytest.mark.process
def test_config_that_is_not_utf8_exits_2_naming_the_file(tmp_path: Path) -> None:
    """TOML is UTF-8: a file in another encoding stops ``serve`` with one line, no traceback."""
    config = tmp_path / "bad.toml"
    config.write_bytes('[events]\ntopic = "caf\u00e9"\n'.encode("latin-1"))
    line = assert_config_error(serve(config), str(config))
    assert "UTF-8" in line, line
    assert_nothing_bound(tmp_path)


@pytest.mark.process
@pytest.mark.parametrize(
    ("variable", "value", "key"),
    [
        ("KVPUBD_EVENTS__WIRE_FORMAT", "xml", "events.wire_format"),
        ("KVPUBD_CACHE__NUM_BLOCKS", "many", "cache.num_blocks"),
        # A list key's value that is no JSON: once named as KVPUBD_CACHE, a section not set.
        ("KVPUBD_CACHE__RANK_DEVICES", "cpu", "KVPUBD_CACHE__RANK_DEVICES"),
    ],
)
def test_bad_env_value_exits_2_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, key: str
) -> None:
    """A bad KVPUBD_* value on top of a good file: status 2, one line naming the dotted key."""
    config = tmp_path / "bad.toml"
    write_config(config, {"events": private_endpoints(tmp_path), "service": {"log_level": "debug"}})
    monkeypatch.setenv(variable, value)
    assert_config_error(serve(config), key)
    assert_nothing_bound(tmp_path)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("events", "hash_format", "u128"),
        ("cache", "hash_algorithm", "md5"),
        ("service", "linger_ms", 2**31),  # libzmq's linger is a C int
    ],
)
def test_load_settings_error_names_the_key(
    tmp_path: Path, section: str, key: str, value: object
) -> None:
    """load_settings raises ConfigError whose one-line message starts with the dotted key."""
    config = tmp_path / "c.toml"
    write_config(config, {section: {key: value}})
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert str(info.value).startswith(f"{section}.{key}:")
    assert "\n" not in str(info.value)


# -- environment overrides -------------------------------------------------------------------


def test_env_overrides_one_key_and_the_file_keeps_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVPUBD_EVENTS__TOPIC beats the file's topic; the file's other events keys (and other
    sections) still apply; another env key overrides in another section."""
    config = tmp_path / "c.toml"
    write_config(
        config,
        {
            "events": {"topic": "from-file", "wire_format": "array", "buffer_steps": 77},
            "cache": {"num_blocks": 99, "block_size": 8},
        },
    )
    monkeypatch.setenv("KVPUBD_EVENTS__TOPIC", "kv@pod@model")
    monkeypatch.setenv("KVPUBD_CACHE__BLOCK_SIZE", "32")
    settings = load_settings(config)
    assert settings.events.topic == "kv@pod@model"
    assert settings.events.wire_format == "array"
    assert settings.events.buffer_steps == 77
    assert settings.cache.num_blocks == 99
    assert settings.cache.block_size == 32
    # Without the variables the file wins.
    monkeypatch.delenv("KVPUBD_EVENTS__TOPIC")
    monkeypatch.delenv("KVPUBD_CACHE__BLOCK_SIZE")
    settings = load_settings(config)
    assert (settings.events.topic, settings.cache.block_size) == ("from-file", 8)


@pytest.mark.process
def test_env_override_reaches_the_running_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ``serve``: KVPUBD_EVENTS__TOPIC sets the topic frame while the file's endpoints
    in the same section are still the ones bound."""
    monkeypatch.setenv("KVPUBD_EVENTS__TOPIC", "env-topic")
    daemon = Daemon({"events": {"topic": "file-topic"}})
    try:
        daemon.start()
        with daemon.client() as client:
            endpoints = client.ping().endpoints
        assert endpoints[0].events == f"{daemon.events_endpoint}_dp0"
        assert endpoints[0].replay == f"{daemon.replay_endpoint}_dp0"
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoints[0].replay)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            assert sock.poll(10_000), "no replay reply"
            frames = sock.recv_multipart()  # the start-up marker, the run's first seq
            with daemon.client() as client:
                first_seq = client.stats().ranks[0].first_seq
        finally:
            sock.close()
        assert frames[1] == b"env-topic" and frames[2] == first_seq.to_bytes(8, "big")
    finally:
        daemon.cleanup()


def test_error_names_every_problem_and_calls_a_section_a_section(tmp_path: Path) -> None:
    """One line naming each problem by its key; a misspelt section is an unknown section; a
    section given as a value says so without pydantic's internals."""
    config = tmp_path / "c.toml"
    config.write_text("events = 5\n[evnets]\nx = 1\n[cache]\nnum_blocks = 0\nbogus = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    message = str(info.value)
    assert "\n" not in message
    for part in (
        "events: must be a section ([events] in TOML), not 5",
        "evnets: unknown section",
        "cache.num_blocks:",
        "cache.bogus: unknown key",
    ):
        assert part in message, message
    assert "instance of" not in message and "more)" not in message


def test_log_level_in_any_case_in_file_env_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """`INFO` works everywhere; `warn` and `bogus` fail everywhere, one line naming the key."""
    monkeypatch.setenv("KVPUBD_SERVICE__LOG_LEVEL", "WARNING")
    assert load_settings().service.log_level == "warning"
    assert log_level_option("Debug") == "debug"
    for bad in ("warn", "bogus"):
        monkeypatch.setenv("KVPUBD_SERVICE__LOG_LEVEL", bad)
        with pytest.raises(ConfigError, match=r"service\.log_level"):
            load_settings()
        with pytest.raises(ConfigError, match="--log-level"):
            log_level_option(bad)


@pytest.mark.process
def test_unknown_variables_are_warned_about_and_overrides_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KVPUBD_* variable nobody reads (a typo) is named in a warning with the likely
    intended one; the start line names the overrides that are active."""
    monkeypatch.setenv("KVPUBD_EVENT__TOPIC", "x")
    monkeypatch.setenv("KVPUBD_EVENTS_TOPIC", "x")
    monkeypatch.setenv("KVPUBD_EVENTS__TOPIC", "kv@pod")
    monkeypatch.setenv("KVPUBD_CURVE_KEY", "/client/only")  # read by the clients: no warning
    daemon = Daemon()
    try:
        daemon.start()
        assert daemon.stop() == 0
        log = daemon.log()
    finally:
        daemon.cleanup()
    for name in ("KVPUBD_EVENT__TOPIC", "KVPUBD_EVENTS_TOPIC"):
        assert f"ignoring unknown variable {name} (did you mean KVPUBD_EVENTS__TOPIC?)" in log
    assert "KVPUBD_CURVE_KEY" not in log
    assert "overridden by KVPUBD_EVENTS__TOPIC" in log


# -- the shipped file ------------------------------------------------------------------------


def documented_keys(text: str) -> dict[str, set[str]]:
    """Keys per section, active or commented out (``# key = value``), from the TOML text."""
    keys: dict[str, set[str]] = {}
    section = ""
    for line in text.splitlines():
        header = re.match(r"^\s*#?\s*\[([A-Za-z_]+)\]\s*(#.*)?$", line)
        if header:
            section = header.group(1)
            keys.setdefault(section, set())
            continue
        key = re.match(r"^\s*#?\s*([a-z_]+)\s*=", line)
        if key and section:
            keys[section].add(key.group(1))
    return keys


def test_shipped_config_equals_the_defaults() -> None:
    """config/kvpubd.toml loads and equals Settings() key for key (control.endpoint, computed
    from the runtime directory, aside)."""
    assert SHIPPED.exists(), f"{SHIPPED} is missing"
    shipped = load_settings(SHIPPED).model_dump()
    defaults = Settings().model_dump()
    shipped["control"].pop("endpoint")
    defaults["control"].pop("endpoint")
    assert shipped == defaults


def test_shipped_config_documents_every_field() -> None:
    """Every field of every section appears in config/kvpubd.toml (keys without a TOML value,
    like an unset medium, as a commented-out line), and it holds no key the models lack."""
    text = SHIPPED.read_text()
    active: dict[str, Any] = tomllib.loads(text)
    documented = documented_keys(text)
    assert set(active) <= set(Settings.model_fields)
    for section, field in Settings.model_fields.items():
        model = field.annotation
        assert model is not None
        names = set(model.model_fields)
        assert set(active.get(section, {})) <= names, section
        missing = names - documented.get(section, set())
        assert not missing, f"[{section}] does not mention {sorted(missing)}"


# -- per-rank endpoints --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://127.0.0.1:6000", 63, "tcp://127.0.0.1:6063"),
        ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
        ("ipc:///tmp/kvpubd/events", 0, "ipc:///tmp/kvpubd/events_dp0"),
        ("ipc:///tmp/kvpubd/events", 2, "ipc:///tmp/kvpubd/events_dp2"),
        ("inproc://events", 1, "inproc://events_dp1"),
    ],
)
def test_rank_endpoint(base: str, rank: int, expected: str) -> None:
    """tcp endpoints use base_port + rank; ipc and inproc endpoints get the suffix _dp<rank>."""
    assert rank_endpoint(base, rank) == expected


def test_serve_config_resolves_every_source_into_one_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file, vLLM's JSON, KVPUBD_* and --log-level end in one Settings; a reload keeps
    --log-level over the file's."""
    from kvpubd.daemon.serve_config import resolve

    path = tmp_path / "kvpubd.toml"
    write_config(path, {"service": {"log_level": "warning"}, "events": {"topic": "file"}})
    monkeypatch.setenv("KVPUBD_EVENTS__BUFFER_STEPS", "7")
    monkeypatch.setenv("KVPUBD_EVENTS_TOPIC", "typo")
    resolved = resolve(path, log_level="DEBUG", kv_events_config='{"topic": "vllm"}')
    settings = resolved.settings
    assert (settings.service.log_level, settings.events.topic) == ("debug", "vllm")
    assert settings.events.buffer_steps == 7
    assert resolved.load() == settings
    assert "overridden by KVPUBD_EVENTS__BUFFER_STEPS" in resolved.start_lines()[0]
    assert "kv-events-config: mapped events.topic = 'vllm'" in resolved.start_lines()[1]
    assert [w.split()[3] for w in resolved.warnings()] == ["KVPUBD_EVENTS_TOPIC"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"log_level": "loud"}, "--log-level"),
        ({"kv_events_config": "{topic"}, "kv-events-config"),
        ({"device": "cuda:99"}, "cache.device: 'cuda:99'"),
        ({"curve": True}, "control.curve_secret_key"),
    ],
)
def test_serve_config_problems_are_one_config_error(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    from kvpubd.daemon.serve_config import resolve

    path = tmp_path / "kvpubd.toml"
    sections: dict[str, dict[str, Any]] = {}
    if "device" in kwargs:
        sections["cache"] = {"device": kwargs.pop("device")}
    if kwargs.pop("curve", False):
        sections["control"] = {
            "curve_secret_key": str(tmp_path / "missing.key"),
            "curve_authorized_keys": str(tmp_path),
        }
    write_config(path, sections)
    with pytest.raises(ConfigError) as raised:
        resolve(path, **kwargs)
    assert message in str(raised.value)
