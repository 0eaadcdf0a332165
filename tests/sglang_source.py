"""SGLang's own KV-event publisher (``sglang/srt/disaggregation/kv_events.py``, unmodified) for
the tests that follow a real SGLang stream, loaded without SGLang: stand-ins replace the two
SGLang modules it imports. The file is looked for at ``$KVPUBD_SGLANG_KV_EVENTS``, else
``~/.cache/kvpubd/sglang/kv_events.py``; the tests skip without it. To put it there:

    pip download 'sglang==0.5.23' --no-deps -d /tmp/sglang-wheel
    python -m tests.sglang_source /tmp/sglang-wheel/sglang-0.5.23-*.whl
"""

from __future__ import annotations

import os
import sys
import types
import zipfile
from pathlib import Path

from kvpubd.tools.vllm_source import load_with_stand_ins

ENV_VAR = "KVPUBD_SGLANG_KV_EVENTS"
DEFAULT_PATH = Path.home() / ".cache" / "kvpubd" / "sglang" / "kv_events.py"
WHEEL_MEMBER = "sglang/srt/disaggregation/kv_events.py"


def kv_events_path() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_PATH)


def extract_from_wheel(wheel: Path) -> Path:
    """Copy SGLang's kv_events.py out of its wheel, unmodified."""
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(WHEEL_MEMBER)
    dest = kv_events_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(source)
    return dest


def _not_needed(*_args: object, **_kwargs: object) -> object:
    raise RuntimeError("not needed by the tests (ipc endpoints, one rank)")


def _stand_ins() -> dict[str, types.ModuleType]:
    names = ("sglang", "sglang.srt", "sglang.srt.runtime_context", "sglang.srt.utils")
    modules = {name: types.ModuleType(name) for name in (*names, "sglang.srt.utils.network")}
    modules["sglang.srt.runtime_context"].get_parallel = _not_needed  # type: ignore[attr-defined]
    modules["sglang.srt.utils.network"].NetworkAddress = type(  # type: ignore[attr-defined]
        "NetworkAddress", (), {"parse": staticmethod(_not_needed)}
    )
    return modules


def load_kv_events(path: Path | None = None) -> types.ModuleType:
    """SGLang's ``kv_events`` module from its file (stand-ins restored afterwards)."""
    return load_with_stand_ins(path or kv_events_path(), "_kvpubd_sglang_kv_events", _stand_ins())


if __name__ == "__main__":
    print(extract_from_wheel(Path(sys.argv[1])))
