"""A vLLM user's habits (issue 45): HTTP on by default on port 8000 beside gRPC on 50051, the
images' settings from the environment, `--device cuda` without CUDA as one line, and models by
Hugging Face id through a cache laid out as huggingface_hub lays it out, offline."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from celeris.engine.llm import EMBEDDED_MODEL
from tests.integration.server_process import ROOT, ServerProcess, free_port
from tests.integration.hf_cache import REPO_ID, COMMIT, hf_cache


def _parse(*argv: str):
    from celeris.server.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_http_is_on_by_default_on_8000_and_off_with_no_http_or_port_0(monkeypatch):
    from celeris.server.cli.commands import http_port

    for name in ("CELERIS_HOST", "CELERIS_HTTP_PORT", "CELERIS_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)
    a = _parse()
    assert (a.grpc_port, http_port(a), a.host, a.metrics_port) == (50051, 8000, "127.0.0.1", None)
    assert http_port(_parse("--no-http")) is None and http_port(_parse("--port", "0")) is None
    assert http_port(_parse("--port", "8080")) == 8080 == http_port(_parse("--http-port", "8080"))


def test_port_is_the_http_port_as_in_vllm_and_grpc_has_its_own_flag(monkeypatch, capsys):
    """`--port` is vLLM's (the OpenAI API); gRPC moved to --grpc-port, and --help says so."""
    from celeris.server.cli import build_parser

    for name in ("CELERIS_HTTP_PORT", "CELERIS_GRPC_PORT"):
        monkeypatch.delenv(name, raising=False)
    a = _parse("--port", "8011", "--grpc-port", "50052")
    assert (a.http_port, a.grpc_port) == (8011, 50052)
    assert _parse("--port", "8011").grpc_port == 50051  # gRPC stays where it was
    monkeypatch.setenv("CELERIS_GRPC_PORT", "6000")
    assert _parse().grpc_port == 6000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--port HTTP_PORT, --http-port HTTP_PORT the OpenAI-compatible HTTP API" in text
    assert "--grpc-port GRPC_PORT the gRPC API" in text and "earlier releases called it --port" in text


def test_the_images_environment_sets_the_bind_and_ports_whatever_the_arguments(monkeypatch):
    """`docker run IMAGE --model /models` replaces CMD: the ENV the image sets still holds."""
    monkeypatch.setenv("CELERIS_HOST", "[::]")
    monkeypatch.setenv("CELERIS_HTTP_PORT", "8080")
    monkeypatch.setenv("CELERIS_METRICS_PORT", "9090")
    a = _parse("--model", "/models")
    assert (a.host, a.http_port, a.metrics_port) == ("[::]", 8080, 9090)
    assert _parse("--host", "127.0.0.1").host == "127.0.0.1"  # a flag still wins


def _celeris(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full = os.environ | {"OMP_NUM_THREADS": "1"} | (env or {})
    full.pop("CELERIS_API_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "celeris.server.cli", *argv], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.parametrize("command", [("run", "--prompt", "x"), ("serve", "--no-http")])
def test_device_cuda_without_cuda_is_one_line_naming_the_build(command):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine runs CUDA")
    out = _celeris(*command, "--device", "cuda", "--threads", "1")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"celeris {command[0]}: error: --device cuda: ") and torch.__version__ in line
    if torch.version.cuda is None:
        assert "CPU-only build" in line and "--index-url https://download.pytorch.org/whl/cu" in line


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_serve_a_hub_id_offline_from_the_cache_positionally(tmp_path):
    """`celeris serve org/name`, HF_HUB_OFFLINE=1, the cache in $HF_HUB_CACHE: served under the id."""
    cache = hf_cache(tmp_path / "hub")
    http = free_port()
    proc = ServerProcess(Path("unused"), tmp_path / "serve.log", "--http-port", str(http),
                         env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")})
    i = proc.argv.index("--model")
    proc.argv[i:i + 2] = []
    proc.argv.insert(proc.argv.index("serve") + 1, REPO_ID)
    try:
        proc.start(ready_timeout=120)
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=10) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == [REPO_ID]
        body = json.dumps({"model": REPO_ID, "prompt": "12+34=", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["choices"][0]["text"].strip()
    finally:
        proc.close()


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_run_a_hub_id_with_revision_and_download_dir_offline(tmp_path):
    cache = hf_cache(tmp_path / "models")
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    base = ("run", "--model", REPO_ID, "--download-dir", str(cache), "--threads", "1", "--json",
            "--prompt", "12+34=", "--gen-length", "8", "--steps", "8", "--block-length", "8")
    by_commit = _celeris(*base, "--revision", COMMIT, env=env)
    assert by_commit.returncode == 0, by_commit.stderr[-2000:]
    local = _celeris(*base[:2], str(EMBEDDED_MODEL), *base[5:], env=env)
    assert json.loads(by_commit.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    missing = _celeris(*base, "--revision", "v9", env=env)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert REPO_ID in missing.stderr and "HF_HUB_OFFLINE=1" in missing.stderr


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.parametrize("flags", [(), ("--port", "8000")], ids=["bare", "port-8000"])
def test_a_bare_celeris_serve_answers_the_openai_sdk_on_8000(tmp_path, flags):
    """The README's first command: `celeris serve` with no flags (the thread count aside: a test
    machine is shared), then the openai SDK at http://127.0.0.1:8000/v1; and vLLM's way to say
    so, `--port 8000`, which once collided with the server's own gRPC door."""
    openai = pytest.importorskip("openai")
    if not (_free(8000) and _free(50051)):
        pytest.skip("ports 8000 or 50051 are taken on this machine")
    proc = ServerProcess(Path("unused"), tmp_path / "serve.log")
    proc.port, proc.argv = 50051, [sys.executable, "-m", "celeris.server.cli", "serve", "--threads", "1",
                                   "--log-format", "json", *flags]
    try:
        proc.start(ready_timeout=120)
        (rec,) = [r for r in proc.records() if r.get("event") == "celeris.serving"]
        assert (rec["grpc_target"], rec["http_base_url"]) == ("127.0.0.1:50051", "http://127.0.0.1:8000/v1")
        client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == ["celeris-tiny"]
        out = client.chat.completions.create(model="celeris-tiny", max_tokens=8,
                                             messages=[{"role": "user", "content": "What is 37+45?"}])
        assert out.choices[0].message.content is not None and out.usage.completion_tokens > 0
    finally:
        proc.close()
