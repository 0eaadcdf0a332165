"""vLLM's own KV-event publisher beside ours, on identical batches (``kvpubd bench publisher
--against-vllm``), with vLLM's ``kv_events.py`` loaded alone (vllm_source).

Each stream is decoded by vLLM's ``KVEventBatch`` msgspec type in other processes: its one
subscriber decodes every batch, or (``decoders`` > 1) hands the batches out to that many
decoding processes, so that decoding does not set the rate. A round's rate is its blocks over
the time from the first publish to the last decode.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpubd.interrupts import ctrl_c_kept_from_children
from kvpubd.protocol.wire import BlockHash
from kvpubd.tools.launcher import tied
from kvpubd.tools.vllm_source import kv_events_path, load_kv_events

# The batch shape: 8 BlockStored events x 16 blocks x 16 tokens.
EVENTS_PER_BATCH = 8
BLOCKS_PER_EVENT = 16
BLOCK_SIZE = 16
WARMUP_TS = -1.0  # marks the batches that only prove a subscriber is connected


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


def _decoding_subscriber(kv_path: str, endpoint: str, pipe: Any) -> None:
    """Receive and decode every batch with vLLM's ``KVEventBatch`` (one decoding process).
    Per round, answer (time of the last decode, BlockStored blocks, CPU seconds spent
    decoding, batches decoded)."""
    from kvpubd.tools.launcher import live_subscriber

    decode = _batch_decoder(kv_path)
    ctx, sub = live_subscriber(endpoint)
    pipe.send("live")
    while (command := pipe.recv()) is not None:
        first_seq, batches = command
        pipe.send("armed")
        tally = _Tally(decode)
        while tally.batches < batches:
            frames = sub.recv_multipart()
            if not first_seq <= int.from_bytes(frames[1], "big") < first_seq + batches:
                continue  # a warm-up batch still on its way
            tally.decode(frames[2])
        pipe.send(tally.answer())
    sub.close(linger=0)
    ctx.term()


def _batch_decoder(kv_path: str) -> Callable[[bytes], int]:
    """A function decoding one payload with vLLM's ``KVEventBatch``; returns its stored blocks."""
    import msgspec

    kv = load_kv_events(Path(kv_path))
    decode = msgspec.msgpack.Decoder(kv.KVEventBatch).decode
    stored = kv.BlockStored

    def blocks_of(payload: bytes) -> int:
        return sum(len(e.block_hashes) for e in decode(payload).events if type(e) is stored)

    return blocks_of


class _Tally:
    """One round of a decoding process: batches and blocks decoded, CPU seconds spent
    decoding, and when the last decode ended."""

    def __init__(self, decode: Callable[[bytes], int]) -> None:
        self._decode = decode
        self.batches = self.blocks = 0
        self.cpu = self.last = 0.0

    def decode(self, payload: bytes) -> None:
        started = time.thread_time()
        self.blocks += self._decode(payload)
        self.last = time.monotonic()
        self.cpu += time.thread_time() - started
        self.batches += 1

    def answer(self) -> tuple[float, int, float, int]:
        return self.last, self.blocks, self.cpu, self.batches


def _forwarder(endpoint: str, workers: list[str], pipe: Any) -> None:
    """The one subscriber of a stream whose decoding is shared: hands each batch of a round,
    unread, to the decoding worker at its place modulo the number of workers, then an end
    marker to each. Answers the batches it received."""
    import zmq

    from kvpubd.tools.launcher import live_subscriber

    ctx, sub = live_subscriber(endpoint)
    pushes = []
    for worker in workers:
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.bind(worker)
        pushes.append(push)
    pipe.send("live")
    while (command := pipe.recv()) is not None:
        first_seq, batches = command
        pipe.send("armed")
        received = 0
        while received < batches:
            frames = sub.recv_multipart(copy=False)
            seq = int.from_bytes(frames[1].bytes, "big")
            if not first_seq <= seq < first_seq + batches:
                continue
            pushes[(seq - first_seq) % len(pushes)].send(frames[2], copy=False)
            received += 1
        for push in pushes:
            push.send(b"")
        pipe.send(received)
    for socket in (sub, *pushes):
        socket.close(linger=0)
    ctx.term()


def _decoding_worker(kv_path: str, endpoint: str, pipe: Any) -> None:
    """Decode what the forwarder hands over until its end marker; answers as
    ``_decoding_subscriber`` does."""
    import zmq

    decode = _batch_decoder(kv_path)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(endpoint)
    pipe.send("live")
    while pipe.recv() is not None:
        pipe.send("armed")
        tally = _Tally(decode)
        while payload := pull.recv():
            tally.decode(payload)
        pipe.send(tally.answer())
    pull.close(linger=0)
    ctx.term()


class _Side:
    """One publisher and what decodes its stream: one subscribing process that decodes every
    batch, or (``decoders`` > 1) one subscribing process that shares the batches out to
    ``decoders`` decoding processes. Either way the publisher has one subscriber."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        kv_path: Path,
        publish: Any,
        warmup: Any,
        decoders: int,
        workdir: str,
    ) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.name = name
        self._publish = publish
        self.published = 0  # seqs of both publishers count batches from 0
        self.pipes: list[Any] = []
        self.processes: list[Any] = []

        def start(target: Any, *args: Any) -> Any:
            pipe, child = spawn.Pipe()
            process = spawn.Process(**tied(target, (*args, child)), daemon=True)
            with ctrl_c_kept_from_children():  # Ctrl-C is the bench's to handle: it stops them
                process.start()
            self.pipes.append(pipe)
            self.processes.append(process)
            return pipe

        if decoders == 1:
            subscriber = start(_decoding_subscriber, str(kv_path), endpoint)
        else:
            workers = [f"ipc://{workdir}/{name}-decoder{i}" for i in range(decoders)]
            subscriber = start(_forwarder, endpoint, workers)
            for worker in workers:
                start(_decoding_worker, str(kv_path), worker)
        deadline = time.monotonic() + 60
        while not subscriber.poll(0.01):
            warmup()
            self.published += 1
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: the subscribing process never received a batch")
        for pipe in self.pipes:
            if not pipe.poll(60):
                raise TimeoutError(f"{name}: a decoding process never started")
            pipe.recv()  # live
        # With a forwarder (the first process), its answer is a count of batches, not a tally.
        self._forwarded = decoders > 1

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
        decoded = answers[1:] if self._forwarded else answers
        last = max(answer[0] for answer in decoded)
        got = sum(answer[1] for answer in decoded)
        assert got == blocks, (self.name, got, blocks)
        assert sum(answer[3] for answer in decoded) == len(batches), (self.name, answers)
        busiest = max(answer[2] for answer in decoded)
        return blocks / (last - start), cpu / blocks, busiest / (last - start)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(10)


def _answer(pipe: Any, name: str, timeout_s: float = 300) -> Any:
    if not pipe.poll(timeout_s):
        raise TimeoutError(f"{name}: a decoding process did not finish its round")
    return pipe.recv()


def measure_against_vllm(
    batches: int, rounds: int, kv_path: Path | None = None, decoders: int = 1
) -> dict[str, Any]:
    """Alternating rounds of ``batches`` batches through vLLM's ZmqEventPublisher and ours,
    each stream decoded by ``decoders`` processes that share its batches between them (one
    process decodes more slowly than either publisher publishes: with one, the decoder is
    measured as much as the publisher). Each publisher has one subscriber either way."""
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
        publisher = Publisher.over_zmq(ctx, endpoint=ours_ep, buffer_steps=10_000)
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
                tmp,
            ),
            _Side(
                "vllm",
                vllm_ep,
                kv_path,
                lambda events: peer.publish(batch_type(ts=time.time(), events=events)),
                lambda: peer.publish(batch_type(ts=WARMUP_TS, events=[])),
                decoders,
                tmp,
            ),
        ]
        rates: dict[str, list[float]] = {"kvpubd": [], "vllm": []}
        cpu: dict[str, list[float]] = {"kvpubd": [], "vllm": []}
        decoder_busy: dict[str, list[float]] = {"kvpubd": [], "vllm": []}
        try:
            pairs = list(zip(sides, (ours_data, vllm_data), strict=True))
            for turn in range(rounds):
                # Each goes first in every other round: neither always follows the other's
                # round (its decoders' backlog, the caches it left).
                for side, data in pairs if turn % 2 == 0 else pairs[::-1]:
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
        # Per round pair, as for the rates: the steadier figure when the host's load drifts.
        "paired_cpu_ratio": round(
            float(np.median(np.asarray(cpu["vllm"]) / np.asarray(cpu["kvpubd"]))), 3
        ),
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
