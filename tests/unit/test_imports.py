"""The import direction of DESIGN.md: clients -> protos; server -> engine, protos; engine -> torch only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The one sanctioned crossing: the `celeris` command hands client subcommands to clients.cli,
# from inside a function, so serving never loads the client side.
ALLOWED = {("server/cli.py", "celeris_client.cli")}

FORBIDDEN = {
    "engine": ("grpc", "grpc_status", "grpc_health", "grpc_reflection", "google.protobuf", "google.rpc", "celeris",
               "server", "clients"),
    "server": ("clients",),
    "clients": ("engine", "server", "torch"),
}


def imports_of(path: Path, top_level_only: bool = False) -> set[str]:
    """Every module a file imports, including imports inside functions (unless top_level_only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_import_direction(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imports_of(path):
            if (str(path.relative_to(ROOT)), name) in ALLOWED:
                continue
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_the_client_dispatch_is_explicit_and_lazy():
    cli = ROOT / "server" / "cli.py"
    assert "celeris_client.cli" in imports_of(cli), "the dispatch must be a real import the walker sees"
    assert not any(n == "clients" or n.startswith("clients.") for n in imports_of(cli, top_level_only=True))
    assert "import_module" not in cli.read_text(), "no string imports that hide the dispatch"
    code = ("import sys, server.cli\n"
            "celeris.server.cli.build_parser()\n"
            "assert not any(m == 'clients' or m.startswith('clients.') for m in sys.modules), 'clients loaded'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_server_modules_import_no_circle():
    """app, cli and cli_commands (and every other server module) form no import circle."""
    graph = {}
    for path in sorted((ROOT / "server").glob("*.py")):
        mod = f"server.{path.stem}"
        graph[mod] = {n for n in imports_of(path) if n.startswith("server.") and n != mod}
    state: dict[str, int] = {}

    def visit(mod: str, trail: list[str]) -> None:
        if state.get(mod) == 2 or mod not in graph:
            return
        assert state.get(mod) != 1, "import circle: " + " -> ".join(trail + [mod])
        state[mod] = 1
        for dep in sorted(graph[mod]):
            visit(dep, trail + [mod])
        state[mod] = 2

    for mod in graph:
        visit(mod, [])


def test_clients_import_without_torch():
    code = ("import sys, importlib, pkgutil, clients\n"
            "for m in pkgutil.walk_packages(clients.__path__, 'clients.'):\n"
            "    importlib.import_module(m.name)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
