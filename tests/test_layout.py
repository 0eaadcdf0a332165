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

# Package -> the modules its modules may never import (at any depth, lazily included).
# protocol/ also keeps out what only the daemon runs, its settings model (pydantic) and its
# CURVE authenticator thread, so a client that imports it pays for neither.
FORBIDDEN = {
    "client": ("kvpubd.daemon", "kvpubd.tools", "kvpubd.cli"),
    "daemon": ("kvpubd.client", "kvpubd.tools", "kvpubd.cli"),
    # Following an engine is the daemon's to run: upstream/ keeps out what the daemon may not
    # import.
    "upstream": ("kvpubd.client", "kvpubd.daemon", "kvpubd.tools", "kvpubd.cli"),
    "protocol": (
        "kvpubd.client",
        "kvpubd.daemon",
        "kvpubd.tools",
        "kvpubd.cli",
        "pydantic",
        "pydantic_settings",
        "zmq.auth.thread",
    ),
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


@pytest.mark.process
def test_importing_the_command_line_loads_nothing_heavy() -> None:
    """`import kvpubd.cli` (what every command pays) loads no client, daemon, tools, rich,
    NumPy, ZeroMQ or pydantic: each command imports what it runs."""
    loaded = loaded_by("import kvpubd.cli")
    assert sorted(m for m in loaded if m.startswith(HEAVY)) == []


@pytest.mark.process
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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """kvpubd module -> the kvpubd modules it imports (lazy ones included): ``from a import b``
    names module ``a.b`` where that is a module, else ``a``."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in paths else known(base))
        graph[name] = {target for target in targets if target and target != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another round a circle (Tarjan's strongly
    connected components of more than one module)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            group = [stack.pop()]
            while group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_no_import_cycles() -> None:
    """No kvpubd module imports itself through others, not even lazily: a circle means two
    modules share one job, or a shared piece belongs in a third."""
    graph = import_graph()
    assert graph.get("kvpubd.tools.bench")  # the graph was built
    assert import_cycles(graph) == []


def test_an_import_cycle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
