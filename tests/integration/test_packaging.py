"""The two distributions, installed for real into a fresh virtual environment.

`pip install ./clients` is what a service that only calls Celeris installs: no torch, and the
`celeris` command still works for the client commands. `pip install --no-deps .` adds the server;
neither may add a top-level import name other than `celeris` and `celeris_client`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def source_copy(dest: Path) -> Path:
    """What `pip install` reads, copied, so the builds leave nothing behind in the checkout."""
    junk = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("engine", "server", "clients"):
        shutil.copytree(ROOT / name, dest / name, ignore=junk)
    return dest


def pip(py: Path, *args: str, cwd: Path) -> str:
    out = subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                         text=True, timeout=600, cwd=cwd)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def top_level_names(py: Path, dist: str) -> set[str]:
    """Every top-level import name a distribution installed, from its RECORD."""
    code = ("import sys, importlib.metadata as m\n"
            f"files = m.distribution({dist!r}).files\n"
            "print('\\n'.join(sorted({f.parts[0] for f in files if f.parts[0] != '..' and "
            "not f.parts[0].endswith(('.dist-info', '.pth')) and f.parts[0] != '__pycache__'})))\n")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=py.parent)  # not the checkout, whose egg-info would answer instead
    return {n.removesuffix(".py") for n in out.stdout.split()}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return source_copy(tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def client_env(tmp_path_factory, source) -> Path:
    env_dir = tmp_path_factory.mktemp("client-venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    pip(env_dir / "bin" / "python", "install", "--quiet", "./clients", cwd=source)
    return env_dir


def run(env_dir: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}"}
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, env=env, cwd=env_dir)


def test_the_client_installs_without_torch_and_its_commands_work(client_env):
    py = client_env / "bin" / "python"
    installed = pip(py, "list", "--format=freeze", cwd=client_env).lower()
    assert "torch" not in installed and "celeris-client==" in installed
    assert {line.split("==")[0].replace("_", "-") for line in installed.split()} <= {
        "celeris-client", "grpcio", "protobuf", "googleapis-common-protos", "typing-extensions", "pip", "setuptools"}

    r = run(client_env, str(py), "-c", "from celeris_client import CelerisClient; import celeris.v1.generation_pb2; "
                                       "import sys; assert 'torch' not in sys.modules; print(CelerisClient.__name__)")
    assert r.returncode == 0 and r.stdout.strip() == "CelerisClient", r.stderr

    r = run(client_env, "celeris", "generate", "--help")
    assert r.returncode == 0 and "--server" in r.stdout, r.stderr
    r = run(client_env, "celeris", "--help")
    assert r.returncode == 0, r.stderr
    assert "generate" in r.stdout and "serve" in r.stdout and "needs the server install" not in r.stderr
    assert "need the server install" in r.stdout
    for argv in (("serve",), ("run", "--prompt", "x"), ("bench", "--in-process")):
        r = run(client_env, "celeris", *argv)
        assert r.returncode == 2 and "needs the server install" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run(client_env, "celeris", "nonsense")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_installs_add_only_the_celeris_names(client_env, source):
    py = client_env / "bin" / "python"
    assert top_level_names(py, "celeris-client") == {"celeris", "celeris_client"}
    pip(py, "install", "--quiet", "--no-deps", ".", cwd=source)
    assert top_level_names(py, "celeris") == {"celeris"}
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert not any((site / name).exists() for name in ("engine", "server", "clients"))
    assert {p.name for p in (site / "celeris").iterdir()} >= {"engine", "server", "v1"}
    assert (site / "celeris" / "engine" / "training" / "celeris-tiny" / "config.json").is_file()
    assert (site / "celeris_client" / "web" / "index.html").is_file()
