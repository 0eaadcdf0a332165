"""Warnings of one kind, at most one every few seconds: what an engine sends over and over (junk,
seqs that keep going back) is not a log line per message."""

from __future__ import annotations

import logging
import time

EVERY_S = 10.0


class ThrottledLog:
    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S) -> None:
        self._logger = logger
        self.every_s = every_s
        self._logged_at = -every_s
        self._unlogged = 0  # warnings left out since the last one logged

    def warning(self, message: str, *args: object) -> None:
        """``message % args``, unless one was logged less than ``every_s`` ago; the next one
        logged says how many were left out."""
        now = time.monotonic()
        if now - self._logged_at < self.every_s:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since)" if self._unlogged else ""
        self._logger.warning(message + "%s", *args, more)
        self._logged_at, self._unlogged = now, 0
