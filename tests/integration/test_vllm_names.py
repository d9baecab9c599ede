"""The names vLLM users bring: `--api-key`, `/metrics` on the API port (on by default),
`/tokenize` with `add_special_tokens: false`, and `stream_options.include_usage`'s last chunk with
empty `choices` (through the official openai SDK)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.integration.live_server import live_server
from tests.integration.server_process import free_port

PROSE = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def tiny_live():
    """The embedded celeris-tiny: its tokenizer adds a BOS, so add_special_tokens has work to do."""
    from celeris.engine.llm import LLM

    llm = LLM.load()
    with live_server(llm) as s:
        yield llm, s


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"} | (headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_add_special_tokens_false_leaves_out_the_bos(tiny_live):
    llm, s = tiny_live
    tok = llm.tokenizer
    assert tok.add_bos and tok.bos_id is not None
    _, with_bos = post(s.http_url + "/tokenize", {"prompt": PROSE})
    _, default_true = post(s.http_url + "/tokenize", {"prompt": PROSE, "add_special_tokens": True})
    _, without = post(s.http_url + "/tokenize", {"prompt": PROSE, "add_special_tokens": False})
    assert with_bos["tokens"] == default_true["tokens"] == llm.encode_prompt(PROSE)
    assert with_bos["tokens"][0] == tok.bos_id
    assert without["tokens"] == with_bos["tokens"][1:] and without["count"] == with_bos["count"] - 1
    assert tok.bos_id not in without["tokens"]
    # token ids are taken as given either way
    _, ids = post(s.http_url + "/tokenize", {"prompt": without["tokens"], "add_special_tokens": False})
    assert ids["tokens"] == without["tokens"]


@pytest.mark.parametrize("chat", [False, True])
def test_include_usage_ends_with_an_empty_choices_chunk(tiny_live, chat):
    openai = pytest.importorskip("openai")
    llm, s = tiny_live
    c = openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused")
    kw = dict(model=llm.name, max_tokens=8, seed=0, n=2, stream=True, stream_options={"include_usage": True})
    if chat:
        chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw))
    else:
        chunks = list(c.completions.create(prompt=PROSE, **kw))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(ch.choices for ch in chunks[:-1])
    prompt_tokens = len(llm.encode_prompt(messages=[{"role": "user", "content": "Hi"}]) if chat
                        else llm.encode_prompt(PROSE))
    assert last.usage.prompt_tokens == prompt_tokens  # counted once for n = 2
    finals = [ch.usage for ch in chunks[:-1] if ch.usage is not None]
    assert len(finals) == 2 and last.usage.completion_tokens == sum(u.completion_tokens for u in finals)
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    # without the option there is no such chunk
    plain = list(c.completions.create(model=llm.name, prompt=PROSE, max_tokens=8, seed=0, stream=True))
    assert all(ch.choices for ch in plain)


def test_min_p_through_the_openai_sdk(tiny_live):
    """vLLM's `min_p` (an extra body field to the openai SDK): 1.0 keeps only the top token, so a hot
    sample decodes the greedy text; 0 leaves sampling alone; out of range is a 400 naming it."""
    openai = pytest.importorskip("openai")
    llm, s = tiny_live
    c = openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused")
    kw = dict(model=llm.name, prompt=PROSE, max_tokens=16, seed=3)
    greedy = c.completions.create(**kw, temperature=0).choices[0].text
    pinned = c.completions.create(**kw, temperature=1.5, extra_body={"min_p": 1.0}).choices[0].text
    assert pinned == greedy
    hot = c.completions.create(**kw, temperature=1.5).choices[0].text
    assert c.completions.create(**kw, temperature=1.5, extra_body={"min_p": 0}).choices[0].text == hot
    status, err = post(s.http_url + "/v1/completions", {"prompt": PROSE, "min_p": 1.5})
    assert status == 400 and err["error"]["param"] == "min_p"


def test_include_usage_without_a_stream_is_accepted_and_moot(tiny_live):
    llm, s = tiny_live
    status, body = post(s.http_url + "/v1/completions", {"prompt": PROSE, "max_tokens": 4,
                                                          "stream_options": {"include_usage": True}})
    assert status == 200 and len(body["choices"]) == 1 and body["usage"]["completion_tokens"] >= 0
    status, err = post(s.http_url + "/v1/completions", {"prompt": PROSE, "stream": True,
                                                        "stream_options": {"include_usage": "yes"}})
    assert status == 400 and err["error"]["param"] == "stream_options"


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_api_key_flag_and_metrics_on_the_api_port(spawn):
    """A real `celeris serve --port N --api-key ...`: the key guards generation, /metrics on the
    HTTP port (there by default, as in vLLM) answers without it and counts the request."""
    http_port = free_port()
    spawn("--port", str(http_port), "--api-key", "s3cret")
    base = f"http://127.0.0.1:{http_port}"
    assert post(base + "/v1/completions", {"prompt": PROSE, "max_tokens": 4})[0] == 401
    status, body = post(base + "/v1/completions", {"prompt": PROSE, "max_tokens": 4},
                        {"Authorization": "Bearer s3cret"})
    assert status == 200 and body["choices"]
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/plain")
    from prometheus_client.parser import text_string_to_metric_families

    requests = {f.name: f for f in text_string_to_metric_families(text)}["celeris_requests"]
    done = sum(x.value for x in requests.samples if x.name == "celeris_requests_total")
    assert done >= 1  # the completion above, counted by the server these metrics describe


def test_api_token_stays_an_alias_and_metrics_on_http_is_on_by_default():
    from celeris.server.cli import build_parser

    p = build_parser()
    assert p.parse_args(["serve", "--api-key", "k"]).api_token == "k"
    assert p.parse_args(["serve", "--api-token", "k"]).api_token == "k"
    assert p.parse_args(["serve"]).metrics_on_http_port is True
    assert p.parse_args(["serve", "--no-metrics-on-http-port"]).metrics_on_http_port is False


def test_metrics_route_absent_when_turned_off(tiny_llm):
    with live_server(tiny_llm, metrics_on_http=False) as s:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(s.http_url + "/metrics", timeout=30)
    assert e.value.code == 404
