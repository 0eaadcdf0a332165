"""Exit statuses of every ``kvpubd`` command, and the one-line failure they print."""

from __future__ import annotations

import typer

OK = 0
FAILURE = 1  # at run time: the daemon refused, went away or never answered
USAGE = 2  # the command line or the configuration is wrong; nothing was done
INTERRUPTED = 130  # Ctrl-C (SIGINT)
TERMINATED = 143  # SIGTERM (a CI cancel, a supervisor); `serve` exits 0 on it
HUNG_UP = 129  # SIGHUP (the terminal closed); `serve` reloads its config on it


def fail(message: str, code: int = FAILURE) -> typer.Exit:
    """Print ``kvpubd: message`` on stderr; raise the result to exit with ``code``."""
    typer.echo(f"kvpubd: {message}", err=True)
    return typer.Exit(code)


def warn(message: str) -> None:
    typer.echo(f"kvpubd: warning: {message}", err=True)


def check_positive(option: str, value: float, integer: bool = False) -> None:
    """Exit with USAGE unless ``value`` is a positive (finite) number."""
    if not 0 < value < float("inf"):
        kind = "a positive whole number" if integer else "a positive number"
        raise fail(f"{option}: {value} is not {kind}", USAGE)
