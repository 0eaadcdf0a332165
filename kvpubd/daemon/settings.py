"""The daemon's settings: pydantic models, loaded from TOML then overridden by KVPUBD_* env."""

from __future__ import annotations

import difflib
import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from kvpubd.protocol.endpoints import (
    CLIENT_ENV,
    ENV_PREFIX,
    check_endpoint,
    default_control_endpoint,
    rank_endpoint,
    tcp_port,
)
from kvpubd.protocol.hashing import HashAlgorithm
from kvpubd.protocol.wire import FULL_ATTENTION_KINDS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

MAX_RANKS = 64
ZMQ_INT_MAX = (1 << 31) - 1  # libzmq takes the high-water mark as a C int
# Bytes per element of each supported KV dtype; the pool itself is raw bytes.
DTYPE_SIZES = {"float16": 2, "bfloat16": 2, "float32": 4, "float8": 1, "uint8": 1}


# service.rank_processes: see ServiceConfig.
RankProcessesMode = Literal["auto", "on", "off"]


class ConfigError(ValueError):
    """A configuration problem, reported as one line naming the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EventsConfig(_Section):
    # How batches travel (vLLM's KVEventsConfig.publisher): "zmq" (PUB + replay ROUTER on the
    # endpoints below) or "null" (nowhere; seqs still count). The daemon checks the name
    # against its transports (kvpubd.daemon.transports).
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    # Empty string turns replay off. The default sits 100 ports above the PUB range so that
    # up to 64 ranks never collide.
    replay_endpoint: str = "tcp://*:5657"
    topic: str = ""
    wire_format: Literal["map", "array"] = "map"
    hash_format: Literal["u64", "i64", "bytes"] = "u64"
    replay_framing: Literal["v026", "legacy"] = "v026"
    buffer_steps: int = Field(10_000, ge=1, le=10_000_000)
    buffer_bytes: int = Field(512 << 20, ge=1 << 20)
    hwm: int = Field(100_000, ge=0, le=ZMQ_INT_MAX)
    max_events_per_tick: int = Field(50_000, ge=1)
    # Below 1 ms an idle daemon would spin its CPU on ticks that publish nothing.
    tick_interval_ms: float = Field(10.0, ge=1, le=60_000)
    medium: str | None = None
    # Immediate publication of reset markers; off only to measure the engines' behaviour.
    flush_on_reset: bool = True
    # Replays streamed at once per rank; more requests get no answer and are retried.
    max_replays: int = Field(64, ge=1, le=10_000)
    # A replay from before the oldest retained batch starts with one batch holding
    # AllBlocksCleared and the whole cache; off: it gets only what the ring holds.
    replay_snapshot: bool = True
    # First seq of each run: "continue" (the last run's last seq + 1, kept in a file per rank
    # in seq_state_dir; 0 for a first run), "clock" (wall clock in microseconds: a restart is
    # a forward jump) or "zero" (every run at 0).
    seq_origin: Literal["continue", "clock", "zero"] = "continue"
    # Where "continue" keeps its files; "": $STATE_DIRECTORY (systemd), else
    # $XDG_STATE_HOME/kvpubd, else ~/.local/state/kvpubd.
    seq_state_dir: str = ""
    # An idle rank publishes an empty batch after this long without one (0: never), so a
    # consumer that missed a batch or joined an idle daemon finds out within one interval.
    heartbeat_ms: int = Field(2000, ge=0, le=3_600_000)
    # vLLM's snapshot protocol (KVEventsConfig.snapshot_endpoint): a ROUTER per rank (tcp port
    # + rank, ipc suffix _dp<rank>) answering b"snapshot" with the rank's whole state. While
    # set, every batch carries the rank's publisher id as a 4th element and an idle rank
    # heartbeats at least once a second. "" (default): off, the wire unchanged.
    snapshot_endpoint: str = ""

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        return check_endpoint(value)

    @field_validator("replay_endpoint", "snapshot_endpoint")
    @classmethod
    def _check_optional(cls, value: str) -> str:
        return check_endpoint(value) if value else value


class ControlConfig(_Section):
    endpoint: str = Field(default_factory=default_control_endpoint)
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=1 << 30)
    max_tokens_per_request: int = Field(1_000_000, ge=1)
    # Full blocks one store may cover: a large store runs in slices across loop turns, so
    # this bounds its total work and memory, not how long it holds the loop.
    max_blocks_per_store: int = Field(65_536, ge=1)
    # Requests open on one rank (stored, or queued to be, and not released): each holds a
    # lease (~200 bytes) even with no block, so a client cannot grow the daemon's memory
    # without bound by storing empty prompts and never releasing them.
    max_open_requests: int = Field(65_536, ge=1)
    # CURVE authentication: the daemon's secret certificate and a directory of the public
    # certificates of the clients it admits (both, or neither for no authentication).
    curve_secret_key: str = ""
    curve_authorized_keys: str = ""
    # A client's open requests are released once it has had no control connection for
    # orphan_grace_ms (it died): else a crashed engine pins its blocks until a forced reset.
    release_orphans: bool = True
    orphan_grace_ms: int = Field(5000, ge=0, le=3_600_000)

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str) -> str:
        return check_endpoint(value)

    @model_validator(mode="after")
    def _check_curve(self) -> ControlConfig:
        if bool(self.curve_secret_key) != bool(self.curve_authorized_keys):
            missing = "curve_authorized_keys" if self.curve_secret_key else "curve_secret_key"
            raise ValueError(f"control.{missing}: CURVE needs both key settings")
        return self


# The KV cache spec kinds (vLLM's KVCacheSpecKind names) a group may have: every block of a
# full-attention kind (FULL_ATTENTION_KINDS) is kept for the whole prompt; a sliding-window
# kind keeps the blocks of its window (and serves a prefix whose last window it holds).
SLIDING_WINDOW_KINDS = ("sliding_window", "sliding_window_mla")
GroupKind = Literal[
    "full_attention", "mla_attention", "sink_full_attention", "sliding_window", "sliding_window_mla"
]


class CacheGroupConfig(_Section):
    """One KV cache group of a hybrid model: its kind, its layers and its block geometry (each
    group has a pool of its own; unset sizes are the cache's)."""

    kind: GroupKind = "full_attention"
    # Tokens a sliding-window kind attends to (vLLM's sliding_window); none for the others.
    sliding_window: int | None = Field(None, ge=1)
    # The model's layers in this group (vLLM's layer indices): their count sizes the blocks.
    layers: list[int] = Field(min_length=1)
    num_blocks: int | None = Field(None, ge=1, le=1 << 31)
    num_kv_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_window(self) -> CacheGroupConfig:
        windowed = self.kind in SLIDING_WINDOW_KINDS
        if windowed and self.sliding_window is None:
            raise ValueError(f"sliding_window: a {self.kind} group needs its window in tokens")
        if not windowed and self.sliding_window is not None:
            raise ValueError(f"sliding_window: a {self.kind} group has no window")
        return self

    @property
    def windowed(self) -> bool:
        return self.kind in SLIDING_WINDOW_KINDS


class GroupSpec(NamedTuple):
    """A KV cache group as a rank builds it: ``idx`` is its ``group_idx`` on the wire (None
    for the one implicit group of a cache without ``groups``, whose events carry no group)."""

    idx: int | None
    kind: str
    sliding_window: int | None
    num_blocks: int
    block_bytes: int

    @property
    def windowed(self) -> bool:
        return self.kind in SLIDING_WINDOW_KINDS


class CacheConfig(_Section):
    # Where every rank's pool lives: "cpu" (POSIX shared memory), "cuda:N" (every rank on GPU
    # N) or "cuda" (rank r on GPU r where the machine has a GPU for every rank served, else
    # every rank on GPU 0). rank_devices, one per rank served, names each rank's own.
    device: str = "cpu"
    rank_devices: list[str] = Field(default_factory=list)
    num_blocks: int = Field(1024, ge=1, le=1 << 31)
    block_size: int = Field(16, ge=1, le=4096)
    num_layers: int = Field(2, ge=1)
    num_kv_heads: int = Field(8, ge=1)
    head_dim: int = Field(64, ge=1)
    dtype: Literal["float16", "bfloat16", "float32", "float8", "uint8"] = "float16"
    scrub_on_free: bool = True
    data_parallel_size: int = Field(1, ge=1, le=MAX_RANKS)
    # The first rank served: ranks start .. start + size - 1, each publishing on the base
    # endpoints offset by its rank, as vLLM's engines do. One daemon per engine rank (size 1,
    # start = the engine's rank) spreads the ranks over as many processes.
    data_parallel_start_rank: int = Field(0, ge=0, lt=MAX_RANKS)
    # The block hash chain's hash: sha256, or xxhash (xxh3_128: about 4x cheaper per block
    # and 16-byte digests), vLLM's two prefix-caching hash families.
    hash_algorithm: HashAlgorithm = "sha256"
    # The host tier: this many blocks per rank in host memory (POSIX shared memory, page-locked
    # when the pool is on a GPU) that blocks evicted from the pool are copied to, and that a
    # store whose prefix is there copies back from. 0: off.
    host_blocks: int = Field(0, ge=0, le=1 << 31)
    # The medium the host tier's events name (vLLM's offloading connector says "CPU").
    host_medium: str = Field("CPU", min_length=1)
    # A hybrid model's KV cache groups, in vLLM's group order (their index is the events'
    # group_idx). Empty: one full-attention group of num_layers layers, whose events carry
    # no group fields (the wire as before groups existed).
    groups: list[CacheGroupConfig] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _check_groups(self) -> CacheConfig:
        if not self.groups:
            return self
        if not any(group.kind in FULL_ATTENTION_KINDS for group in self.groups):
            raise ValueError(
                "cache.groups: at least one group of a full-attention kind ("
                + ", ".join(FULL_ATTENTION_KINDS)
                + ") is needed; its prefix is what the others' windows end on"
            )
        seen: set[int] = set()
        for number, group in enumerate(self.groups):
            twice = seen.intersection(group.layers)
            if twice:
                raise ValueError(
                    f"cache.groups[{number}].layers: layer {min(twice)} is in two groups"
                )
            seen.update(group.layers)
        if self.host_blocks:
            raise ValueError(
                "cache.host_blocks: a host tier serves a cache of one group; with "
                "cache.groups set, leave it 0"
            )
        return self

    def group_specs(self) -> list[GroupSpec]:
        """Each group's spec, in group order (the implicit one without ``groups``)."""
        per_layer = 2 * self.block_size * DTYPE_SIZES[self.dtype]
        if not self.groups:
            return [GroupSpec(None, "full_attention", None, self.num_blocks, self.block_bytes)]
        return [
            GroupSpec(
                idx,
                group.kind,
                group.sliding_window,
                group.num_blocks or self.num_blocks,
                per_layer
                * len(group.layers)
                * (group.num_kv_heads or self.num_kv_heads)
                * (group.head_dim or self.head_dim),
            )
            for idx, group in enumerate(self.groups)
        ]

    @property
    def primary_group(self) -> int:
        """The position of the group whose index leads a store's match (and whose pool the
        top-level pool_info, checksums and stats name): the first of a full-attention kind."""
        return next((i for i, g in enumerate(self.groups) if g.kind in FULL_ATTENTION_KINDS), 0)

    @model_validator(mode="after")
    def _check_ranks(self) -> CacheConfig:
        last = self.data_parallel_start_rank + self.data_parallel_size - 1
        if last >= MAX_RANKS:
            raise ValueError(
                f"cache.data_parallel_start_rank: ranks {self.data_parallel_start_rank}..{last} "
                f"go past the last rank, {MAX_RANKS - 1}"
            )
        return self

    @property
    def ranks(self) -> range:
        """The ranks served."""
        return range(
            self.data_parallel_start_rank, self.data_parallel_start_rank + self.data_parallel_size
        )

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if value in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
            return value
        raise ValueError(f"{value!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'")

    @field_validator("rank_devices")
    @classmethod
    def _check_rank_devices(cls, value: list[str]) -> list[str]:
        for device in value:
            if device != "cpu" and not re.fullmatch(r"cuda:\d+", device):
                raise ValueError(f"{device!r} is not a device; use 'cpu' or 'cuda:N'")
        if len({d == "cpu" for d in value}) > 1:
            raise ValueError("every rank on the host or every rank on GPUs, not both")
        return value

    @model_validator(mode="after")
    def _check_rank_device_count(self) -> CacheConfig:
        if self.rank_devices and len(self.rank_devices) != self.data_parallel_size:
            raise ValueError(
                f"cache.rank_devices: {len(self.rank_devices)} device(s) for "
                f"{self.data_parallel_size} rank(s); name one per rank served"
            )
        return self

    @property
    def on_host(self) -> bool:
        """The pools are host memory (else GPU memory)."""
        return (self.rank_devices[0] if self.rank_devices else self.device) == "cpu"

    def device_of(self, rank: int, cuda_devices: int) -> str:
        """Rank ``rank``'s device, on a machine with ``cuda_devices`` GPUs."""
        if self.rank_devices:
            return self.rank_devices[rank - self.data_parallel_start_rank]
        if self.device != "cuda":
            return self.device
        return f"cuda:{rank}" if self.ranks[-1] < cuda_devices else "cuda:0"

    @property
    def block_bytes(self) -> int:
        """K and V for every layer, token, head and channel of one block."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * self.block_size * DTYPE_SIZES[self.dtype]


LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)


def check_log_level(value: object) -> object:
    """A log level in any case (``INFO``, ``Debug``) as the lower-case name."""
    return value.lower() if isinstance(value, str) else value


class ServiceConfig(_Section):
    loop: Literal["uvloop", "asyncio"] = "uvloop"
    log_level: LogLevel = "info"
    # How long shutdown waits for ZeroMQ to hand queued messages to subscribers.
    linger_ms: int = Field(2000, ge=0, le=3_600_000)
    # Each rank in a worker process of its own under this one ("on"), all ranks in this
    # process ("off"), or "auto": worker processes when more than one rank is served and the
    # machine has a CPU for each and one more (one Python thread serves all ranks otherwise,
    # so throughput would not grow with them). Clients see the same endpoints and protocol.
    rank_processes: RankProcessesMode = "auto"
    # A rank worker that dies is started again, up to this many times in rank_restart_window_s
    # (its seq goes on, its first batch is AllBlocksCleared); one more death stops the service
    # with a non-zero status. 0: the first death stops the service.
    rank_restarts: int = Field(3, ge=0, le=1000)
    rank_restart_window_s: float = Field(60.0, gt=0, le=86_400)
    # A rank worker whose loop answers no ping from the service for this long is taken for
    # hung: killed, and then handled as a worker that died.
    rank_hang_timeout_s: float = Field(10.0, ge=0.5, le=3600)

    @field_validator("log_level", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        return check_log_level(value)


class MetricsConfig(_Section):
    # Prometheus endpoint http://host:port/metrics; port 0 turns it off.
    port: int = Field(0, ge=0, le=65535)
    host: str = Field("127.0.0.1", min_length=1)


class UpstreamConfig(_Section):
    """Upstream mode: follow an unmodified engine's own KV-event publisher and republish it
    (the engine owns its cache; store and release are refused)."""

    # The engine's wire: "vllm", "sglang" or "trtllm"; "" (default): off, kvpubd owns the pool.
    flavour: Literal["", "vllm", "sglang", "trtllm"] = ""
    # The engine's PUB endpoint of its rank 0: rank r at port + r (ipc, inproc: suffix _dp<r>),
    # as vLLM offsets its data-parallel ranks.
    endpoint: str = ""
    # The engine's replay ROUTER (same offsets); "": none, gaps cannot be repaired.
    replay_endpoint: str = ""
    topic: str = ""
    # The medium of the engine's events that name none (SGLang omits it).
    medium: str = Field("GPU", min_length=1)
    # Called (HTTP POST) on every reset, after the marker is out: the engine's own reset,
    # e.g. vLLM's http://127.0.0.1:8000/reset_prefix_cache. "": not called.
    reset_url: str = ""
    # After a reset, the engine's events from before its own clear are dropped for at most
    # this long (see docs/engines.md).
    clear_timeout_ms: int = Field(5000, ge=0, le=3_600_000)
    # Messages the SUB socket holds from a flooding engine before ZeroMQ drops (a gap,
    # repaired through replay where it can be).
    rcvhwm: int = Field(10_000, ge=1, le=ZMQ_INT_MAX)
    # A silent engine is asked for a dropped tail after this long (0: never).
    idle_check_ms: int = Field(1000, ge=0, le=3_600_000)
    # Live blocks kept per rank (about 0.5 KiB each): stores past it are not republished, so
    # an engine that never removes cannot grow the daemon without bound.
    max_blocks: int = Field(4_000_000, ge=1, le=1 << 40)
    # An engine message larger than this is lost (ZeroMQ drops the connection on it; kvpubd
    # connects again): a batch is held decoded whole (several times its size) until relayed.
    max_payload_bytes: int = Field(8 << 20, ge=1 << 16, le=1 << 30)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoints(cls, value: str) -> str:
        return check_endpoint(value) if value else value

    @model_validator(mode="after")
    def _check_endpoint_set(self) -> UpstreamConfig:
        if self.flavour and not self.endpoint:
            raise ValueError("upstream.endpoint: the engine's PUB endpoint is needed")
        return self

    @property
    def on(self) -> bool:
        return bool(self.flavour)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVPUBD_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    events: EventsConfig = EventsConfig()
    control: ControlConfig = Field(default_factory=ControlConfig)
    cache: CacheConfig = CacheConfig()
    service: ServiceConfig = ServiceConfig()
    metrics: MetricsConfig = MetricsConfig()
    upstream: UpstreamConfig = UpstreamConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file (passed as init kwargs).
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _check_port_ranges(self) -> Settings:
        ranks = self.cache.ranks
        ranges: list[tuple[str, range]] = []
        for key, endpoint, served in (
            ("events.endpoint", self.events.endpoint, ranks),
            ("events.replay_endpoint", self.events.replay_endpoint, ranks),
            ("events.snapshot_endpoint", self.events.snapshot_endpoint, ranks),
            ("control.endpoint", self.control.endpoint, range(1)),
            ("metrics.port", f"tcp://*:{self.metrics.port}" if self.metrics.port else "", range(1)),
        ):
            port = tcp_port(endpoint) if endpoint else None
            if port is None:
                continue
            here = range(port + served.start, port + served.stop)
            if here.stop - 1 > 65535:
                raise ValueError(f"{key}: ports {here.start}..{here.stop - 1} exceed 65535")
            for other_key, other in ranges:
                if set(here) & set(other):
                    raise ValueError(
                        f"{key}: ports {here.start}..{here.stop - 1} overlap {other_key} "
                        f"ports {other.start}..{other.stop - 1}"
                    )
            ranges.append((key, here))
        return self

    @model_validator(mode="after")
    def _check_socket_names(self) -> Settings:
        """Two sockets never share an ipc (or inproc) name: the second bind would fail as if
        another daemon held it."""
        events = self.events
        per_rank = [
            (key, endpoint)
            for key, endpoint in (
                ("events.endpoint", events.endpoint),
                ("events.replay_endpoint", events.replay_endpoint),
                ("events.snapshot_endpoint", events.snapshot_endpoint),
            )
            if endpoint
        ]
        bound = [(key, rank_endpoint(e, rank)) for key, e in per_rank for rank in self.cache.ranks]
        names: dict[str, str] = {}
        for key, name in [*bound, ("control.endpoint", self.control.endpoint)]:
            if tcp_port(name) is not None:
                continue
            if name in names:
                raise ValueError(f"{key}: {name} is also {names[name]}")
            names[name] = key
        return self

    @property
    def medium(self) -> str:
        """The medium the pool's events name: events.medium, else the pool's own ("GPU" for a
        GPU pool, and for any pool below a host tier, which it stands in for a GPU's)."""
        if self.events.medium is not None:
            return self.events.medium
        return "CPU" if self.cache.on_host and not self.cache.host_blocks else "GPU"

    @model_validator(mode="after")
    def _check_media(self) -> Settings:
        if self.cache.host_blocks and self.medium == self.cache.host_medium:
            raise ValueError(
                f"cache.host_medium: {self.cache.host_medium!r} is also the pool's medium "
                "(events.medium); the two tiers need two names"
            )
        return self


def load_settings(
    path: Path | None = None, overrides: dict[str, dict[str, Any]] | None = None
) -> Settings:
    """Read the TOML file (if any), apply ``overrides`` (section -> key -> value) over it, then
    KVPUBD_* environment variables over both; validate; raise ConfigError."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(read_config_text(path))
        except FileNotFoundError:
            raise ConfigError(f"config file {path}: not found") from None
        except OSError as exc:
            raise ConfigError(f"config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
        except RecursionError:  # tomllib recurses once per nesting level
            raise ConfigError(f"config file {path}: nested too deeply to be a config") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {path}: not UTF-8 text (byte {exc.start}: {exc.reason})"
            ) from None
    for section, values in (overrides or {}).items():
        current = data.get(section)
        data[section] = {**(current if isinstance(current, dict) else {}), **values}
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    except SettingsError as exc:  # a whole section as JSON (KVPUBD_EVENTS='{...}') that is not
        raise ConfigError(_describe_env_error(exc)) from None
    except RecursionError:
        raise ConfigError("environment: a KVPUBD_* value is nested too deeply") from None


def _describe_env_error(exc: SettingsError, environ: Mapping[str, str] = os.environ) -> str:
    """pydantic-settings names the section, not the variable; the cause says what is wrong.
    Where the section's own variable is not set, a key's is: the first whose value is no
    JSON (a list key, ``KVPUBD_CACHE__RANK_DEVICES=cpu``, was reported as the section's)."""
    match = re.search(r'field "(\w+)"', str(exc))
    cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
    if match is None:
        return f"a KVPUBD_* variable: not JSON where a list or a section is expected{cause}"
    section = f"{ENV_PREFIX}{match.group(1)}".upper()
    if section not in {name.upper() for name in environ}:
        for name, value in environ.items():
            if name.upper().startswith(f"{section}__") and not _is_json(value):
                return f"{name}: a list or map must be given as JSON (such as '[\"cpu\"]'){cause}"
    return f"{section}: a whole section must be a JSON object{cause}"


def _is_json(value: str) -> bool:
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


# A config file is a few KiB (config/kvpubd.toml, every key, is under 8); the bound keeps a
# wrong path (/dev/zero, a huge file) from stalling start-up or a SIGHUP reload.
MAX_CONFIG_BYTES = 64 << 10  # the shipped file is under 8 KiB


def read_config_text(path: Path) -> str:
    """The text of a config file; ConfigError unless it is a regular file of at most
    MAX_CONFIG_BYTES. Opened non-blocking: a FIFO would otherwise wait for a writer (on the
    loop, at a SIGHUP)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"config file {path}: not a regular file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"config file {path}: {info.st_size} bytes; the limit is {MAX_CONFIG_BYTES}"
            )
        raw = handle.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:  # grew since the check
        raise ConfigError(f"config file {path}: larger than {MAX_CONFIG_BYTES} bytes")
    return raw.decode("utf-8")


def log_level_option(value: str) -> str:
    """``serve --log-level``, checked like ``service.log_level``; ConfigError otherwise."""
    level = check_log_level(value)
    if level not in LOG_LEVELS:
        raise ConfigError(f"--log-level: {value!r} is not one of {', '.join(LOG_LEVELS)}")
    return str(level)


# Problems named in one error line at most (a file of thousands of unknown keys made a
# megabyte-long log line).
MAX_PROBLEMS_NAMED = 20


def describe_validation_error(exc: ValidationError) -> str:
    """One line naming each problem by its dotted key (a whole section by its name), the
    first MAX_PROBLEMS_NAMED of them."""
    errors = exc.errors()
    named = [_describe(error) for error in errors[:MAX_PROBLEMS_NAMED]]
    if len(errors) > MAX_PROBLEMS_NAMED:
        named.append(f"and {len(errors) - MAX_PROBLEMS_NAMED} more")
    return "; ".join(named)


def _describe(error: Any) -> str:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc)
    message: str = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown section" if len(loc) == 1 else "unknown key"
    elif error["type"] == "model_type" and len(loc) == 1:
        message = f"must be a section ([{key}] in TOML), not {error['input']!r}"
    if not key or message.startswith(f"{key}."):  # a section's check names its own key
        return message
    return f"{key}: {message}"


def _known_env() -> list[str]:
    """Every KVPUBD_<SECTION>__<KEY> the daemon reads."""
    return [
        f"{ENV_PREFIX}{section}__{key}".upper()
        for section, field in Settings.model_fields.items()
        for key in field.annotation.model_fields  # type: ignore[union-attr]
    ]


def env_overrides(environ: Mapping[str, str]) -> list[str]:
    """The KVPUBD_* variables set that override a setting."""
    known = set(_known_env())
    return sorted(name for name in environ if name.upper() in known)


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """One warning per KVPUBD_* variable nobody reads (a typo: it would be silently ignored).
    A bad key inside a known section is left to validation, which refuses it."""
    known = _known_env()
    sections = tuple(f"{ENV_PREFIX}{s}__".upper() for s in Settings.model_fields)
    warnings = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in CLIENT_ENV or upper.startswith(sections):
            continue
        close = difflib.get_close_matches(upper, [*known, *CLIENT_ENV], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.append(f"ignoring unknown variable {name}{hint}")
    return warnings
