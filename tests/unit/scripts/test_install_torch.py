"""scripts/install_torch.sh picks the torch build for the machine and says which: PyTorch's CPU
index without a GPU, pip's default index when that index is unreachable (quickly: one probe, no
pip retries), the default (CUDA) wheel where nvidia-smi sees a GPU.

pip itself is replaced by a shim on PATH that records its arguments, so nothing is installed; a
local HTTP server stands in for a reachable CPU index."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "install_torch.sh"


def _shims(tmp_path: Path, gpu: bool) -> Path:
    """A bin folder: python3 that logs `-m pip ...` calls and runs everything else for real, and
    (gpu=True) an nvidia-smi that lists one device."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    py = bin_dir / "python3"
    py.write_text(f'#!/usr/bin/env bash\nif [ "$1 $2" = "-m pip" ]; then echo "$@" >> "{tmp_path}/pip.log"; '
                  f'exit 0; fi\nexec {sys.executable} "$@"\n')
    py.chmod(0o755)
    if gpu:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
        smi.chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, index: str, gpu: bool = False, env_extra: dict | None = None) -> tuple[str, str]:
    """The script's stdout and the pip command it ran; it must write nothing to stderr."""
    bin_dir = _shims(tmp_path, gpu)
    # PATH without any real nvidia-smi: only the shims and the tools bash needs.
    path = f"{bin_dir}:" + ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    env = {k: v for k, v in os.environ.items() if k != "CELERIS_TORCH"} | {"PATH": path, "CELERIS_TORCH_CPU_INDEX": index}
    out = subprocess.run(["bash", str(SCRIPT)], env=env | (env_extra or {}), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr, out.stderr
    return out.stdout, (tmp_path / "pip.log").read_text().strip()


@pytest.fixture
def cpu_index():
    """A reachable stand-in for https://download.pytorch.org/whl/cpu (answers /torch/)."""

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            self.send_response(200 if self.path.startswith("/whl/cpu/torch") else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    server.shutdown()


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_no_gpu_takes_the_cpu_index(tmp_path, cpu_index):
    said, pip = _run(tmp_path, cpu_index)
    assert pip == f"-m pip install --quiet --index-url {cpu_index} torch==2.13.0"
    assert f"torch for cpu from PyTorch's CPU index ({cpu_index})" in said


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_an_unreachable_cpu_index_falls_back_to_the_default_index(tmp_path):
    dead = "http://127.0.0.1:9/whl/cpu"  # the discard port: connection refused at once
    said, pip = _run(tmp_path, dead)
    assert pip == "-m pip install --quiet torch==2.13.0"
    assert f"from pip's default index (PyTorch's CPU index {dead} is unreachable)" in said
    assert "installed torch " in said  # the build it got, named


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_gpu_takes_the_default_cuda_wheel(tmp_path, cpu_index):
    said, pip = _run(tmp_path, cpu_index, gpu=True)
    assert pip == "-m pip install --quiet torch==2.13.0"
    assert "torch for cuda from pip's default index" in said


@pytest.mark.slow  # starts python a few times
def test_no_warning_while_numpy_is_not_installed_yet(tmp_path, cpu_index):
    """setup.sh runs this before numpy is installed: the build check must not import torch, whose
    import then warns "Failed to initialize NumPy"."""
    blocker = tmp_path / "no-numpy" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    said, _ = _run(tmp_path, cpu_index, env_extra={"PYTHONPATH": str(blocker.parent)})
    assert "installed torch 2.13.0" in said


def test_setup_runs_it_first():
    lines = [line for line in (ROOT / "scripts" / "setup.sh").read_text().splitlines() if "pip install" in line
             or "install_torch" in line]
    assert "install_torch.sh" in lines[0] and not any("torch==" in line for line in lines)
    assert shutil.which("bash")
