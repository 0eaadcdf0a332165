"""vLLM's own files without vLLM, for the benches that compare against it (``bench publisher
--against-vllm``, ``bench blockpool``, ``bench throughput --against-vllm``): vLLM is never a
dependency. The files are taken once from vLLM's wheel and loaded on their own, with stand-ins
for the rest of vLLM they import. Where they are looked for: the directory
``$KVPUBD_VLLM_DIR``, else ``~/.cache/kvpubd/vllm/``, each by its file name;
``$KVPUBD_VLLM_KV_EVENTS`` names kv_events.py elsewhere. To put them there:

    pip download 'vllm==0.34.0' --no-deps -d /tmp/vllm-wheel
    kvpubd bench vllm-extract /tmp/vllm-wheel/vllm-0.34.0-*.whl
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_VAR = "KVPUBD_VLLM_KV_EVENTS"
DIR_ENV_VAR = "KVPUBD_VLLM_DIR"
DEFAULT_DIR = Path.home() / ".cache" / "kvpubd" / "vllm"
WHEEL_MEMBER = "vllm/distributed/kv_events.py"
# Every file the comparisons load, in the order vllm_blockpool loads them (each imports only
# stand-ins and the files before it).
WHEEL_MEMBERS = (
    "vllm/utils/hashing.py",
    "vllm/utils/gc_utils.py",
    "vllm/v1/token_buffer.py",
    "vllm/v1/request.py",
    "vllm/v1/core/kv_cache_utils.py",
    WHEEL_MEMBER,
    "vllm/v1/core/block_pool.py",
)
# The wheel's version, written beside the files by the extraction.
VERSION_FILE = "vllm-version.txt"


def vllm_dir() -> Path:
    return Path(os.environ.get(DIR_ENV_VAR) or DEFAULT_DIR)


def kv_events_path() -> Path:
    return Path(os.environ.get(ENV_VAR) or vllm_dir() / "kv_events.py")


def member_path(member: str) -> Path:
    """Where the extraction puts a member of the wheel, and the loaders look for it."""
    if member == WHEEL_MEMBER:
        return kv_events_path()
    return vllm_dir() / Path(member).name


def extracted_version() -> str | None:
    """The version of the wheel the files came from, if the extraction recorded it."""
    path = vllm_dir() / VERSION_FILE
    return path.read_text().strip() if path.is_file() else None


def _wheel_version(archive: zipfile.ZipFile) -> str | None:
    for name in archive.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in archive.read(name).decode("utf-8", "replace").splitlines():
                if line.startswith("Version:"):
                    return line.partition(":")[2].strip()
    return None


def extract_from_wheel(wheel: Path) -> list[Path]:
    """Copy every file the comparisons load out of a downloaded vLLM wheel (unmodified), and
    record its version; returns the files written. KeyError if one is not in the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        sources = {member: archive.read(member) for member in WHEEL_MEMBERS}
        version = _wheel_version(archive)
    written = []
    for member, source in sources.items():
        dest = member_path(member)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(source)
        written.append(dest)
    if version is not None:
        vllm_dir().mkdir(parents=True, exist_ok=True)
        (vllm_dir() / VERSION_FILE).write_text(version + "\n")
    return written


@dataclass
class KVEventsConfig:
    """Stand-in for ``vllm.config.kv_events.KVEventsConfig`` (the publisher only stores it)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _unsupported(*_args: Any) -> Any:
    raise RuntimeError("not needed by the bench (tcp://*:0 endpoints only)")


def _stand_ins() -> dict[str, types.ModuleType]:
    modules = {
        name: types.ModuleType(name)
        for name in (
            "vllm",
            "vllm.config",
            "vllm.config.kv_events",
            "vllm.logger",
            "vllm.utils",
            "vllm.utils.network_utils",
            "vllm.v1",
            "vllm.v1.core",
            "vllm.v1.core.kv_cache_utils",
        )
    }
    modules["vllm.config.kv_events"].KVEventsConfig = KVEventsConfig  # type: ignore[attr-defined]
    modules["vllm.logger"].init_logger = logging.getLogger  # type: ignore[attr-defined]
    network = modules["vllm.utils.network_utils"]
    for name in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path"):
        setattr(network, name, _unsupported)
    modules["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = bytes | int  # type: ignore[attr-defined]
    return modules


def load_kv_events(path: Path | None = None) -> types.ModuleType:
    """vLLM's ``kv_events`` module from its file, importing stand-ins for the rest of vLLM
    (restored afterwards, so a real vLLM in this process is left alone)."""
    path = path or kv_events_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"vLLM's kv_events.py is not at {path} (set {ENV_VAR}, or run "
            "`kvpubd bench vllm-extract WHEEL`; see the README's benchmark section)"
        )
    return load_with_stand_ins(path, "_kvpubd_vllm_kv_events", _stand_ins())


def load_with_stand_ins(
    path: Path, name: str, stand_ins: dict[str, types.ModuleType]
) -> types.ModuleType:
    """The module of an engine's file ``path``, its imports of the rest of the engine served
    by ``stand_ins`` while it loads (restored afterwards: a real engine in this process is
    left alone)."""
    saved = {module: sys.modules.get(module) for module in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for module_name, previous in saved.items():
            if previous is None:
                sys.modules.pop(module_name, None)
            else:
                sys.modules[module_name] = previous
    return module
