"""The daemon a long bench runs against: started on free loopback ports with its metrics on,
and at the end stopped with a report of whether it survived."""

from __future__ import annotations

from typing import Any

from kvpubd.tools.launcher import DaemonProcess, free_tcp_ports


def start_with_free_ports(overrides: dict[str, dict[str, Any]]) -> DaemonProcess:
    """A tcp daemon with metrics on; the metrics port is picked at random, so a clash with
    another process gets a second try with a fresh one."""
    for attempt in range(3):
        (metrics_port,) = free_tcp_ports(1)
        daemon = DaemonProcess({**overrides, "metrics": {"port": metrics_port}}, transport="tcp")
        try:
            return daemon.start()
        except RuntimeError:
            daemon.cleanup()
            if attempt == 2:
                raise
        except BaseException:  # Ctrl-C or SIGTERM while it starts: stop it, remove its files
            daemon.__exit__()
            raise
    raise AssertionError("unreachable")


def stop_and_report(daemon: DaemonProcess) -> dict[str, Any]:
    """Whether the daemon survived the bench, and its exit status on SIGTERM."""
    alive = daemon.alive()
    log_tail = "" if alive else daemon.log()[-2000:]
    try:
        code = daemon.stop(timeout=30) if alive else daemon.proc.returncode  # type: ignore[union-attr]
        report: dict[str, Any] = {"alive_at_end": alive, "exit_code": code}
    except RuntimeError:
        report = {"alive_at_end": alive, "exit_code": None, "ignored_sigterm": True}
    finally:
        daemon.cleanup()
    if log_tail:
        report["log_tail"] = log_tail
    return report
