"""A realistic shared-prefix workload for a running daemon, through its control socket.

Requests arrive as a Poisson process at ``rate`` per second; each stores a prompt (pinning its
blocks, as a running request would), stays open for ``hold`` seconds, then is released. Prompts
come from a mix of three kinds that share prefixes the way serving traffic does:

- ``chat``: one of a few system prompts, then a conversation that grows by a turn each time it
  comes back (every turn's prompt extends the previous one);
- ``doc``: one of a set of long documents, popular ones far more often (Zipf), then a short
  question of its own;
- ``unique``: tokens nobody shares.

Conversations and documents keep to one rank (key % ranks), as a prefix-aware router would.
Everything is seeded: the same options give the same prompts."""

from __future__ import annotations

import itertools
import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpubd.client import ControlClient, ControlError, ControlTimeout
from kvpubd.interrupts import interrupts_ignored

KINDS = ("chat", "doc", "unique")
DEFAULT_MIX = "chat=5,doc=3,unique=2"
VOCAB = 32_000
SYSTEM_PROMPTS, SYSTEM_TOKENS = 4, 256
CONVERSATIONS, TURN_TOKENS, MAX_CONVERSATION_TOKENS = 32, (32, 128), 1024
DOCUMENTS, DOC_TOKENS, QUESTION_TOKENS, ZIPF_S = 32, (256, 1024), (16, 64), 1.1
UNIQUE_TOKENS = (64, 512)


def parse_mix(text: str) -> dict[str, float]:
    """``"chat=5,doc=3,unique=2"`` -> weights summing to 1; ValueError naming what is wrong."""
    weights: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep or name not in KINDS:
            raise ValueError(
                f"prompt mix {text!r}: {part.strip()!r} is not KIND=WEIGHT with KIND one of "
                f"{', '.join(KINDS)}"
            )
        if name in weights:
            raise ValueError(f"prompt mix {text!r}: {name} is given twice")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(
                f"prompt mix {text!r}: weight {value.strip()!r} is not a number"
            ) from None
        if not weight >= 0 or weight == float("inf"):
            raise ValueError(f"prompt mix {text!r}: weight of {name} must be >= 0 and finite")
        weights[name] = weight
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"prompt mix {text!r}: no kind has a positive weight")
    return {name: weight / total for name, weight in weights.items()}


@dataclass
class Prompt:
    kind: str
    key: int  # conversation or document number, for rank affinity; -1 for unique prompts
    tokens: list[int]


class Workload:
    """Draws prompts from the mix; deterministic for a given seed."""

    def __init__(self, mix: dict[str, float], seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.kinds = list(mix)
        self.weights = [mix[k] for k in self.kinds]
        rng = random.Random(seed ^ 0x5EED)
        self.system_prompts = [self._tokens(rng, SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
        self.documents = [self._tokens(rng, rng.randint(*DOC_TOKENS)) for _ in range(DOCUMENTS)]
        self.doc_weights = [1 / (rank + 1) ** ZIPF_S for rank in range(DOCUMENTS)]
        self.conversations: list[list[int]] = [[] for _ in range(CONVERSATIONS)]

    @staticmethod
    def _tokens(rng: random.Random, count: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(count)]

    def next(self) -> Prompt:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        if kind == "chat":
            return self._chat()
        if kind == "doc":
            return self._doc()
        return Prompt("unique", -1, self._tokens(self.rng, self.rng.randint(*UNIQUE_TOKENS)))

    def _chat(self) -> Prompt:
        key = self.rng.randrange(CONVERSATIONS)
        history = self.conversations[key]
        if not history or len(history) > MAX_CONVERSATION_TOKENS:
            # A new conversation starts from one of the shared system prompts.
            history[:] = self.system_prompts[self.rng.randrange(SYSTEM_PROMPTS)]
        history.extend(self._tokens(self.rng, self.rng.randint(*TURN_TOKENS)))
        return Prompt("chat", key, list(history))

    def _doc(self) -> Prompt:
        key = self.rng.choices(range(DOCUMENTS), self.doc_weights)[0]
        question = self._tokens(self.rng, self.rng.randint(*QUESTION_TOKENS))
        return Prompt("doc", key, self.documents[key] + question)


@dataclass
class LoadStats:
    requests: int = 0  # stores answered ok
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the cache already held
    released: int = 0
    sent: dict[str, int] = field(default_factory=dict)  # op -> requests sent
    failed: dict[tuple[str, str], int] = field(default_factory=dict)  # (op, code) -> refusals
    elapsed_s: float = 0.0
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> dict[str, int]:
        """Refusals by error code."""
        out: dict[str, int] = {}
        for (_, code), count in self.failed.items():
            out[code] = out.get(code, 0) + count
        return out

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def rate(self) -> float:
        """Stores that succeeded, per second."""
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def stores_sent(self) -> int:
        return self.sent.get("store", 0)

    @property
    def stores_failed(self) -> int:
        return sum(n for (op, _), n in self.failed.items() if op == "store")

    @property
    def error_rate(self) -> float:
        """Share of the stores sent that were refused."""
        return self.stores_failed / self.stores_sent if self.stores_sent else 0.0

    def progress(self) -> str:
        """``N stores sent, M succeeded, K failed (code n, ...)``."""
        errors = ", ".join(f"{code} {n}" for code, n in sorted(self.errors.items()))
        return (
            f"{self.stores_sent} stores sent, {self.requests} succeeded, "
            f"{self.stores_failed} failed" + (f" (errors: {errors})" if errors else "")
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "rate": round(self.rate, 2),
            "elapsed_s": round(self.elapsed_s, 3),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "released": self.released,
            "by_kind": dict(self.by_kind),
            "sent": dict(self.sent),
            "stores_sent": self.stores_sent,
            "stores_failed": self.stores_failed,
            "error_rate": round(self.error_rate, 4),
            "errors": self.errors,
        }


class LoadGenerator:
    """Drives one daemon through ``client`` (used from one thread only)."""

    def __init__(
        self,
        client: ControlClient,
        workload: Workload,
        *,
        rate: float,
        hold: float = 0.1,
        ranks: list[int] | None = None,
        seed: int = 0,
    ) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        if not hold >= 0:
            raise ValueError(f"hold must be >= 0, got {hold}")
        self.client = client
        self.workload = workload
        self.rate = rate
        self.hold = hold
        # The ranks stored on: by default every rank the daemon serves.
        self.ranks = ranks if ranks is not None else [e.rank for e in client.ping().endpoints]
        self.rng = random.Random(seed ^ 0xA11)
        self.stats = LoadStats()
        self._ids = itertools.count()
        self._prefix = f"lg{os.getpid()}-{random.getrandbits(24):06x}"
        self._open: deque[tuple[float, str]] = deque()  # (release time, request id)

    def run(
        self,
        duration: float,
        stop: Callable[[], bool] = lambda: False,
        on_progress: Callable[[LoadStats, float], None] | None = None,
        progress_every: float = 1.0,
    ) -> LoadStats:
        """Send requests for ``duration`` seconds (or until ``stop()``), then release every
        request still open. ``on_progress(stats, elapsed)`` is called every
        ``progress_every`` seconds meanwhile."""
        start = time.monotonic()
        next_arrival = start
        next_progress = start + progress_every
        try:
            while True:
                now = time.monotonic()
                if now - start >= duration or stop():
                    break
                if on_progress is not None and now >= next_progress:
                    self.stats.elapsed_s = now - start
                    on_progress(self.stats, now - start)
                    next_progress += progress_every
                while self._open and self._open[0][0] <= now:
                    self._release(self._open.popleft()[1])
                if now >= next_arrival:
                    self._send(now)
                    next_arrival += self.rng.expovariate(self.rate)
                    # Behind by more than a second (a slow daemon): do not burst to catch up.
                    next_arrival = max(next_arrival, now - 1.0)
                    continue
                wake = min(next_arrival, self._open[0][0]) if self._open else next_arrival
                wake = min(wake, next_progress) if on_progress is not None else wake
                time.sleep(min(max(0.0, wake - now), 0.05))
        finally:
            self.stats.elapsed_s = time.monotonic() - start
            self.release_all()
        return self.stats

    def release_all(self) -> None:
        """Release every open request; stops at the first timeout (the daemon is gone). A
        second Ctrl-C (or SIGTERM) meanwhile is ignored: requests left open pin their blocks
        in the daemon for good."""
        with interrupts_ignored():
            while self._open:
                try:
                    self._release(self._open.popleft()[1])
                except ControlTimeout:
                    self._error("release", "timeout")
                    self._open.clear()

    def _send(self, now: float) -> None:
        prompt = self.workload.next()
        ranks = self.ranks
        rank = ranks[prompt.key % len(ranks)] if prompt.key >= 0 else self.rng.choice(ranks)
        request_id = f"{self._prefix}-{next(self._ids)}"
        self._count("store")
        try:
            reply = self.client.store(request_id, prompt.tokens, rank=rank)
        except ControlError as exc:  # e.g. pool_exhausted while many requests pin blocks
            self._error("store", exc.code)
            return
        except KeyboardInterrupt:
            # Ctrl-C mid-store: the daemon may have applied it, so it is released with the
            # rest (a store that never arrived is refused as unknown_request then).
            self._open.appendleft((now, request_id))
            raise
        stats = self.stats
        stats.requests += 1
        stats.by_kind[prompt.kind] = stats.by_kind.get(prompt.kind, 0) + 1
        stats.prompt_tokens += len(prompt.tokens)
        stats.cached_tokens += reply.num_cached_tokens
        self._open.append((now + self.hold, request_id))

    def _release(self, request_id: str) -> None:
        self._count("release")
        try:
            self.client.release(request_id)
        except ControlError as exc:  # unknown_request: a forced reset dropped it
            self._error("release", exc.code)
            return
        self.stats.released += 1

    def _count(self, op: str) -> None:
        self.stats.sent[op] = self.stats.sent.get(op, 0) + 1

    def _error(self, op: str, code: str) -> None:
        key = (op, code)
        self.stats.failed[key] = self.stats.failed.get(key, 0) + 1
