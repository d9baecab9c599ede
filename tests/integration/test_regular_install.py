"""The install users deploy: the container images' steps, run in a fresh virtual environment.

Both Dockerfiles make a venv, install torch, copy pyproject.toml, setup.py, README.md, engine/,
server/ and clients/, run `pip install .` (pip builds the server's wheel and, through setup.py's
direct reference to ./clients, the client's, and installs both as regular, not editable,
packages), delete the sources, and start `celeris serve --http-port 8080 ...` in /tmp. Every other
test runs the editable install of the checkout, where a path that only resolves inside a source
tree still works (#40: the web page was looked up as `clients/`, so the images could not start).

So this test does the same, read from the Dockerfiles themselves: the same files copied, the same
pip commands (torch from the configured index instead of download.pytorch.org: the CPU build
scripts/setup.sh installs), the sources deleted, then the image's ENTRYPOINT and CMD from a
temporary working directory with the ports made free ones, and checks /health, the page at /, a
completion and /metrics. A fresh venv, not --system-site-packages: the point is that the
distributions' own requirements are enough (about 85 s on the 2-core development machine, most of
it pip).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import venv
from pathlib import Path

import dockerfile
import pytest

from tests.integration.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = (ROOT / "deploy" / "Dockerfile", ROOT / "deploy" / "Dockerfile.cuda")
pytestmark = pytest.mark.slow


def image_steps(path: Path) -> dict:
    """What a Dockerfile copies, installs and runs, normalized so the two images compare."""
    cmds = dockerfile.parse_file(str(path))
    runs = [" ".join(" ".join(c.value).split()) for c in cmds if c.cmd == "RUN"]
    args = dict(" ".join(c.value).split("=", 1) for c in cmds if c.cmd == "ARG")
    return {"copies": [src for c in cmds if c.cmd == "COPY" for src in c.value[:-1]],
            "venv_and_torch": runs[0].replace(" --index-url \"${TORCH_INDEX_URL}\"", ""),
            "project": runs[1], "torch": args["TORCH_VERSION"],
            "argv": [*next(c.value for c in cmds if c.cmd == "ENTRYPOINT"),
                     *next(c.value for c in cmds if c.cmd == "CMD")]}


def with_free_ports(argv: list[str], ports: dict[str, int]) -> list[str]:
    """The image's command with each port flag's value replaced (and everything else kept)."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in ports:
            out[i + 1] = str(ports[arg])
    assert set(ports) <= set(out), f"the image's command lost a port flag: {argv}"
    return out


def sh(argv: list[str], cwd: Path, env: dict) -> str:
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> dict:
    """The image's install steps, run: {venv, env, argv}. The source copy is gone afterwards."""
    steps = image_steps(DOCKERFILES[0])
    cuda = image_steps(DOCKERFILES[1])
    assert {k: cuda[k] for k in ("copies", "venv_and_torch", "project", "torch")} == \
           {k: steps[k] for k in ("copies", "venv_and_torch", "project", "torch")}, "the images install alike"
    # What this test knows how to run; a Dockerfile that installs another way must change it too.
    assert steps["venv_and_torch"] == 'python -m venv /opt/celeris && pip install "torch==${TORCH_VERSION}"'
    assert steps["project"] == "pip install . && rm -rf /src"

    base = tmp_path_factory.mktemp("image")
    env_dir, src, home = base / "opt-celeris", base / "src", base / "tmp"
    src.mkdir()
    home.mkdir()
    junk = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info", "build")  # as .dockerignore
    for name in steps["copies"]:
        (shutil.copytree(ROOT / name, src / name, ignore=junk) if (ROOT / name).is_dir()
         else shutil.copy(ROOT / name, src / name))

    venv.EnvBuilder(with_pip=True).create(env_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "CELERIS_API_TOKEN")}
    env |= {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "VIRTUAL_ENV": str(env_dir), "PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}",
            "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    sh(["pip", "install", "--quiet", f"torch=={steps['torch']}"], cwd=home, env=env)
    sh(["pip", "install", "--quiet", "."], cwd=src, env=env)
    shutil.rmtree(src)  # as the image does: nothing may point back into the sources
    return {"venv": env_dir, "env": env, "home": home, "argv": steps["argv"]}


def test_the_image_steps_install_regular_packages_that_run_from_site_packages(image):
    """The installed copies are what imports, not the checkout (which is nowhere on the path)."""
    py = str(image["venv"] / "bin" / "python")
    code = ("import json, sysconfig, importlib.metadata as m, celeris.server.http.gateway as g, "
            "celeris.engine, celeris_client\n"
            "print(json.dumps({'site': sysconfig.get_path('purelib'), 'page': str(g.web_page_path()),\n"
            "  'files': [celeris.engine.__file__, g.__file__, celeris_client.__file__],\n"
            "  'direct': {d: m.distribution(d).read_text('direct_url.json') for d in ('celeris', 'celeris-client')}}))")
    got = json.loads(sh([py, "-c", code], cwd=image["home"], env=image["env"]))
    site = Path(got["site"]).resolve()
    assert site.is_relative_to(image["venv"].resolve())
    for f in [*got["files"], got["page"]]:
        assert Path(f).resolve().is_relative_to(site), f
    assert Path(got["page"]).is_file()
    for dist, direct in got["direct"].items():  # pip's record of how each was installed
        assert direct is not None and not json.loads(direct).get("dir_info", {}).get("editable"), (dist, direct)


def get(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_image_command_serves_health_the_page_and_a_completion(image):
    """ENTRYPOINT + CMD as the image runs them (embedded celeris-tiny, every interface), free
    ports instead of 50051/8080/9090 and one torch thread, from a directory outside any checkout."""
    http, metrics = free_port(), free_port()
    argv = with_free_ports(image["argv"], {"--grpc-port": free_port(), "--port": http, "--metrics-port": metrics})
    log = image["home"] / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*argv, "--threads", "1"], cwd=image["home"], env=image["env"] | {"OMP_NUM_THREADS": "1"},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 300  # a hang guard, not a speed bound
        while True:
            assert proc.poll() is None, f"celeris serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            try:
                status, body = get(f"{base}/health")
                if status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        assert json.loads(body)["status"] == "serving"

        status, page = get(f"{base}/")
        assert status == 200 and b"<html" in page.lower() and b"/v1/" in page

        status, body = get(f"{base}/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "seed": 1})
        assert status == 200, body
        done = json.loads(body)
        assert isinstance(done["choices"][0]["text"], str) and done["usage"]["completion_tokens"] >= 0

        status, text = get(f"http://127.0.0.1:{metrics}/metrics")
        assert status == 200 and b"celeris_requests_total" in text
    finally:
        proc.send_signal(signal.SIGINT)  # idle: stops without the drain
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
