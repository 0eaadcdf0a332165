"""The daemon's log: lines on stderr, with a ``<N>`` syslog priority prefix under systemd.

journald reads a ``<N>`` prefix on each line a service writes as that line's priority
(SyslogLevelPrefix=, on by default), so ``journalctl -p warning`` can filter; the journal also
stamps each line itself, so no timestamp of our own there. ``JOURNAL_STREAM`` tells us that
stderr is connected to the journal."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

LEVELS = ("debug", "info", "warning", "error")
# Python level -> syslog priority (sd-daemon(3)).
SYSLOG_PRIORITY = {
    logging.DEBUG: 7,
    logging.INFO: 6,
    logging.WARNING: 4,
    logging.ERROR: 3,
    logging.CRITICAL: 2,
}


class JournalFormatter(logging.Formatter):
    """Every line of a record (a traceback's too) carries the record's priority prefix."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return prefix + super().format(record).replace("\n", "\n" + prefix)


def syslog_priority(levelno: int) -> int:
    for level in sorted(SYSLOG_PRIORITY, reverse=True):
        if levelno >= level:
            return SYSLOG_PRIORITY[level]
    return 7


def under_journal(environ: Mapping[str, str] = os.environ) -> bool:
    return bool(environ.get("JOURNAL_STREAM"))


def configure(level: str, environ: Mapping[str, str] = os.environ, tag: str | None = None) -> None:
    """Log to stderr at ``level`` (one of LEVELS); ``tag`` stands for the logger's name (a
    rank worker's lines say which rank wrote them)."""
    handler = logging.StreamHandler(sys.stderr)
    name = tag.replace("%", "%%") if tag else "%(name)s"
    if under_journal(environ):
        handler.setFormatter(JournalFormatter(f"%(levelname)s {name}: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {name}: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())
