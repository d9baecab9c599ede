"""A vLLM user's first hour, round two (issue 64): `--port` as vLLM means it and a port asked for
twice named as the server's own, /metrics on the API port with vLLM's names, vLLM's engine
flags honoured or refused in one line, unserved routes answered in JSON that says so, and
malformed protobuf on the wire as INVALID_ARGUMENT with the field's path."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from celeris.engine.errors import EngineError
from celeris.server.app import create_server
from celeris.server.settings import ServerSettings
from celeris.server.errors import PortInUse
from celeris.v1 import generation_pb2 as pb
from tests.integration.live_server import live_server
from tests.integration.server_process import field_violations, free_port

PROSE = "It is a truth universally acknowledged"


def _parse(*argv: str):
    from celeris.server.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def _http(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if r.headers["Content-Type"].startswith("application/json") else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------- one port asked for twice


@pytest.mark.parametrize("asked", [dict(http_port="same"), dict(metrics_port="same"),
                                   dict(http_port=0, metrics_port="same", metrics_host="0.0.0.0")])
async def test_a_port_asked_for_twice_is_named_as_this_servers_own(tiny_llm, asked):
    port = free_port()
    settings = dict(host="127.0.0.1", port=port, warmup=False, drain_seconds=0) | {
        k: port if v == "same" else v for k, v in asked.items()}
    with pytest.raises(PortInUse) as e:
        await create_server(tiny_llm, ServerSettings(**settings))
    text = str(e.value)
    assert f"port {port}" in text and "this server's gRPC port too" in text and "--grpc-port" in text, text
    assert tiny_llm.loop.idle


def test_an_old_grpc_port_habit_fails_before_the_model_loads_in_one_line(capsys, monkeypatch):
    """`celeris serve --port 50051` from the days --port was gRPC's: HTTP now asks for the gRPC
    door's port, and the one line says so, before any model is loaded."""
    from celeris.engine import llm
    from celeris.server.cli import main

    for name in ("CELERIS_HOST", "CELERIS_GRPC_PORT", "CELERIS_HTTP_PORT", "CELERIS_METRICS_PORT", "CELERIS_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(llm.LLM, "load", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["serve", "--port", "50051"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("celeris serve: error: HTTP port 50051 on 127.0.0.1 is this server's gRPC port too: give each "
                    "door its own (--grpc-port 50051 and --port 50051 were asked; --port is the HTTP port, as in vLLM)")


async def test_distinct_ports_on_distinct_hosts_are_not_a_conflict(tiny_llm):
    port = free_port()
    server, _ = await create_server(tiny_llm, ServerSettings(host="127.0.0.1", port=port, metrics_port=port,
                                                             metrics_host="127.0.0.2", warmup=False, drain_seconds=0))
    try:
        assert server.metrics_port == port
    finally:
        await server.stop(drain_seconds=0, grace_seconds=1)


# ---------------------------------------------------------------- /metrics where vLLM users look


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_on_the_api_port_by_default_with_vllm_names(tiny_llm):
    assert _parse().metrics_on_http_port is True and _parse("--no-metrics-on-http-port").metrics_on_http_port is False
    with live_server(tiny_llm, served_model_names=("tiny",)) as s:
        status, body = _http(s.http_url + "/v1/completions", "POST", {"prompt": PROSE, "max_tokens": 8})
        assert status == 200, body
        status, text = _http(s.http_url + "/metrics")
    assert status == 200
    fam = _families(text)
    usage = body["usage"]

    def value(name: str, sample: str) -> float:
        return sum(x.value for x in fam[name].samples if x.name == sample)

    for vllm, celeris in (("vllm:prompt_tokens", "celeris_prompt_tokens"),
                          ("vllm:generation_tokens", "celeris_generated_tokens")):
        assert value(vllm, vllm + "_total") == value(celeris, celeris + "_total") > 0
        assert {x.labels["model_name"] for x in fam[vllm].samples} == {"tiny"}
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") == usage["completion_tokens"]
    for vllm, celeris in (("vllm:e2e_request_latency_seconds", "celeris_request_latency_seconds"),
                          ("vllm:time_to_first_token_seconds", "celeris_time_to_first_snapshot_seconds")):
        assert fam[vllm].type == "histogram"
        assert value(vllm, vllm + "_count") == value(celeris, celeris + "_count") == 1
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert fam[gauge].type == "gauge" and value(gauge, gauge) == 0


def test_metrics_off_the_api_port_says_where_they_are(tiny_llm):
    with live_server(tiny_llm, metrics_on_http=False) as s:
        status, body = _http(s.http_url + "/metrics")
    assert status == 404 and "--metrics-port" in body["error"]["message"], body


# ---------------------------------------------------------------- routes not served


def test_a_route_not_served_is_a_json_404_saying_so_on_get_and_post(tiny_llm):
    with live_server(tiny_llm) as s:
        answers = {(m, p): _http(s.http_url + p, m) for m in ("GET", "POST")
                   for p in ("/v1/audio/speech", "/v1/embeddings", "/no/such/route")}
        wrong_method = _http(s.http_url + "/v1/completions")
    for (method, path), (status, body) in answers.items():
        err = body["error"]
        assert status == 404 and err["code"] == "not_found" and err["type"] == "invalid_request_error", body
        assert err["message"].startswith(f"{method} {path}: not a route Celeris serves"), err
    assert "generative" in answers["POST", "/v1/embeddings"][1]["error"]["message"]
    assert "/openapi.json" in answers["GET", "/no/such/route"][1]["error"]["message"]
    status, body = wrong_method
    assert status == 405 and body["error"]["message"] == "GET /v1/completions: this route takes POST", body


# ---------------------------------------------------------------- vLLM's engine flags, one by one


def _config(*argv: str):
    from celeris.server.cli.args import engine_config_from_args

    return engine_config_from_args(_parse(*argv))


def _refusal(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        _parse(*argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_gpu_memory_utilization_caps_this_process_on_cuda_and_is_checked(monkeypatch):
    import torch

    from celeris.server.cli.vllm_flags import check_engine_flags

    capped = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, str(d))))
    check_engine_flags(_parse("--gpu-memory-utilization", "0.9"))  # on the CPU: moot
    check_engine_flags(_parse("--gpu-memory-utilization", "0.45", "--device", "cuda:1"))
    assert capped == [(0.45, "cuda:1")]
    for bad in ("0", "1.5"):
        with pytest.raises(EngineError, match="above 0 and at most 1"):
            check_engine_flags(_parse("--gpu-memory-utilization", bad))
    with pytest.raises(EngineError, match="tensor-parallel"):
        check_engine_flags(_parse("--gpu-memory-utilization", "0.5", "--device", "cuda", "--tensor-parallel-size", "2"))


def test_max_num_batched_tokens_is_the_forward_token_bound():
    assert _config("--max-num-batched-tokens", "512").max_forward_tokens == 512


def test_enforce_eager_turns_cuda_graphs_off():
    assert _config().cuda_graphs is True and _config("--enforce-eager").cuda_graphs is False


def test_kv_cache_dtype_auto_is_served_and_others_refused(capsys):
    assert _parse("--kv-cache-dtype", "auto").kv_cache_dtype == "auto"
    line = _refusal(capsys, "--kv-cache-dtype", "fp8")
    assert line.startswith("celeris serve: error: --kv-cache-dtype fp8: ") and "--dtype" in line


def test_trust_remote_code_is_accepted_and_runs_nothing():
    assert _parse("--trust-remote-code").trust_remote_code is True


def test_download_dir_is_the_hub_cache_folder(tmp_path):
    assert _parse("--download-dir", str(tmp_path)).download_dir == str(tmp_path)


def test_uvicorn_log_level_sets_the_log_level_unless_log_level_does():
    from celeris.server.cli.vllm_flags import log_level

    assert log_level(_parse()) == "info"
    assert log_level(_parse("--uvicorn-log-level", "warning")) == "warning"
    assert log_level(_parse("--uvicorn-log-level", "trace")) == "debug"
    assert log_level(_parse("--uvicorn-log-level", "critical", "--log-level", "info")) == "info"


def test_disable_log_requests_is_the_default_and_conflicts_with_log_prompts():
    from celeris.server.cli.vllm_flags import check_engine_flags

    check_engine_flags(_parse("--disable-log-requests"))
    assert _parse("--enable-log-requests").log_prompts is True
    with pytest.raises(EngineError, match="conflict"):
        check_engine_flags(_parse("--disable-log-requests", "--log-prompts"))


def test_enable_prefix_caching_sets_the_prefix_cache_budget():
    assert _config("--enable-prefix-caching").prefix_cache_bytes > 0
    assert _config("--no-enable-prefix-caching").prefix_cache_bytes == 0


@pytest.mark.parametrize("flag", ["--pipeline-parallel-size", "--swap-space", "--block-size", "--cpu-offload-gb",
                                  "--tokenizer"])
def test_a_vllm_flag_without_meaning_here_is_refused_in_one_line(capsys, flag):
    from celeris.server.cli.vllm_flags import REFUSED

    assert _refusal(capsys, flag, "2") == f"celeris serve: error: {flag}: {REFUSED[flag]}"


# ---------------------------------------------------------------- malformed protobuf on the wire


def _raw(channel: grpc.aio.Channel, method: str, streaming: bool):
    ident = lambda b: b  # noqa: E731: the bytes go on the wire as they are
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(method, request_serializer=ident, response_deserializer=ident)


def _string_field(number: int, raw: bytes) -> bytes:
    return bytes([number << 3 | 2, len(raw)]) + raw


BAD_UTF8 = b"\xff\xfe ok"
MALFORMED = [
    ("Generate", _string_field(2, BAD_UTF8), "prompt", "UTF-8"),
    ("Generate", _string_field(4, _string_field(1, _string_field(1, b"user") + _string_field(2, b"hi")) +
                               _string_field(1, _string_field(1, b"user") + _string_field(2, BAD_UTF8))),
     "chat.messages[1].content", "UTF-8"),
    ("Generate", _string_field(2, b"hello")[:-2], "prompt", "fewer follow"),
    ("Generate", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "prompt", ""),
    ("Tokenize", _string_field(1, BAD_UTF8), "text", "UTF-8"),
]


@pytest.mark.parametrize("method,data,field,why", MALFORMED, ids=lambda v: v if isinstance(v, str) else None)
async def test_malformed_protobuf_is_invalid_argument_naming_the_field(tiny_llm, method, data, field, why):
    from structlog.testing import capture_logs

    server, port = await create_server(tiny_llm, ServerSettings(host="127.0.0.1", port=0, warmup=False,
                                                                drain_seconds=0))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = _raw(ch, f"/celeris.v1.GenerationService/{method}", method == "Generate")
            with capture_logs() as logs, pytest.raises(grpc.RpcError) as e:
                if method == "Generate":
                    async for _ in call(data):
                        pass
                else:
                    await call(data)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            (violation,) = field_violations(e.value)
            assert violation[0] == field and why in violation[1], violation
            warned = [r for r in logs if r["event"] == "rpc.malformed_request"]
            assert [r["log_level"] for r in warned] == ["warning"] and warned[0]["field"] == field
            assert not [r for r in logs if r["log_level"] == "error"], logs
            # the server is none the worse: a good request on the same channel still answers
            good = await _raw(ch, "/celeris.v1.GenerationService/Tokenize", False)(
                pb.TokenizeRequest(text="hi").SerializeToString())
            assert pb.TokenizeResponse.FromString(good).ids
    finally:
        await server.stop(drain_seconds=0, grace_seconds=1)
