"""The import direction of DESIGN.md: clients -> protos; server -> engine, protos; engine -> torch only.

Installed, the folders are the packages `celeris.engine` (engine/), `celeris.server` (server/) and
`celeris_client` (clients/); every import uses those names, never the folder names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Container

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The one sanctioned crossing: the `celeris` command hands client subcommands to clients.cli,
# from inside a function, so serving never loads the client side.
ALLOWED = {("server/cli/entry.py", "celeris_client.cli")}

FORBIDDEN = {
    "engine": ("grpc", "grpc_status", "grpc_health", "grpc_reflection", "google.protobuf", "google.rpc", "celeris.v1",
               "celeris.server", "celeris_client"),
    "server": ("celeris_client",),
    "clients": ("celeris.engine", "celeris.server", "torch"),
}
FOLDER_NAMES = ("engine", "server", "clients")  # importable only from a checkout's top, never installed


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


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_the_client_dispatch_is_explicit_and_lazy():
    cli = ROOT / "server" / "cli" / "entry.py"
    assert "celeris_client.cli" in imports_of(cli), "the dispatch must be a real import the walker sees"
    assert not any(n.startswith("celeris_client") for n in imports_of(cli, top_level_only=True))
    assert "import_module" not in cli.read_text(), "no string imports that hide the dispatch"
    code = ("import sys, celeris.server.cli\n"
            "celeris.server.cli.build_parser()\n"
            "assert not any(m.startswith('celeris_client') for m in sys.modules), 'the client was loaded'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_server_modules_import_no_circle():
    """app, cli.entry and cli.commands (and every other server module) form no import circle."""
    graph = {}
    for path in sorted((ROOT / "server").rglob("*.py")):
        rel = path.relative_to(ROOT / "server").with_suffix("")
        mod = ".".join(("celeris.server", *(rel.parts[:-1] if rel.name == "__init__" else rel.parts)))
        graph[mod] = {n for n in imports_of(path) if n.startswith("celeris.server.") and n != mod}
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
    code = ("import sys, importlib, pkgutil, celeris_client\n"
            "for m in pkgutil.walk_packages(celeris_client.__path__, 'celeris_client.'):\n"
            "    importlib.import_module(m.name)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_no_import_uses_a_folder_name():
    """`from engine.x import y` works from a checkout's top but not installed (and would load a second
    copy of the module beside `celeris.engine.x`): every file imports the installed names."""
    offenders = []
    for folder in ("engine", "server", "clients", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in imports_of(path):
                if name.split(".")[0] in FOLDER_NAMES:
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


# ---------------------------------------------------------------- the engine's rooms (DESIGN.md)

ENGINE = ROOT / "engine"
FAMILIES = ("canvas", "block", "revise")
# What tokens are selected by: the loop only loops and never imports these. It may read sampling's
# records of a request (`sampling.params`: a Sequence carries its SamplingParams).
SAMPLING_RULES = tuple(f"sampling.{m}" for m in ("select", "screen", "filters", "noise", "choice", "reference",
                                                  "batch", "knobs", "schedule"))
# room -> rooms (or modules) it must never import (every import, inside functions and by string too)
WALLS = {
    "loop": ("families", "models", "structured", *SAMPLING_RULES),
    "sampling": ("loop", "families"),
    "agents": ("loop", "families", "models"),  # the chat side: templates' tools, call parsers, reasoning
    **{f"families.{f}": tuple(f"families.{g}" for g in FAMILIES if g != f) for f in FAMILIES},
}


def engine_module(path: Path) -> str:
    rel = path.relative_to(ENGINE).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("celeris.engine", *parts))


def string_imports(tree: ast.AST) -> list[ast.Call]:
    """Every `importlib.import_module(...)`, `import_module(...)` and `__import__(...)` call."""
    def name(f: ast.expr) -> str:
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and name(n.func) in ("import_module", "__import__")]


def imported_by(tree: ast.AST, mods: Container[str]) -> set[str]:
    """The modules of `mods` a module's tree imports: at its top, inside functions, and by string
    (a literal `importlib.import_module("celeris.engine....")`); a `from package import module`
    counts as the module."""
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            deps.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                        for a in node.names)
    for call in string_imports(tree):
        if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
            deps.add(call.args[0].value)
    return {d for d in deps if d in mods}


def engine_graph() -> dict[str, set[str]]:
    """Module -> the engine modules it imports (`imported_by`)."""
    mods = {engine_module(p): p for p in sorted(ENGINE.rglob("*.py"))}
    return {mod: imported_by(ast.parse(path.read_text(), filename=str(path)), mods) - {mod}
            for mod, path in mods.items()}


def wall_crossings(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in graph.items():
        for room, banned in WALLS.items():
            if not mod.startswith(f"celeris.engine.{room}."):
                continue
            out += [f"{mod} imports {d}" for d in sorted(deps)
                    if any(d == f"celeris.engine.{b}" or d.startswith(f"celeris.engine.{b}.") for b in banned)]
    return out


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Every import circle among engine modules (ignoring package __init__ files, which are empty)."""
    found, state = [], {}

    def visit(mod: str, trail: list[str]) -> None:
        if state.get(mod) == 1:
            found.append(" -> ".join(trail[trail.index(mod):] + [mod]))
            return
        if state.get(mod) == 2:
            return
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            visit(dep, trail + [mod])
        state[mod] = 2

    for mod in sorted(graph):
        visit(mod, [])
    return found


def test_engine_rooms_keep_their_walls():
    """No family folder imports another; loop/ never imports families/, models/, structured/ or
    sampling's rules (what selects tokens: `SAMPLING_RULES`); sampling/ never imports loop/ or
    families/; agents/ never imports loop/, families/ or models/."""
    assert not wall_crossings(engine_graph()), "\n".join(wall_crossings(engine_graph()))


PLANTED = """
import celeris.engine.structured.masks

def later():
    from celeris.engine.sampling.select import select_tokens
    import importlib
    return importlib.import_module("celeris.engine.families.canvas.runner")
"""


def test_the_wall_check_sees_a_crossing():
    """The check itself: a loop module importing structured/ at its top, a sampling rule inside a
    function or a family by string would be caught, as would a family importing another and a
    circle closed by a string import inside a function."""
    graph = engine_graph()
    mods = set(graph)
    graph["celeris.engine.loop.step_loop"] |= imported_by(ast.parse(PLANTED), mods)
    graph["celeris.engine.families.block.runner"] = graph["celeris.engine.families.block.runner"] | {
        "celeris.engine.families.revise.model"}
    assert wall_crossings(graph) == [
        "celeris.engine.families.block.runner imports celeris.engine.families.revise.model",
        "celeris.engine.loop.step_loop imports celeris.engine.families.canvas.runner",
        "celeris.engine.loop.step_loop imports celeris.engine.sampling.select",
        "celeris.engine.loop.step_loop imports celeris.engine.structured.masks"]
    assert not any("celeris.engine.sampling.params" in c for c in circles(graph))
    graph["celeris.engine.sampling.params"] |= imported_by(ast.parse(
        "def f():\n    return importlib.import_module('celeris.engine.llm')\n"), mods)
    assert any("celeris.engine.sampling.params" in c for c in circles(graph))


def test_engine_imports_by_string_name_their_module():
    """An import by string is seen only when its name is a literal: the engine has no other kind."""
    offenders = [f"{path.relative_to(ROOT)}:{call.lineno}" for path in sorted(ENGINE.rglob("*.py"))
                 for call in string_imports(ast.parse(path.read_text()))
                 if not (call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str))]
    assert not offenders, offenders


def test_engine_has_no_import_circle():
    assert not circles(engine_graph()), "\n".join(circles(engine_graph()))


def test_engine_top_level_is_small():
    """Everything else lives in a room (families/, loop/, sampling/, models/, structured/, parallel/, training/):
    the ground floor of DESIGN.md (events, serving, llm, requests, config, errors, tokenizer, detok),
    threads.py and the package's __init__.py."""
    top = sorted(p.name for p in ENGINE.glob("*.py"))
    assert len(top) <= 10, top


# ---------------------------------------------------------------- the server's door into the engine

MAX_SERVER_ENGINE_MODULES = 5  # DESIGN.md: the server reaches the engine through its front


def server_engine_imports(planted: str = "") -> dict[str, set[str]]:
    """Engine module -> the server files that import it (at their top, inside functions, by string);
    `planted`: one more server file's source (the check's own test)."""
    mods = set(engine_graph())
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "server").rglob("*.py"))}
    if planted:
        sources["server/planted.py"] = planted
    out: dict[str, set[str]] = {}
    for name, text in sources.items():
        for mod in imported_by(ast.parse(text, filename=name), mods):
            out.setdefault(mod, set()).add(name)
    return out


def test_the_server_imports_at_most_five_engine_modules():
    """The doors use the engine's front (`celeris.engine.serving`), what a request may say
    (`requests`), what comes back (`events`) and what can go wrong (`errors`): never the loop,
    the scheduler or a room's module."""
    used = server_engine_imports()
    assert len(used) <= MAX_SERVER_ENGINE_MODULES, "\n".join(f"{m}: {sorted(f)}" for m, f in sorted(used.items()))


def test_the_server_import_count_sees_hidden_imports():
    planted = ("def later():\n    from celeris.engine.loop.scheduler import Scheduler\n"
               "    import importlib\n    return importlib.import_module('celeris.engine.models.prefix_cache')\n")
    used = server_engine_imports(planted)
    assert used["celeris.engine.loop.scheduler"] == {"server/planted.py"}
    assert used["celeris.engine.models.prefix_cache"] == {"server/planted.py"}
    assert len(used) == len(server_engine_imports()) + 2
