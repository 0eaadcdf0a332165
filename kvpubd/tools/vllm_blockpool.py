"""vLLM's own KV cache block pool without vLLM, for ``kvpubd bench blockpool`` and ``kvpubd bench
throughput --against-vllm``: vLLM is never a dependency. The files below are taken once from
vLLM's wheel (``kvpubd bench vllm-extract WHEEL``) and loaded unmodified, each under its own
module name, beside stand-ins for the rest of vLLM they import. What a stand-in replaces is
either never reached by a text-only request (multimodal inputs, LoRA, prompt embeddings,
structured outputs, pooling, KV cache specs of other attention types, metrics) or is reached but
trivial (the logger, a read-only list view, per-request stats objects nobody reads here); the
work per block — hashing, the prefix lookup, the free queue, eviction, the events and their
encoding — is all vLLM's own code.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpubd.tools import vllm_source

# The files loaded, in load order: module name -> member of the wheel.
LOADED: dict[str, str] = {
    member.removesuffix(".py").replace("/", "."): member for member in vllm_source.WHEEL_MEMBERS
}

# vLLM's default for the one environment setting on this path (vllm/envs.py): event block
# hashes are sent as the low 64 bits of the digest, as an int.
INT_BLOCK_HASHES_DEFAULT = "1"


def source_paths() -> dict[str, Path]:
    """Where each loaded module's file is looked for."""
    return {name: vllm_source.member_path(member) for name, member in LOADED.items()}


def missing_files() -> list[Path]:
    return [path for path in source_paths().values() if not path.is_file()]


@dataclass
class VllmBlockPool:
    """The loaded modules a driver uses."""

    block_pool: types.ModuleType
    kv_cache_utils: types.ModuleType
    request: types.ModuleType
    hashing: types.ModuleType
    kv_events: types.ModuleType
    gc_utils: types.ModuleType
    sampling_params: type[Any]
    version: str | None


class _NotOnThisPath:
    """A vLLM class the text-only path names (in a signature, an isinstance check) but never
    builds."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__name__}: not on the text-only path (a stand-in)")


def _absent(name: str) -> type[Any]:
    return type(name, (_NotOnThisPath,), {})


def _not_called(name: str) -> Any:
    def call(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(f"{name}: not on the text-only path (a stand-in)")

    return call


class _SamplingParams:
    """Stand-in for ``vllm.SamplingParams``: the fields a Request reads when it is built
    (greedy, one output token, no logprobs, no structured outputs, no extra args)."""

    def __init__(self, max_tokens: int = 1) -> None:
        self.max_tokens = max_tokens
        self.extra_args: dict[str, Any] | None = None
        self.skip_reading_prefix_cache = False
        self.prompt_logprobs: int | None = None
        self.prompt_logprob_token_ids: list[int] | None = None
        self.structured_outputs: Any = None


class _StructuredOutputRequest:
    """Stand-in: a request without structured outputs has none."""

    @staticmethod
    def from_sampling_params(_sampling_params: Any) -> None:
        return None


class _ConstantList:
    """Stand-in for ``vllm.v1.utils.ConstantList`` (that module needs torch): a read-only
    view of a list, each read going through one Python method, as there."""

    def __init__(self, items: Any) -> None:
        self._x = items

    def __getitem__(self, item: Any) -> Any:
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._x)


class _Stats:
    """Stand-in for vLLM's per-request stats objects (built with each request, never read on
    this path)."""


class _FinishReason(enum.IntEnum):
    """Stand-in for ``vllm.v1.engine.FinishReason`` (request.py maps statuses to it once)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


def _length_of_prompt(prompt_token_ids: Any, prompt_embeds: Any) -> int:
    """Stand-in for ``vllm.utils.length_from_prompt_token_ids_or_embeds`` (vllm/utils needs
    torch): a text prompt's length."""
    if prompt_embeds is not None:
        raise RuntimeError("prompt embeddings: not on the text-only path (a stand-in)")
    return len(prompt_token_ids)


def _envs_module() -> types.ModuleType:
    """``vllm.envs`` as the engine runs it: settings read lazily through the module's
    ``__getattr__``, cached once the engine has started (``enable_envs_cache``)."""
    envs = types.ModuleType("vllm.envs")
    settings = {
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": lambda: bool(
            int(os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", INT_BLOCK_HASHES_DEFAULT))
        ),
    }

    @functools.cache
    def lookup(name: str) -> Any:
        if name in settings:
            return settings[name]()
        raise AttributeError(f"module 'vllm.envs' has no attribute {name!r}")

    envs.__getattr__ = lookup  # type: ignore[method-assign]
    return envs


_LOGGER = logging.getLogger("kvpubd.vllm")
_LOGGER.addHandler(logging.NullHandler())
_LOGGER.propagate = False  # vLLM's warnings (e.g. xxhash's random seed) stay out of the report


def _init_logger(name: str) -> logging.Logger:
    return _LOGGER.getChild(name)


def _packages(*names: str) -> dict[str, types.ModuleType]:
    modules = {}
    for name in names:
        module = types.ModuleType(name)
        module.__path__ = []  # a package: its submodules come from sys.modules
        modules[name] = module
    return modules


def _stand_ins() -> dict[str, types.ModuleType]:
    modules = _packages(
        "vllm",
        "vllm.config",
        "vllm.utils",
        "vllm.multimodal",
        "vllm.distributed",
        "vllm.v1",
        "vllm.v1.core",
        "vllm.v1.metrics",
        "vllm.v1.structured_output",
    )

    def module(name: str, **attributes: Any) -> None:
        modules[name] = types.ModuleType(name)
        for attribute, value in attributes.items():
            setattr(modules[name], attribute, value)

    # Third-party packages vLLM needs and this path does not: torch for a type in a signature,
    # cbor2 for the *_cbor hash functions (not the ones measured).
    module("torch", Tensor=_absent("Tensor"))
    module("cbor2", dumps=_not_called("cbor2.dumps"))
    modules["vllm.envs"] = _envs_module()
    modules["vllm"].envs = modules["vllm.envs"]  # type: ignore[attr-defined]
    module("vllm.logger", init_logger=_init_logger)
    modules["vllm.config"].VllmConfig = _absent("VllmConfig")  # type: ignore[attr-defined]
    module("vllm.config.kv_events", KVEventsConfig=vllm_source.KVEventsConfig)
    modules["vllm.utils"].length_from_prompt_token_ids_or_embeds = _length_of_prompt  # type: ignore[attr-defined]
    module(
        "vllm.utils.network_utils",
        **{
            name: _not_called(name)
            for name in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path")
        },
    )
    # as_list only serves TokenBuffer's comparisons and concatenations, not used here.
    module("vllm.utils.collection_utils", as_list=_not_called("as_list"))
    module("vllm.utils.math_utils", cdiv=_not_called("cdiv"))
    module("vllm.multimodal.inputs", MultiModalFeatureSpec=_absent("MultiModalFeatureSpec"))
    module(
        "vllm.multimodal.utils", get_mm_features_in_window=_not_called("get_mm_features_in_window")
    )
    module("vllm.pooling_params", PoolingParams=_absent("PoolingParams"))
    module("vllm.sampling_params", SamplingParams=_SamplingParams)
    module(
        "vllm.v1.engine",
        EngineCoreEvent=_absent("EngineCoreEvent"),
        EngineCoreEventType=_absent("EngineCoreEventType"),
        EngineCoreRequest=_absent("EngineCoreRequest"),
        FinishReason=_FinishReason,
    )
    module("vllm.v1.kv_hints", KvHintsEnvelope=_absent("KvHintsEnvelope"))
    module("vllm.v1.metrics.stats", PrefillStats=_Stats, RequestSpecDecodeMetrics=_Stats)
    module("vllm.v1.structured_output.request", StructuredOutputRequest=_StructuredOutputRequest)
    module("vllm.v1.utils", ConstantList=_ConstantList, tensor_data=_not_called("tensor_data"))
    module(
        "vllm.v1.kv_cache_interface",
        iter_layer_specs=_not_called("iter_layer_specs"),
        **{
            name: _absent(name)
            for name in (
                "KVCacheConfig",
                "KVCacheGroupSpec",
                "KVCacheSpec",
                "MambaSpec",
                "UniformTypeKVCacheSpecs",
            )
        },
    )
    module("vllm.v1.kv_cache_spec_registry", KVCacheSpecRegistry=_absent("KVCacheSpecRegistry"))
    module(
        "vllm.v1.core.kv_cache_metrics",
        KVCacheMetricsCollector=_absent("KVCacheMetricsCollector"),
    )
    return modules


def load() -> VllmBlockPool:
    """vLLM's block pool and what it runs on, from the extracted files, importing stand-ins
    for the rest of vLLM (sys.modules is restored afterwards: a real vLLM or torch in this
    process is left alone). FileNotFoundError names the files missing."""
    absent = missing_files()
    if absent:
        raise FileNotFoundError(
            "vLLM's files are not all extracted, missing: "
            + ", ".join(map(str, absent))
            + f" (set {vllm_source.DIR_ENV_VAR} or run `kvpubd bench vllm-extract WHEEL`)"
        )
    stand_ins = _stand_ins()
    names = [*stand_ins, *LOADED]
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(stand_ins)
    loaded: dict[str, types.ModuleType] = {}
    try:
        for name, path in source_paths().items():
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # before running it, as an import does
            spec.loader.exec_module(module)
            loaded[name] = module
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return VllmBlockPool(
        block_pool=loaded["vllm.v1.core.block_pool"],
        kv_cache_utils=loaded["vllm.v1.core.kv_cache_utils"],
        request=loaded["vllm.v1.request"],
        hashing=loaded["vllm.utils.hashing"],
        kv_events=loaded["vllm.distributed.kv_events"],
        gc_utils=loaded["vllm.utils.gc_utils"],
        sampling_params=_SamplingParams,
        version=vllm_source.extracted_version(),
    )
