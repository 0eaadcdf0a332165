"""The prompts the store benches send: realistic lengths and shared system prompts."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def iter_prompts(count: int, seed: int = 0) -> Iterator[bytes]:
    """Realistic prompts as packed uint32: 1-8k tokens, most starting with one of a few shared
    system prompts (256-2048 tokens), the rest unique. The same ``count`` and ``seed`` give
    the same prompts in every process."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 150_000, size=int(n)) for n in rng.integers(256, 2049, size=8)]
    for _ in range(count):
        length = int(rng.integers(1024, 8193))
        if rng.random() < 0.8:
            prefix = prefixes[int(rng.integers(0, len(prefixes)))]
            body = rng.integers(0, 150_000, size=max(0, length - len(prefix)))
            tokens = np.concatenate([prefix, body])[:length]
        else:
            tokens = rng.integers(0, 150_000, size=length)
        yield tokens.astype("<u4").tobytes()


def make_prompts(count: int, seed: int = 0) -> list[bytes]:
    return list(iter_prompts(count, seed))


def share_of_prompts(count: int, index: int, shares: int, seed: int = 0) -> list[tuple[int, bytes]]:
    """(position, prompt) for the positions ``index``, ``index + shares``, ... of the
    ``count`` prompts: one sender's part when they are dealt out round-robin."""
    return [(i, p) for i, p in enumerate(iter_prompts(count, seed)) if i % shares == index]
