"""vLLM's serve flags and side endpoints (issue 45): --max-num-seqs, --dtype auto, --chat-template,
--generation-config, --allowed-origins '["*"]', TLS on both doors (--ssl-keyfile/--ssl-certfile,
a self-signed certificate made here), /ping and /openapi.json generated from the knob table."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import ssl
import urllib.request
from pathlib import Path

import grpc
import pytest

from celeris.engine.errors import EngineError
from celeris.server.cli.vllm_flags import apply_to_model, checkpoint_dtype, origins, tls_files
from tests.integration.live_server import live_server


def _parse(*argv: str):
    from celeris.server.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_vllm_names_parse_to_celeris_settings(tmp_path):
    assert _parse("--max-num-seqs", "4").max_batch == 4 and _parse().max_batch == 16
    assert origins(['["*"]']) == ("*",)
    assert origins(['["https://a.example", "https://b.example"]', "https://c.example"]) == (
        "https://a.example", "https://b.example", "https://c.example")
    with pytest.raises(EngineError, match="JSON list"):
        origins(["[not json"])
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16" and checkpoint_dtype(tmp_path / "none") == "float32"
    with pytest.raises(EngineError, match="go together"):
        tls_files(argparse.Namespace(ssl_keyfile="k.pem", ssl_certfile=None))


def test_chat_template_and_generation_config_apply_to_the_model(tmp_path):
    from celeris.engine.llm import LLM

    llm = LLM.load()
    a = _parse("--chat-template", "[{{ messages[0]['content'] }}]", "--generation-config", "vllm")
    apply_to_model(llm, a)
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("[hi]")
    assert llm.defaults == llm.family.base_params().validate()
    (tmp_path / "generation_config.json").write_text(json.dumps({"steps": 14, "gen_length": 14, "block_length": 7}))
    apply_to_model(llm, _parse("--generation-config", str(tmp_path)))
    assert (llm.defaults.steps, llm.defaults.gen_length) == (14, 14)


def _self_signed(tmp_path: Path) -> tuple[str, str, bytes]:
    """(key file, certificate file, certificate PEM) for localhost and 127.0.0.1."""
    crypto = pytest.importorskip("cryptography")
    del crypto
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_bytes(pem)
    return str(tmp_path / "key.pem"), str(tmp_path / "cert.pem"), pem


def test_tls_on_both_doors(tiny_llm, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from celeris.v1 import generation_pb2 as pb
    from celeris.v1 import generation_pb2_grpc as pb_grpc

    keyfile, certfile, pem = _self_signed(tmp_path)
    ctx = ssl.create_default_context(cadata=pem.decode())
    with live_server(tiny_llm, ssl_keyfile=keyfile, ssl_certfile=certfile) as s:
        https = f"https://127.0.0.1:{s.server.http.port}"
        with urllib.request.urlopen(https + "/v1/models", context=ctx, timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["data"]
        with pytest.raises(Exception):  # plain HTTP on the TLS port gets no answer
            urllib.request.urlopen(f"http://127.0.0.1:{s.server.http.port}/health", timeout=5).read()
        creds = grpc.ssl_channel_credentials(root_certificates=pem)
        with grpc.secure_channel(s.grpc_target, creds) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            info = pb_grpc.GenerationServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.name
        with grpc.insecure_channel(s.grpc_target) as ch:  # plaintext gRPC is refused
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)


def _get(url: str, method: str = "GET") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"} if method == "POST" else {}  # every POST says JSON
    req = urllib.request.Request(url, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.loads(r.read())


def test_ping_and_openapi_from_the_knob_table(tiny_llm):
    jsonschema = pytest.importorskip("jsonschema")
    from celeris.engine.sampling.knobs import on

    with live_server(tiny_llm, api_token="secret") as s:  # both public, like /health
        assert _get(s.http_url + "/ping")[0] == 200 and _get(s.http_url + "/ping", "POST")[0] == 200
        status, doc = _get(s.http_url + "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/ping", "/v1/models"} <= set(doc["paths"])
    schema = doc["components"]["schemas"]["CompletionRequest"]
    assert {k.http for k in on("http")} <= set(schema["properties"])
    jsonschema.validate({"prompt": "12+34=", "max_tokens": 8, "temperature": 0.5, "remasking": "random",
                         "threshold": None, "stop": ["\n"]}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"prompt": "x", "remasking": "sideways"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"prompt": "x", "temprature": 1}, schema)


def test_allowed_origins_json_list_lets_a_preflight_through(tiny_llm):
    with live_server(tiny_llm, allowed_origins=origins(['["*"]'])) as s:
        req = urllib.request.Request(s.http_url + "/v1/completions", method="OPTIONS", headers={
            "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
