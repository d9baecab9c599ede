"""The map cannot drift: every code name the prose uses resolves against the tree.

Scanned: README.md, docs/*.md, and every docstring under engine/ and server/. In them, a backticked
span is a code reference when it looks like one:
- a file path (`step_loop.py`, `families/block/runner.py`): some file in the repository ends so;
- a dotted name whose head is `celeris` or a module of the tree (`runner_api.select_step`,
  `celeris.engine.loop.step_loop`, `moe.ROW_ALIGN`): the module exists and so does each attribute
  after it (a top-level definition, then a member of that class);
- a dotted name whose head is a class of the tree (`StepLoop.step`): the member exists;
- a bare CamelCase name (`StepLoop`): a class, function or constant defined in the tree's Python or
  in the proto, or a name of the libraries the docs talk about (EXTERNAL below).
Anything else in backticks (flags, JSON fields, commands, values) is prose, not checked here.

And every module of engine/ and server/ is named on docs/architecture.md (its path, or its stem
where the stem is unique), so the map lists every room's furniture.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("engine", "server", "clients", "scripts", "tests", "protos", "deploy")

# Names of other projects and standards the prose names on purpose.
EXTERNAL = {
    "AsyncOpenAI", "OpenAI", "ChatOpenAI", "BadRequest", "RetryInfo", "ErrorInfo", "DecodeError",
    "RecursionError", "UserWarning", "RuntimeError", "ValueError", "TypeError", "KeyError", "OSError",
    "TimeoutError", "MemoryError", "UnicodeDecodeError", "JSONDecodeError", "CancelledError",
    "ThreadPoolExecutor", "ProcessGroup", "DeviceMesh", "CUDAGraph", "SamplingParams", "LLaDAModelLM",
    "DreamModel", "SDARForCausalLM", "LLaDA2MoeModelLM", "GenerationMixin", "PreTrainedTokenizerFast",
    "AutoTokenizer", "AutoModel", "BatchSpanProcessor", "TracerProvider", "OTLPSpanExporter",
    "ConsoleSpanExporter", "SimpleSpanProcessor", "ServerInterceptor", "HealthServicer", "GenerationConfig",
    "NemotronLabsDiffusionModel", "Gemma4ForConditionalGeneration", "DiffusionGemma", "JSONSchemaBench",
    "HTTPServer", "StreamReader", "StreamWriter", "BaseHTTPRequestHandler", "FastAPI", "LangChain",
    "LiteLLM", "OpenTelemetry", "GitHub", "PyPI", "PyTorch", "ChromeDriver", "MkDocs", "TypedDict",
    "SamplingMetadata", "DiffusionGemmaForBlockDiffusion", "ByteSize", "EntropyBoundSampler", "JointThreshold",
    "LinearTemperatureScheduleLogitsProcessor", "StableAndConfidentStoppingCriteria", "BlockRefinementScheduler",
    # the published reference code's files, and tensor names of released checkpoints
    "modeling_llada2_moe.py", "configuration_llada2_moe.py", "dllm/pipelines/llada21/models/modeling_llada2_moe.py",
    "Tools/generate_loop_fixtures.py", "attention.query_key_value", "attention.dense", "modeling_llada.py",
    "configuration_llada.py",
}
# Heads that name a folder, not a module: prose writes `celeris.server.x` for code, and `server.x` is a log event.
FOLDERS = {"engine", "server", "clients", "scripts", "tests", "protos", "deploy", "docs",
           # server's rooms by door: `grpc.x` in prose is the grpc library, `http.x` a log event
           "grpc", "http"}
HOSTNAME = re.compile(r"\.(?:com|org|io|net|dev)$")
FILE_EXT = re.compile(r"\.(?:safetensors|json|yaml|yml|md|proto|txt|sh|toml|html|whl|tar|gz)$")

CAMEL = re.compile(r"^_?[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?:\(\))?$")
PATH = re.compile(r"^[A-Za-z0-9_./-]*[A-Za-z0-9_]\.py$")
SPAN = re.compile(r"`([^`\n]+)`")


def _py_files() -> list[Path]:
    return [p for d in CODE_DIRS if (ROOT / d).exists() for p in (ROOT / d).rglob("*.py")
            if "__pycache__" not in p.parts]


def _members(tree: ast.AST) -> dict[str, set[str]]:
    """Top-level names of a module ("" key) and each top-level class's members."""
    out: dict[str, set[str]] = defaultdict(set)
    for node in getattr(tree, "body", []):
        for name in _defined(node):
            out[""].add(name)
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                out[node.name].update(_defined(item))
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
                    out[node.name].add(item.attr)
    return out


def _defined(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


class Tree:
    """What the repository defines: files, modules by stem and dotted name, classes, members."""

    def __init__(self) -> None:
        self.files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                      if p.is_file() and ".git" not in p.parts and "__pycache__" not in p.parts]
        self.modules: dict[str, list[dict[str, set[str]]]] = defaultdict(list)  # stem or dotted -> members
        self.classes: dict[str, list[set[str]]] = defaultdict(list)
        self.names: set[str] = set()
        for path in _py_files():
            members = _members(ast.parse(path.read_text(), filename=str(path)))
            for key in self._module_keys(path):
                self.modules[key].append(members)
            for cls, names in members.items():
                if cls:
                    self.classes[cls].append(names)
            self.names |= members[""]
        for proto in (ROOT / "protos").rglob("*.proto"):
            self._read_proto(proto.read_text())

    def _read_proto(self, text: str) -> None:
        """Messages, enums, services and rpcs as names; each message's fields as its members."""
        stack: list[str] = []
        for line in text.splitlines():
            line = line.split("//")[0].strip()
            opened = re.match(r"(?:message|enum|service|oneof)\s+(\w+)\s*\{", line)
            if opened:
                self.names.add(opened.group(1))
                stack.append(opened.group(1) if not line.startswith("oneof") else stack[-1])
                self.classes.setdefault(stack[-1], [set()])
                continue
            if line.startswith("}") and stack:
                stack.pop()
                continue
            field = re.match(r"(?:optional |repeated )?[\w.<>, ]+?\s(\w+)\s*=\s*\d+", line) or re.match(r"(\w+)\s*=", line)
            rpc = re.match(r"rpc\s+(\w+)", line)
            if rpc:
                self.names.add(rpc.group(1))
            elif field and stack:
                self.classes[stack[-1]][0].add(field.group(1))
                self.names.add(field.group(1)) if field.group(1).isupper() else None

    @staticmethod
    def _module_keys(path: Path) -> list[str]:
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts:
            return []
        keys = {parts[-1], ".".join(parts)}
        installed = {"engine": ["celeris", "engine"], "server": ["celeris", "server"], "clients": ["celeris_client"]}
        if parts[0] in installed:
            keys.add(".".join(installed[parts[0]] + parts[1:]))
            if parts[:3] == ["clients", "celeris", "v1"]:
                keys.add(".".join(parts[1:]))
        for i in range(1, len(parts) - 1):  # partial dotted paths: loop.step_loop, families.block.runner
            keys.add(".".join(parts[i:]))
        return sorted(keys)

    def resolves(self, ref: str) -> bool:
        ref = ref.removesuffix("()")
        if ref in EXTERNAL:
            return True
        if PATH.match(ref):
            return any(f == ref or f.endswith("/" + ref.lstrip("./")) for f in self.files)
        if ref.startswith("celeris.v1.") and ref.split(".")[2] in self.names:  # the proto's own names
            return True
        if DOTTED.match(ref):
            return self._dotted(ref.split("."))
        return ref in self.names or ref in self.classes or ref in EXTERNAL or hasattr(builtins, ref)

    def _dotted(self, parts: list[str]) -> bool:
        for i in range(len(parts), 0, -1):  # the longest module prefix, then attributes
            key = ".".join(parts[:i])
            if key in self.modules:
                if any(self._attrs(m, parts[i:]) for m in self.modules[key]):
                    return True
        if parts[0] in self.classes:
            return any(self._in_class(parts[0], names, parts[1:]) for names in self.classes[parts[0]])
        return False

    def _attrs(self, members: dict[str, set[str]], rest: list[str]) -> bool:
        if not rest:
            return True
        if rest[0] not in members[""]:
            # `config.prefix_cache_bytes`: prose names an instance by its module; a member of one of its classes
            return len(rest) == 1 and any(rest[0] in names for cls, names in members.items() if cls)
        if len(rest) == 1:
            return True
        return rest[0] in members and self._in_class(rest[0], members[rest[0]], rest[1:])

    def _in_class(self, cls: str, names: set[str], rest: list[str]) -> bool:
        if not rest:
            return True
        return rest[0] in names or (rest[0] in self.classes and len(rest) == 1) or \
            any(rest[0] in other for other in self.classes.get(cls, []))


def is_reference(span: str, tree: Tree) -> bool:
    """Whether a backticked span names code (see the module docstring); prose otherwise."""
    span = span.strip().removesuffix("()")
    if " " in span or span.startswith(("-", "/", "$")) or "=" in span or HOSTNAME.search(span) or FILE_EXT.search(span):
        return False
    if PATH.match(span):
        return True
    if DOTTED.match(span):
        head, second = span.split(".")[:2]
        if head == "celeris":
            return second in ("engine", "server", "v1")
        return head not in FOLDERS and (head in tree.modules or head in tree.classes)
    return bool(CAMEL.match(span))


def texts() -> list[tuple[str, str]]:
    """(where, text) for the README, every page of docs/, and every docstring in engine/ and server/."""
    out = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    for folder in ("engine", "server"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        out.append((f"{path.relative_to(ROOT).as_posix()}:{getattr(node, 'lineno', 1)}", doc))
    return out


@lru_cache(maxsize=1)
def tree() -> Tree:
    return Tree()


def stale(text: str, where: str) -> list[str]:
    t = tree()
    return [f"{where}: `{s}`" for s in SPAN.findall(text) if is_reference(s, t) and not t.resolves(s.strip())]


def unnamed_modules(page: str) -> list[str]:
    """Modules of engine/ and server/ that the architecture page does not name."""
    paths = [p for folder in ("engine", "server") for p in sorted((ROOT / folder).rglob("*.py"))
             if p.name != "__init__.py" and "__pycache__" not in p.parts]
    stems = defaultdict(int)
    for p in paths:
        stems[p.stem] += 1
    missing = []
    for p in paths:
        rel = p.relative_to(ROOT).with_suffix("")
        parent = rel.parts[-2]
        qualified = [f"{parent}/{p.stem}", f"{parent}.{p.stem}"]
        named = any(q in page for q in qualified) or re.search(rf"{parent}/[^\n]*\b{p.stem}\.py\b", page)
        if stems[p.stem] == 1:
            named = named or re.search(rf"(?<![\w-]){re.escape(p.stem)}(?:\.py\b|\.|`|\b)", page)
        if not named:
            missing.append(rel.as_posix() + ".py")
    return missing


def test_every_code_name_in_the_docs_resolves():
    found = [line for where, text in texts() for line in stale(text, where)]
    assert not found, "names that no longer exist (rename them in the prose, or define them):\n" + "\n".join(found)


def test_every_engine_and_server_module_is_on_the_map():
    missing = unnamed_modules((ROOT / "docs" / "architecture.md").read_text())
    assert not missing, "docs/architecture.md does not name:\n" + "\n".join(missing)


def test_the_map_sees_a_planted_stale_name():
    """The check can fail: names that do not exist are reported, names that do are not."""
    planted = ("The loop calls `step_loop.StepLoop.step` and `runner_api.no_such_tail`; "
               "`families/canvas/gone.py`, `SimRunner` and `celeris.engine.loop.revise_sequence` are gone; "
               "`--port 8000` and `max_tokens` are prose.")
    assert stale(planted, "planted") == [
        "planted: `runner_api.no_such_tail`", "planted: `families/canvas/gone.py`", "planted: `SimRunner`",
        "planted: `celeris.engine.loop.revise_sequence`"]
    assert "engine/loop/step_loop.py" in unnamed_modules("only `scheduler.py` here")
    assert "engine/loop/step_loop.py" not in unnamed_modules("loop/ holds step_loop.py")
