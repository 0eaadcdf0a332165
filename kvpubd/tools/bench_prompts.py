"""The prompts the store benches send: realistic lengths and shared system prompts."""

from __future__ import annotations

import numpy as np


def make_prompts(count: int, seed: int = 0) -> list[bytes]:
    """Realistic prompts as packed uint32: 1-8k tokens, most starting with one of a few shared
    system prompts (256-2048 tokens), the rest unique."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 150_000, size=int(n)) for n in rng.integers(256, 2049, size=8)]
    prompts = []
    for _ in range(count):
        length = int(rng.integers(1024, 8193))
        if rng.random() < 0.8:
            prefix = prefixes[int(rng.integers(0, len(prefixes)))]
            body = rng.integers(0, 150_000, size=max(0, length - len(prefix)))
            tokens = np.concatenate([prefix, body])[:length]
        else:
            tokens = rng.integers(0, 150_000, size=length)
        prompts.append(tokens.astype("<u4").tobytes())
    return prompts
