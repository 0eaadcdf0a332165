"""The layout keeps its promises: the client never imports the daemon, the daemon never
imports the client or the tools, and `kvpubd serve` imports only what it runs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvpubd"

# Package -> the kvpubd packages its modules may never import (at any depth, lazily included).
FORBIDDEN = {
    "client": ("kvpubd.daemon", "kvpubd.tools", "kvpubd.cli"),
    "daemon": ("kvpubd.client", "kvpubd.tools", "kvpubd.cli"),
    "protocol": ("kvpubd.client", "kvpubd.daemon", "kvpubd.tools", "kvpubd.cli"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, function-level ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_no_import_against_the_flow(package: str) -> None:
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files, package
    offending = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(path)
        if any(module == f or module.startswith(f"{f}.") for f in FORBIDDEN[package])
    ]
    assert offending == []


def loaded_by(code: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


HEAVY = ("kvpubd.client", "kvpubd.tools", "rich", "kvpubd.daemon", "numpy", "zmq", "pydantic")


def test_importing_the_command_line_loads_nothing_heavy() -> None:
    """`import kvpubd.cli` (what every command pays) loads no client, daemon, tools, rich,
    NumPy, ZeroMQ or pydantic: each command imports what it runs."""
    loaded = loaded_by("import kvpubd.cli")
    assert sorted(m for m in loaded if m.startswith(HEAVY)) == []


def test_serve_loads_neither_client_nor_tools_nor_rich(tmp_path: Path) -> None:
    """Everything `kvpubd serve` imports (it stops at the missing config file, after its
    imports) leaves the client library, the tools and rich alone."""
    code = (
        "import sys\n"
        f"sys.argv = ['kvpubd', 'serve', '--config', {str(tmp_path / 'missing.toml')!r}]\n"
        "from kvpubd.cli import main\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    assert exit.code == 2, exit.code"
    )
    loaded = loaded_by(code)
    assert "kvpubd.daemon.service" in loaded  # the check can fail: serve got that far
    unwanted = ("kvpubd.client", "kvpubd.tools", "rich")
    assert sorted(m for m in loaded if m.startswith(unwanted)) == []
