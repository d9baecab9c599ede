"""Served model names: /v1/models lists the served name and its aliases, any other `model` is
404 model_not_found (as vLLM and OpenAI answer), gRPC GetModelInfo reports the served name."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from celeris.v1 import generation_pb2 as pb
from tests.integration.live_server import LiveServer, live_server

PROMPT = "It is a truth universally"


def oai(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw(live: LiveServer, path: str, body=None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(live.http_url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def aliased(tiny_llm):
    with live_server(tiny_llm, served_model_names=("celeris-tiny", "tiny")) as s:
        yield s


def test_models_lists_the_served_name_then_aliases(aliased, tiny_llm):
    ids = [m.id for m in oai(aliased).models.list().data]
    assert ids == ["celeris-tiny", "tiny"]
    status, card = raw(aliased, "/v1/models/tiny")
    assert status == 200 and card["id"] == "tiny" and card["root"] == tiny_llm.name and card["max_model_len"] > 0
    status, body = raw(aliased, "/v1/models/" + tiny_llm.name)  # the checkpoint's own name is not served now
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert raw(aliased, "/health")[1]["model"] == "celeris-tiny"


def test_each_served_name_is_accepted_and_echoed(aliased):
    for name in ("celeris-tiny", "tiny"):
        r = oai(aliased).completions.create(model=name, prompt=PROMPT, max_tokens=8, seed=1)
        assert r.model == name and r.choices[0].finish_reason in ("length", "stop")
    chat = oai(aliased).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, seed=1)
    assert chat.model == "tiny"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": 8}),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": 10_000}),  # the model is checked first
])
def test_an_unknown_model_is_404_model_not_found(aliased, path, body):
    status, err = raw(aliased, path, body)
    assert status == 404
    assert err["error"]["code"] == "model_not_found" and err["error"]["param"] == "model"
    assert err["error"]["type"] == "invalid_request_error" and "gpt-4" in err["error"]["message"]


def test_the_openai_sdk_sees_not_found(aliased):
    with pytest.raises(openai.NotFoundError) as e:
        oai(aliased).completions.create(model="gpt-4", prompt=PROMPT, max_tokens=8)
    assert e.value.body["code"] == "model_not_found"


def test_a_missing_model_field_is_accepted_and_a_bad_type_is_400(aliased):
    status, body = raw(aliased, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "seed": 2})
    assert status == 200 and body["model"] == "celeris-tiny"
    status, body = raw(aliased, "/v1/completions", {"model": 7, "prompt": PROMPT})
    assert status == 400 and body["error"]["param"] == "model"


async def test_grpc_model_info_reports_the_served_name(tiny_llm, serve):
    async with serve(served_model_names=("celeris-tiny", "tiny")) as (_, stub, _port):
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.name == "celeris-tiny"
        assert (info.family, info.token_editing) == ("full", False)  # a whole canvas (the LLaDA family)
    async with serve() as (_, stub, _port):
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest())).name == tiny_llm.name


def test_default_is_the_models_own_name(tiny_llm):
    with live_server(tiny_llm) as live:
        assert [m.id for m in oai(live).models.list().data] == [tiny_llm.name]
        assert oai(live).completions.create(model=tiny_llm.name, prompt=PROMPT, max_tokens=8).model == tiny_llm.name


def test_serve_flag_takes_a_name_and_aliases():
    from celeris.server.cli import build_parser

    a = build_parser().parse_args(["serve", "--served-model-name", "celeris-tiny", "tiny"])
    assert a.served_model_names == ["celeris-tiny", "tiny"]
    assert build_parser().parse_args(["serve"]).served_model_names is None


