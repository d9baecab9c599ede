"""The OpenAI-compatible HTTP gateway, driven by the official `openai` package and raw HTTP."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request
from urllib.parse import urlparse

import openai
import pytest

from celeris_client import CelerisClient
from tests.integration.live_server import LiveServer, live_server
from tests.integration.http_helpers import PROMPT, post, sse_events

CHAT = [{"role": "user", "content": "Say something."}]
MODEL = "model"  # the tiny test model's name (its config.json has none); a request naming another is a 404


@pytest.fixture
def live(tiny_llm):
    with live_server(tiny_llm) as s:
        yield s


def oai(live: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_completions_match_grpc_and_share_its_scheduler(live):
    assert live.server.http.engine is live.server.engine  # one batch for both front doors
    r = oai(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, seed=1)
    with CelerisClient(live.grpc_target) as c:  # max_tokens=16 fits as one 16-token block, 16 steps
        ref = c.generate(PROMPT, gen_length=16, block_length=16, steps=16, seed=1)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == ref.usage.generated_tokens
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completions(live, tiny_llm):
    r = oai(live).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, seed=2,
                                          extra_body={"steps": 8, "block_length": 8})
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant" and isinstance(msg.content, str)
    assert r.model == tiny_llm.name and r.choices[0].finish_reason in ("stop", "length")
    with CelerisClient(live.grpc_target) as c:
        ref = c.generate(CHAT, gen_length=16, steps=8, block_length=8, seed=2)
    assert msg.content == ref.text and r.usage.prompt_tokens == ref.usage.prompt_tokens


def test_streaming_appends_text_and_ends_with_usage(live):
    client = oai(live)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, seed=3, extra_body={"block_length": 8})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, seed=3, stream=True,
                                            extra_body={"block_length": 8}))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, seed=3, stream=True))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].usage is not None
    ref = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, seed=3)
    assert "".join(c.choices[0].delta.content or "" for c in chat) == ref.choices[0].message.content


def test_diffusing_stream_sends_full_snapshots(live, tiny_llm):
    body = {"prompt": PROMPT, "max_tokens": 16, "steps": 8, "seed": 4, "stream": True, "diffusing": "full"}
    events = sse_events(post(live, "/v1/completions", body))
    assert events[-1] == "[DONE]"
    snaps = events[:-1]
    ext = [e["celeris"] for e in snaps]
    assert len(snaps) >= 2 and all(x["replace"] for x in ext)
    assert [x["step"] for x in ext] == list(range(1, len(ext) + 1)) and ext[0]["total_steps"] == 8
    masked = [x["masked"] for x in ext]
    assert masked[0] > 0 and masked == sorted(masked, reverse=True) and masked[-1] == 0
    assert all(len(x["tokens"]) == 16 for x in ext) and ext[-1]["done"] and not ext[0]["done"]
    assert "\u2592" in snaps[0]["choices"][0]["text"]  # masked positions shown in the snapshot text
    assert sum(c["new"] for c in ext[0]["tokens"]) == ext[0]["committed"] > 0
    final = oai(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, seed=4, extra_body={"steps": 8})
    assert snaps[-1]["choices"][0]["text"] == final.choices[0].text
    assert snaps[-1]["usage"]["completion_tokens"] == final.usage.completion_tokens


def test_models_and_health(live, tiny_llm):
    client = oai(live)
    assert [m.id for m in client.models.list()] == [tiny_llm.name]
    assert client.models.retrieve(tiny_llm.name).owned_by == "celeris"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = json.loads(urllib.request.urlopen(live.http_url + "/health").read())
    assert health["status"] == "serving" and health["model"] == tiny_llm.name


def test_400_names_the_parameter(live):
    client = oai(live)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1000)
    assert e.value.body["param"] == "max_tokens" and e.value.body["type"] == "invalid_request_error"
    assert [v["field"] for v in e.value.body["field_violations"]] == ["max_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"remasking": "best"})
    assert e.value.body["param"] == "remasking"
    resp = post(live, "/v1/completions", b"{not json")
    assert resp.status == 400 and json.loads(resp.read())["error"]["param"] == "body"


@pytest.mark.parametrize("kwargs, param", [
    ({"extra_body": {"repetition_penalty": 1.3}}, "repetition_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"extra_body": {"mirostat": 2}}, "mirostat"),  # an unknown key is named, never ignored
])
def test_unsupported_openai_fields_are_400_naming_the_field(live, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai(live).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, **kwargs)
    assert e.value.body["param"] == param and "not" in e.value.body["message"]


def test_neutral_openai_fields_are_served(live):
    r = oai(live).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, frequency_penalty=0,
                                          presence_penalty=0, logit_bias={}, response_format={"type": "text"},
                                          user="u-1", n=1)
    assert r.choices[0].message.content is not None


def test_401_without_the_token_health_and_page_exempt(tiny_llm):
    with live_server(tiny_llm, api_token="s3cret") as s:
        with pytest.raises(openai.AuthenticationError) as e:
            oai(s, "wrong").models.list()
        assert e.value.body["code"] == "invalid_api_key"
        assert oai(s, "s3cret").completions.create(model=MODEL, prompt=PROMPT, max_tokens=8).choices
        assert urllib.request.urlopen(s.http_url + "/health").status == 200
        assert urllib.request.urlopen(s.http_url + "/").status == 200


def test_429_when_rate_limited(tiny_llm):
    with live_server(tiny_llm, rate_limit=0.5, rate_burst=1) as s:
        client = oai(s)
        client.models.list()
        with pytest.raises(openai.RateLimitError) as e:
            client.models.list()
        assert int(e.value.response.headers["Retry-After"]) >= 1
        assert e.value.body["code"] == "rate_limit_exceeded"


def test_503_while_draining(live):
    live.server.http.draining = True
    with pytest.raises(openai.InternalServerError) as e:
        oai(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "1"
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(live.http_url + "/health")
    assert h.value.code == 503


def wait_idle(live: LiveServer, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while live.active() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.active() == 0, "the request kept its scheduler slot after the client left"


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(live, tiny_llm, monkeypatch, stream):
    real_step = tiny_llm.loop.step_later

    def slow_step(during=None):  # runs in the step thread: 64 steps take > 0.6 s, far longer than noticing a hang-up
        time.sleep(0.01)
        return real_step(during)

    monkeypatch.setattr(tiny_llm.loop, "step_later", slow_step)
    steps_before = live.scheduler.steps
    body = {"prompt": PROMPT, "max_tokens": 64, "steps": 64, "block_length": 64, "stream": stream,
            "diffusing": stream}
    resp = post(live, "/v1/completions", body) if stream else None
    if stream:
        assert resp.readline().startswith(b"data: ")  # the first snapshot arrived: it is running
        resp.close()
    else:
        u = urlparse(live.http_url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        deadline = time.monotonic() + 10
        while not live.active() and time.monotonic() < deadline:
            time.sleep(0.005)
        conn.close()  # gone before the answer
    wait_idle(live)
    assert live.scheduler.steps - steps_before < 64  # stopped early, not run to the end


def test_default_bind_address_accepts_ipv4(tiny_llm):
    with live_server(tiny_llm, host="[::]") as s:  # the serve default: dual-stack, one port
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{s.server.http.port}/health").read())
    assert health["status"] == "serving"
