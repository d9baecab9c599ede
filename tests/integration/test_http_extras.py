"""HTTP routes beyond generation (/tokenize, /detokenize, /version), CORS, and seeds as strings."""

from __future__ import annotations

import http.client
import json
from typing import Optional
from urllib.parse import urlparse

import pytest

from tests.integration.live_server import LiveServer, live_server

PROMPT = "It is a truth universally"
ORIGIN = "https://app.example.com"


@pytest.fixture
def live(tiny_llm):
    with live_server(tiny_llm) as s:
        yield s


def request(live: LiveServer, method: str, path: str, body=None,
            headers: Optional[dict] = None) -> tuple[int, dict, object]:
    """(status, headers, parsed JSON body or raw text)."""
    u = urlparse(live.http_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = ({"Content-Type": "application/json"} if data is not None else {}) | (headers or {})
    conn.request(method, path, data, hdrs)
    resp = conn.getresponse()
    raw = resp.read().decode()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed


# ---------------------------------------------------------------- /tokenize, /detokenize, /version

def test_tokenize_a_prompt_matches_the_engine(live, tiny_llm):
    status, _, body = request(live, "POST", "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert status == 200
    ids = tiny_llm.encode_prompt(PROMPT)
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == tiny_llm.config.max_prompt_tokens + tiny_llm.config.max_gen_length
    assert body["token_strs"] == tiny_llm.tokenizer.tokens(ids)
    assert request(live, "POST", "/tokenize", {"prompt": PROMPT})[2]["token_strs"] is None


def test_tokenize_chat_messages_uses_the_chat_template(live, tiny_llm):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    status, _, body = request(live, "POST", "/tokenize", {"model": tiny_llm.name, "messages": messages})
    assert status == 200
    assert body["tokens"] == tiny_llm.encode_prompt(messages=[{"role": "user", "content": "Hi"}])


def test_detokenize_round_trips(live, tiny_llm):
    ids = request(live, "POST", "/tokenize", {"prompt": PROMPT})[2]["tokens"]
    status, _, body = request(live, "POST", "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": tiny_llm.tokenizer.decode(ids)}
    assert PROMPT.split()[-1] in body["prompt"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x" * 10_000}, "prompt"),  # over the generation limit, refused untokenized
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * 10_000}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate"),
    ("/detokenize", {"tokens": [1] * 10_000}, "tokens"),  # more than a request can hold
    ("/detokenize", {"tokens": [-1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_limits_and_bad_input_are_400(live, path, body, param):
    status, _, err = request(live, "POST", path, body)
    assert status == 400 and err["error"]["param"] == param, err


def test_tokenize_checks_the_model_and_the_token(tiny_llm):
    with live_server(tiny_llm, api_token="s3cret") as s:
        assert request(s, "POST", "/tokenize", {"prompt": PROMPT})[0] == 401
        auth = {"Authorization": "Bearer s3cret"}
        status, _, err = request(s, "POST", "/detokenize", {"model": "gpt-4", "tokens": [5]}, auth)
        assert status == 404 and err["error"]["code"] == "model_not_found"
        assert request(s, "POST", "/tokenize", {"prompt": PROMPT}, auth)[0] == 200
        status, _, body = request(s, "GET", "/version")  # public, like /health
        assert status == 200 and isinstance(body["version"], str) and body["version"]


# ---------------------------------------------------------------- CORS

def test_cors_is_off_by_default(live):
    status, headers, _ = request(live, "OPTIONS", "/v1/completions",
                                 headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert status in (403, 405) and "access-control-allow-origin" not in headers
    _, headers, _ = request(live, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in headers


def test_cors_answers_listed_origins_only(tiny_llm):
    with live_server(tiny_llm, allowed_origins=(ORIGIN,), api_token="s3cret") as s:
        pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = request(s, "OPTIONS", "/v1/completions", headers=pre)  # no token on a preflight
        assert status == 204 and headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"].lower()

        evil = pre | {"Origin": "https://evil.example"}
        status, headers, _ = request(s, "OPTIONS", "/v1/completions", headers=evil)
        assert status == 403 and "access-control-allow-origin" not in headers

        auth = {"Authorization": "Bearer s3cret", "Origin": ORIGIN}
        status, headers, body = request(s, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8}, auth)
        assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in headers["access-control-expose-headers"].lower()
        status, headers, _ = request(s, "POST", "/v1/completions", {"prompt": PROMPT}, {"Origin": ORIGIN})
        assert status == 401 and headers["access-control-allow-origin"] == ORIGIN  # the page can read errors
        status, headers, events = request(s, "POST", "/v1/completions",
                                          {"prompt": PROMPT, "max_tokens": 8, "stream": True}, auth)
        assert status == 200 and headers["access-control-allow-origin"] == ORIGIN and "[DONE]" in events
        _, headers, _ = request(s, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret",
                                                                 "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in headers


def test_cors_wildcard(tiny_llm):
    with live_server(tiny_llm, allowed_origins=("*",)) as s:
        status, headers, _ = request(s, "OPTIONS", "/tokenize",
                                     headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        assert status == 204 and headers["access-control-allow-origin"] == "*"


def test_serve_flag_allowed_origins():
    from celeris.server.cli import build_parser

    a = build_parser().parse_args(["serve", "--allowed-origins", ORIGIN, "http://localhost:3000"])
    assert a.allowed_origins == [ORIGIN, "http://localhost:3000"]
    assert build_parser().parse_args(["serve"]).allowed_origins is None


# ---------------------------------------------------------------- seeds past 2^53

BIG_SEED = 2**63 - 3  # a JavaScript number would round this


def test_seeds_go_out_as_strings_and_come_in_as_either(live, tiny_llm):
    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    status, _, as_text = request(live, "POST", "/v1/completions", base | {"seed": str(BIG_SEED)})
    assert status == 200 and as_text["celeris"]["seed"] == str(BIG_SEED)
    as_number = request(live, "POST", "/v1/completions", base | {"seed": BIG_SEED})[2]
    assert as_number["celeris"]["seed"] == str(BIG_SEED)
    assert as_text["choices"][0]["text"] == as_number["choices"][0]["text"]
    random_seed = request(live, "POST", "/v1/completions", base)[2]["celeris"]["seed"]
    assert isinstance(random_seed, str) and random_seed.isdigit()


def test_the_diffusing_stream_reports_the_seed_as_a_string(live):
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True, "diffusing": True, "seed": str(BIG_SEED)}
    _, _, events = request(live, "POST", "/v1/completions", body)
    last = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")][-1]
    assert last["celeris"]["done"] and last["celeris"]["seed"] == str(BIG_SEED)


@pytest.mark.parametrize("seed", ["12x", "", " 5", "1e5", "99999999999999999999999", 1.5, True])
def test_a_bad_seed_is_400(live, seed):
    status, _, err = request(live, "POST", "/v1/completions", {"prompt": PROMPT, "seed": seed})
    assert status == 400 and err["error"]["param"] == "seed"
