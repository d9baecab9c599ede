"""The import direction of DESIGN.md: clients -> protos; server -> engine, protos; engine -> torch only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "engine": ("grpc", "grpc_status", "grpc_health", "grpc_reflection", "google.protobuf", "google.rpc", "celeris",
               "server", "clients"),
    "server": ("clients",),
    "clients": ("engine", "server", "torch"),
}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
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
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_clients_import_without_torch():
    code = ("import sys, importlib, pkgutil, clients\n"
            "for m in pkgutil.walk_packages(clients.__path__, 'clients.'):\n"
            "    importlib.import_module(m.name)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
