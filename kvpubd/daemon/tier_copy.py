"""Copies between a rank's pool and its host tier (placeholder: the NumPy copier only)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvpubd.daemon.pool import BlockPool, HostPool


class Fence(Protocol):
    @property
    def done(self) -> bool: ...


class TierCopier(Protocol):
    # True: every copy is done when the call returns (fences are always done).
    synchronous: bool

    def demote(self, block_ids: np.ndarray, slots: np.ndarray) -> None: ...

    def promote(self, slots: np.ndarray, block_ids: np.ndarray) -> None: ...

    def fence(self) -> Fence: ...

    def close(self) -> None: ...


class _Done:
    done = True


class NumpyCopier:
    synchronous = True

    def __init__(self, primary: HostPool, host: HostPool) -> None:
        self._primary = primary
        self._host = host

    def demote(self, block_ids: np.ndarray, slots: np.ndarray) -> None:
        self._host._array()[slots] = self._primary._array()[block_ids]

    def promote(self, slots: np.ndarray, block_ids: np.ndarray) -> None:
        self._primary._array()[block_ids] = self._host._array()[slots]

    def fence(self) -> Fence:
        return _Done()

    def close(self) -> None:
        pass


def create_copier(primary: BlockPool, host: HostPool) -> TierCopier:
    if isinstance(primary, HostPool):
        return NumpyCopier(primary, host)
    raise NotImplementedError("GPU tier copies")
