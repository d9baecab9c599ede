"""Typed decisions over both doors on a real server on port 0 (celeris-tiny): a `choice` asked
with logprobs returns a probability per option summing to 1 (within 1e-6), on HTTP as
`choice_probabilities` on each choice (and on a stream's last chunk), on gRPC as the final
message's `choice_probabilities` (the Python client's Result), the same numbers alone, batched
(n samples in one forward, beside other requests) and on either door; without logprobs, none."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from celeris_client import CelerisClient
from celeris.engine.llm import LLM
from tests.integration.http_helpers import post, sse_events
from tests.integration.live_server import live_server

OPTIONS = ["yes", "no", "maybe", "yesno"]
CHOICE = {"structured_outputs": {"choice": OPTIONS}}


@pytest.fixture(scope="module")
def live():
    with live_server(LLM.load()) as s:
        yield s


def _post(live, path: str, body: dict) -> dict:
    r = post(live, path, {"model": "celeris-tiny", **body})
    data = r.read()
    assert r.status == 200, data
    return json.loads(data)


def _completion(live, **kw) -> dict:
    return _post(live, "/v1/completions", {"prompt": "Yes or no?", "max_tokens": 16, "seed": 3, **CHOICE, **kw})


def _check(probs: dict) -> dict:
    assert list(probs) == OPTIONS and abs(sum(probs.values()) - 1) < 1e-6 and all(0 <= p <= 1 for p in probs.values())
    return probs


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_http_completions_and_chat_return_choice_probabilities(live):
    alone = _check(_completion(live, logprobs=0)["choices"][0]["choice_probabilities"])
    assert "choice_probabilities" not in _completion(live)["choices"][0]  # not asked: not there
    # Batched: n samples share every forward, beside other requests decoding at the same time.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(_post, live, "/v1/completions", {"prompt": "Once " * k, "max_tokens": 32, "seed": k})
                  for k in range(1, 4)]
        batched = _completion(live, logprobs=0, n=3)
        [f.result() for f in others]
    assert [c["choice_probabilities"] for c in batched["choices"]] == [alone] * 3  # identical, not close
    chat = _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Yes or no?"}],
                                                "max_tokens": 16, "logprobs": True, **CHOICE})
    assert chat["choices"][0]["message"]["content"] in OPTIONS
    _check(chat["choices"][0]["choice_probabilities"])


def test_http_stream_carries_them_on_the_last_chunk(live):
    alone = _completion(live, logprobs=0)["choices"][0]["choice_probabilities"]
    chunks = [c for c in sse_events(post(live, "/v1/completions", {
        "model": "celeris-tiny", "prompt": "Yes or no?", "max_tokens": 16, "seed": 3, "logprobs": 0, "stream": True,
        **CHOICE})) if c != "[DONE]"]
    with_probs = [c for c in chunks if c["choices"] and "choice_probabilities" in c["choices"][0]]
    assert len(with_probs) == 1 and with_probs[0]["choices"][0]["finish_reason"] is not None
    assert with_probs[0]["choices"][0]["choice_probabilities"] == alone


def test_grpc_final_message_and_client_result(live):
    http = _completion(live, logprobs=0)["choices"][0]["choice_probabilities"]
    with CelerisClient(live.grpc_target) as c:
        r = c.generate("Yes or no?", gen_length=16, seed=3, logprobs=0, structured_output={"choice": OPTIONS})
        assert r.text in OPTIONS and _check(r.choice_probabilities) == http  # the same numbers on both doors
        many = c.sample("Yes or no?", 3, gen_length=16, seed=5, logprobs=0, structured_output={"choice": OPTIONS})
        assert [m.choice_probabilities for m in many] == [http] * 3
        last = [s for s in c.stream("Yes or no?", gen_length=16, seed=3, logprobs=0,
                                    structured_output={"choice": OPTIONS})]
        assert last[-1].done and last[-1].choice_probabilities == http
        assert all(s.choice_probabilities is None for s in last[:-1])
        assert c.generate("Yes or no?", gen_length=16, seed=3, structured_output={"choice": OPTIONS}
                          ).choice_probabilities is None
