"""A KV-event consumer that follows llm-d-router v0.10's rules, in Python (its Go code cannot
be installed here). Written from ``pkg/kvevents/zmq_subscriber.go`` of llm-d-router
(``runSubscriber`` and ``requestReplay`` as of v0.10: strict replay, no snapshot endpoint),
with its pool's per-pod ordering and its vLLM adapter's event handling reduced to the index
of block hashes per pod:

- the pod is the middle part of the topic ``kv@<pod>@<model>``;
- with a replay endpoint: on connect, while it holds no seq and is out of cooldown, it asks
  for replay from seq 0. A replay must start exactly at the seq asked for and go on without
  a hole: anything else (or an end marker with nothing replayed for a start above 0) is
  terminal: the pod is cleared, the seq forgotten, and a cooldown starts during which every
  live batch that would need a replay is dropped. A live seq below the last live seq is a
  restart (pod cleared, replay from 0); a forward jump is a gap, repaired by a replay from
  the last seq + 1; a live seq > 0 with no seq held asks for replay from 0;
- without a replay endpoint it applies every live batch and looks at no seq;
- its SUB is redialled ``retry_interval`` after it loses the publisher (go-zeromq runs
  without auto-reconnect there); the seq state survives the redial;
- a hybrid model's KV cache groups (its pool's rules, ``pkg/kvevents/pool.go``): only groups
  of a main-attention kind (full, MLA, sink-full attention) are indexed, removals of a group
  not learned as one are skipped, and so is a store whose token ids are not ``block_size``
  per block.

Timings are parameters (llm-d: 5 s redial, 30 s cooldown, 2 s replay idle timeout) so that
tests can run them small.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

U64 = (1 << 64) - 1


@dataclass
class Timings:
    retry_interval: float = 5.0
    replay_cooldown: float = 30.0
    replay_idle_timeout: float = 2.0
    replay_timeout: float = 120.0
    replay_retry_backoff: float = 0.1
    max_no_progress: int = 3


def pod_of(topic: str) -> str:
    parts = topic.split("@")
    return parts[1] if len(parts) == 3 else topic


def _hash(value: object) -> int:
    if isinstance(value, bytes):  # the adapter reads a bytes hash's last 8 bytes
        return int.from_bytes(value[-8:], "big")
    assert isinstance(value, int)
    return value & U64


# The KV cache spec kinds whose groups llm-d indexes ("main attention"); a hybrid model's
# other groups (sliding window, ...) are learned from their stores and left out.
MAIN_ATTENTION_KINDS = ("full_attention", "mla_attention", "sink_full_attention")
# Where the fields llm-d reads sit in an event of the array form, after its tag.
ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
}  # fmt: skip


def event_fields(event: dict[str, Any] | list[Any]) -> tuple[str, dict[str, Any]]:
    """An event of either wire form as (type, fields by name)."""
    if isinstance(event, dict):
        return event["type"], event
    kind = event[0]
    return kind, dict(zip(ARRAY_FIELDS.get(kind, ()), event[1:], strict=False))


class LlmdIndex:
    """Block hashes held per pod (the in-memory index, keyed by engine hash), and each pod's
    KV cache groups as their stores described them (True: a main-attention group).

    A hybrid model's events: a store of a group whose kind is not main attention is not
    indexed, nor is a store whose token ids are not ``block_size`` per block hash; a removal
    of a group not learned as main attention is skipped. Events without ``group_idx`` are
    indexed as they come."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pods: dict[str, set[int]] = {}
        self.groups: dict[str, dict[int, bool]] = {}
        self.clears = 0

    def apply(self, topic: str, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        pod = pod_of(topic)
        with self.lock:
            held = self.pods.setdefault(pod, set())
            groups = self.groups.setdefault(pod, {})
            for event in batch[1]:
                kind, fields = event_fields(event)
                hashes = fields.get("block_hashes") or []
                group = fields.get("group_idx")
                if kind == "BlockStored":
                    if group is not None:
                        groups[group] = fields.get("kv_cache_spec_kind") in MAIN_ATTENTION_KINDS
                        if not groups[group]:
                            continue
                    if len(fields["token_ids"]) != len(hashes) * fields["block_size"]:
                        continue
                    held.update(_hash(h) for h in hashes)
                elif kind == "BlockRemoved":
                    if group is not None and not groups.get(group, False):
                        continue
                    held.difference_update(_hash(h) for h in hashes)
                elif kind == "AllBlocksCleared":
                    held.clear()

    def reset(self, topic: str) -> None:
        with self.lock:
            self.pods[pod_of(topic)] = set()
            self.clears += 1

    def blocks(self, pod: str) -> set[int]:
        with self.lock:
            return set(self.pods.get(pod, set()))


class LlmdSubscriber(threading.Thread):
    """One pod's subscriber (``zmqSubscriber``), feeding ``index``."""

    def __init__(
        self,
        index: LlmdIndex,
        endpoint: str,
        replay_endpoint: str,
        topic_filter: str,
        timings: Timings | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic_filter = topic_filter
        self.t = timings or Timings()
        self.context = zmq.Context()
        self._halt = threading.Event()
        self.last_seq = 0
        self.has_last_seq = False
        self.last_live_seq = 0
        self.has_last_live_seq = False
        self.last_replay_failure: float | None = None
        self.log: list[str] = []
        self._redial_gate: threading.Event | None = None

    def hold_redial(self) -> threading.Event:
        """For tests: the next redial waits for the returned event instead of
        ``retry_interval``, so that a test decides what the publisher does meanwhile."""
        self._redial_gate = threading.Event()
        return self._redial_gate

    # -- Start / runSubscriber ---------------------------------------------------------------

    def run(self) -> None:
        while not self._halt.is_set():
            self._run_subscriber()
            gate, self._redial_gate = self._redial_gate, None
            if gate is None:
                if self._halt.wait(self.t.retry_interval):
                    return
                continue
            while not gate.wait(0.02):
                if self._halt.is_set():
                    return

    def _run_subscriber(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic_filter)
        sub.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            if self.replay_endpoint and not self.has_last_seq and self._can_attempt_replay():
                self.log.append("proactive replay on connect")
                self._request_replay(0)
            connected = False
            while not self._halt.is_set():
                ready = dict(poller.poll(20))
                if monitor in ready:
                    event = recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_CONNECTED:
                        connected = True
                    elif connected:  # lost the publisher: Recv fails, the loop redials
                        self.log.append("lost the publisher")
                        return
                if sub in ready:
                    self._on_live(sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) < 8:
            return
        topic, seq, payload = frames[0].decode(), int.from_bytes(frames[1][:8], "big"), frames[2]
        if not self.replay_endpoint:
            self.index.apply(topic, payload)
            return
        replay_attempted = False
        if self.has_last_live_seq and seq < self.last_live_seq:
            self.log.append(f"sequence reset {self.last_live_seq} -> {seq}")
            self.index.reset(topic)
            self.last_seq, self.has_last_seq = 0, False
            self.last_replay_failure = None
            replay_attempted = True
            self._request_replay(0)
        if self.has_last_live_seq and seq == self.last_live_seq:
            return
        self.last_live_seq, self.has_last_live_seq = seq, True
        if self.has_last_seq and seq <= self.last_seq:
            return
        if self.has_last_seq and seq > self.last_seq + 1:
            if not self._can_attempt_replay():
                return  # dropped during the cooldown
            self.log.append(f"gap {self.last_seq} -> {seq}")
            replay_attempted = True
            if not self._request_replay(self.last_seq + 1):
                return
        if not self.has_last_seq and seq > 0:
            if replay_attempted or not self._can_attempt_replay():
                return
            self.log.append(f"joining mid-stream at {seq}")
            if not self._request_replay(0):
                return
        if self.has_last_seq and (seq <= self.last_seq or seq > self.last_seq + 1):
            return
        self.index.apply(topic, payload)
        self.last_seq, self.has_last_seq = seq, True

    # -- replay ------------------------------------------------------------------------------

    def _can_attempt_replay(self) -> bool:
        failed = self.last_replay_failure
        return failed is None or time.monotonic() - failed >= self.t.replay_cooldown

    def _invalidate_replay(self, why: str) -> None:
        self.log.append(f"replay incomplete: {why}")
        self.index.reset(self.topic_filter)
        self.last_seq, self.has_last_seq = 0, False
        self.last_replay_failure = time.monotonic()

    def _request_replay(self, start_seq: int) -> bool:
        deadline = time.monotonic() + self.t.replay_timeout
        replayed = 0
        next_seq = start_seq
        no_progress = 0
        while True:
            if time.monotonic() > deadline:
                self._invalidate_replay("timed out")
                return False
            dealer = self.context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", next_seq.to_bytes(8, "big")])
            attempt_replayed = 0
            complete = False
            terminal: str | None = None
            expected = next_seq
            try:
                while dealer.poll(int(self.t.replay_idle_timeout * 1000)):
                    frames = dealer.recv_multipart()
                    if frames and not frames[0]:
                        frames = frames[1:]
                    if len(frames) == 3 and not frames[2]:
                        complete = True
                        break
                    if len(frames) != 3 or len(frames[1]) < 8:
                        terminal = f"malformed replay frame with {len(frames)} frames"
                        break
                    seq = int.from_bytes(frames[1][:8], "big")
                    if seq != expected:
                        terminal = f"expected sequence {expected}, got {seq}"
                        break
                    self.index.apply(frames[0].decode(), frames[2])
                    self.last_seq, self.has_last_seq = seq, True
                    replayed += 1
                    attempt_replayed += 1
                    expected += 1
            finally:
                dealer.close(linger=0)
            if terminal is not None:
                self._invalidate_replay(terminal)
                return False
            if complete:
                if replayed == 0 and start_seq > 0:
                    self._invalidate_replay(f"sequence {start_seq} was not available")
                    return False
                self.last_replay_failure = None
                return True
            if attempt_replayed == 0:
                no_progress += 1
                if no_progress >= self.t.max_no_progress:
                    self._invalidate_replay("no progress")
                    return False
            else:
                no_progress = 0
                next_seq = expected
            if self._halt.wait(self.t.replay_retry_backoff):
                return False

    def close(self) -> None:
        self._halt.set()
        self.join()
        self.context.term()
