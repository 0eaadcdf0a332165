"""vLLM's ``vllm/distributed/kv_events.py`` without vLLM, for ``kvpubd bench publisher
--against-vllm``: vLLM is never a dependency. The file is taken once from vLLM's wheel and loaded
alone, with stand-ins for the few names it imports from the rest of vLLM (its config dataclass,
logger, network helpers and a type alias). Where the file is looked for:
``$KVPUBD_VLLM_KV_EVENTS``, else ``~/.cache/kvpubd/vllm/kv_events.py``. To put it there:

    pip download 'vllm==0.33.0' --no-deps -d /tmp/vllm-wheel
    kvpubd bench vllm-extract /tmp/vllm-wheel/vllm-0.33.0-*.whl
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
DEFAULT_PATH = Path.home() / ".cache" / "kvpubd" / "vllm" / "kv_events.py"
WHEEL_MEMBER = "vllm/distributed/kv_events.py"


def kv_events_path() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_PATH)


def extract_from_wheel(wheel: Path, dest: Path = DEFAULT_PATH) -> Path:
    """Copy ``vllm/distributed/kv_events.py`` out of a downloaded vLLM wheel."""
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(WHEEL_MEMBER)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(source)
    return dest


@dataclass
class _KVEventsConfig:
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
    modules["vllm.config.kv_events"].KVEventsConfig = _KVEventsConfig  # type: ignore[attr-defined]
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
    stand_ins = _stand_ins()
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("_kvpubd_vllm_kv_events", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return module
