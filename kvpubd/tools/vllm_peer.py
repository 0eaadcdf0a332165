"""vLLM's own KV-event publisher beside ours, on identical batches (``kvpubd bench publisher
--against-vllm``).

vLLM is never a dependency: the bench loads ``vllm/distributed/kv_events.py`` alone, taken
once from vLLM's wheel, with stand-ins for the few names it imports from the rest of vLLM
(its config dataclass, logger, network helpers and a type alias). Where the file is looked
for: ``$KVPUBD_VLLM_KV_EVENTS``, else ``~/.cache/kvpubd/vllm/kv_events.py``. To put it there:

    pip download 'vllm==0.33.0' --no-deps -d /tmp/vllm-wheel
    kvpubd bench vllm-extract /tmp/vllm-wheel/vllm-0.33.0-*.whl

Each stream is decoded in a process of its own by vLLM's ``KVEventBatch`` msgspec type; a
round's rate is its blocks over the time from the first publish to the last decode.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import sys
import tempfile
import time
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpubd.protocol.wire import BlockHash

ENV_VAR = "KVPUBD_VLLM_KV_EVENTS"
DEFAULT_PATH = Path.home() / ".cache" / "kvpubd" / "vllm" / "kv_events.py"
WHEEL_MEMBER = "vllm/distributed/kv_events.py"

# The batch shape: 8 BlockStored events x 16 blocks x 16 tokens.
EVENTS_PER_BATCH = 8
BLOCKS_PER_EVENT = 16
BLOCK_SIZE = 16
WARMUP_TS = -1.0  # marks the batches that only prove a subscriber is connected


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


# -- the batches ---------------------------------------------------------------------------


@dataclass
class BatchContent:
    """One batch's content, shared by both publishers: per event (hashes, parent, tokens)."""

    events: list[tuple[list[BlockHash], int, np.ndarray]]


def make_content(batches: int, seed: int = 0) -> list[BatchContent]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        events = []
        for _ in range(EVENTS_PER_BATCH):
            hashes: list[BlockHash] = rng.integers(0, 2**63, size=BLOCKS_PER_EVENT).tolist()
            tokens = rng.integers(0, 150_000, size=BLOCKS_PER_EVENT * BLOCK_SIZE).astype("<u4")
            events.append((hashes, int(rng.integers(0, 2**63)), tokens))
        out.append(BatchContent(events))
    return out


def ours_batches(content: list[BatchContent]) -> list[list[Any]]:
    """Our events, built the way the daemon's sink builds them from the cache's arrays."""
    from kvpubd.daemon.sink import PLAIN, stored_event

    return [
        [
            stored_event(
                hashes=hashes,
                parent_hash=parent,
                token_ids=tokens,  # type: ignore[arg-type]
                block_size=BLOCK_SIZE,
                medium="GPU",
                keys=PLAIN,
            )
            for hashes, parent, tokens in batch.events
        ]
        for batch in content
    ]


def vllm_batches(kv: types.ModuleType, content: list[BatchContent]) -> list[list[Any]]:
    """vLLM's events, as its block pool builds them (token ids a list of ints)."""
    return [
        [
            kv.BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens.tolist(),
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
            for hashes, parent, tokens in batch.events
        ]
        for batch in content
    ]


# -- the decoding subscribers --------------------------------------------------------------


def _decoding_subscriber(kv_path: str, endpoint: str, pipe: Any, part: int, parts: int) -> None:
    """Receive every batch and decode, with vLLM's ``KVEventBatch``, the share of them this
    process is given: the batches whose place in the round is ``part`` modulo ``parts``, so
    ``parts`` such processes decode each batch exactly once between them. Per round, answer
    (time of the last decode, BlockStored blocks decoded, CPU seconds spent decoding, batches
    received)."""
    import msgspec

    kv = load_kv_events(Path(kv_path))
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    from kvpubd.tools.launcher import live_subscriber

    ctx, sub = live_subscriber(endpoint)
    pipe.send("live")
    stored = kv.BlockStored
    while True:
        command = pipe.recv()
        if command is None:
            break
        first_seq, batches = command
        end_seq = first_seq + batches
        pipe.send("armed")
        blocks, received, cpu, last = 0, 0, 0.0, 0.0
        while received < batches:
            frames = sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            if not first_seq <= seq < end_seq:
                continue  # a warm-up batch still on its way
            received += 1
            if (seq - first_seq) % parts != part:
                continue
            started = time.thread_time()
            for event in decoder.decode(frames[2]).events:
                if type(event) is stored:
                    blocks += len(event.block_hashes)
            last = time.monotonic()
            cpu += time.thread_time() - started
        pipe.send((last, blocks, cpu, received))
    sub.close(linger=0)
    ctx.term()


class _Side:
    """One publisher and the processes that decode its stream."""

    def __init__(
        self, name: str, endpoint: str, kv_path: Path, publish: Any, warmup: Any, decoders: int
    ) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.name = name
        self._publish = publish
        self._warmup = warmup
        self.published = 0  # seqs of both publishers count batches from 0
        self.pipes = []
        self.processes = []
        for part in range(decoders):
            pipe, child = spawn.Pipe()
            process = spawn.Process(
                target=_decoding_subscriber,
                args=(str(kv_path), endpoint, child, part, decoders),
                daemon=True,
            )
            process.start()
            self.pipes.append(pipe)
            self.processes.append(process)
        deadline = time.monotonic() + 60
        for pipe in self.pipes:
            while not pipe.poll(0.01):
                self._warmup()
                self.published += 1
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: a decoding subscriber never received a batch")
            pipe.recv()

    def round(self, batches: list[Any], blocks: int) -> tuple[float, float, float]:
        """(blocks/s delivered, publisher CPU seconds per block, share of the round the
        busiest decoder spent decoding). This process runs nothing but the publisher during a
        round (vLLM's publisher thread included), so its CPU time is the publisher's cost,
        whatever else shares the machine. A decoder busy for nearly the whole round is what
        bounds the delivered rate, not the publisher."""
        for pipe in self.pipes:
            pipe.send((self.published, len(batches)))
        for pipe in self.pipes:
            pipe.recv()  # armed
        cpu = time.process_time()
        start = time.monotonic()
        for batch in batches:
            self._publish(batch)
        self.published += len(batches)
        answers = [_answer(pipe, self.name) for pipe in self.pipes]
        cpu = time.process_time() - cpu
        last = max(answer[0] for answer in answers)
        got = sum(answer[1] for answer in answers)
        assert got == blocks, (self.name, got, blocks)
        assert all(answer[3] == len(batches) for answer in answers), (self.name, answers)
        busiest = max(answer[2] for answer in answers)
        return blocks / (last - start), cpu / blocks, busiest / (last - start)

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            pipe.send(None)
            process.join(10)


def _answer(pipe: Any, name: str, timeout_s: float = 300) -> tuple[float, int, float, int]:
    if not pipe.poll(timeout_s):
        raise TimeoutError(f"{name}: a decoding subscriber did not finish its round")
    return pipe.recv()


def measure_against_vllm(
    batches: int, rounds: int, kv_path: Path | None = None, decoders: int = 1
) -> dict[str, Any]:
    """Alternating rounds of ``batches`` batches through vLLM's ZmqEventPublisher and ours,
    each stream decoded by ``decoders`` processes that share its batches between them (one
    process decodes more slowly than either publisher publishes: with one, the decoder is
    measured as much as the publisher)."""
    import zmq

    from kvpubd.daemon.publisher import Publisher

    kv_path = kv_path or kv_events_path()
    kv = load_kv_events(kv_path)
    content = make_content(batches)
    ours_data, vllm_data = ours_batches(content), vllm_batches(kv, content)
    blocks = batches * EVENTS_PER_BATCH * BLOCKS_PER_EVENT
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="kvpv") as tmp:
        ours_ep, vllm_ep = f"ipc://{tmp}/ours", f"ipc://{tmp}/vllm"
        publisher = Publisher(ctx, endpoint=ours_ep, buffer_steps=10_000)
        peer = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=vllm_ep, buffer_steps=10_000)
        batch_type = kv.KVEventBatch
        sides = [
            _Side(
                "kvpubd",
                ours_ep,
                kv_path,
                lambda events: publisher.publish(events),
                lambda: publisher.publish([], WARMUP_TS),
                decoders,
            ),
            _Side(
                "vllm",
                vllm_ep,
                kv_path,
                lambda events: peer.publish(batch_type(ts=time.time(), events=events)),
                lambda: peer.publish(batch_type(ts=WARMUP_TS, events=[])),
                decoders,
            ),
        ]
        rates: dict[str, list[float]] = {"kvpubd": [], "vllm": []}
        cpu: dict[str, list[float]] = {"kvpubd": [], "vllm": []}
        decoder_busy: dict[str, list[float]] = {"kvpubd": [], "vllm": []}
        try:
            for _ in range(rounds):
                for side, data in zip(sides, (ours_data, vllm_data), strict=True):
                    rate, cpu_per_block, busy = side.round(data, blocks)
                    rates[side.name].append(rate)
                    cpu[side.name].append(cpu_per_block)
                    decoder_busy[side.name].append(busy)
        finally:
            for side in sides:
                side.close()
            peer.shutdown()
            publisher.close()
    ctx.term()
    ours, theirs = float(np.median(rates["kvpubd"])), float(np.median(rates["vllm"]))
    # Adjacent rounds share the machine's load: the median of their ratios is the steadier
    # figure on a busy host.
    paired = np.asarray(rates["kvpubd"]) / np.asarray(rates["vllm"])
    ours_cpu, theirs_cpu = float(np.median(cpu["kvpubd"])), float(np.median(cpu["vllm"]))
    return {
        "kvpubd_blocks_per_s": round(ours),
        "vllm_blocks_per_s": round(theirs),
        "ratio": round(ours / theirs, 3),
        "paired_ratio": round(float(np.median(paired)), 3),
        "kvpubd_cpu_us_per_block": round(ours_cpu * 1e6, 3),
        "vllm_cpu_us_per_block": round(theirs_cpu * 1e6, 3),
        "cpu_ratio": round(theirs_cpu / ours_cpu, 3),
        # Near 1: that stream's decoding process, not its publisher, set the delivered rate.
        "decoder_busy": {k: round(float(np.median(v)), 3) for k, v in decoder_busy.items()},
        "decoders": decoders,
        "rounds": rounds,
        "batches": batches,
        "batch": f"{EVENTS_PER_BATCH} BlockStored x {BLOCKS_PER_EVENT} blocks x "
        f"{BLOCK_SIZE} tokens",
        "vllm_kv_events": str(kv_path),
        "all_rates": {k: [round(r) for r in v] for k, v in rates.items()},
    }
