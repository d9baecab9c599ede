"""The official `openai` SDK against a real server: stop strings, stop ids, logprobs."""

from __future__ import annotations

import openai
import pytest

from celeris.engine.llm import LLM
from tests.integration.live_server import live_server

PROSE = "It is a truth universally"
LONG_PROSE = "She was"  # answered with a full 32-token canvas (PROSE ends early)


@pytest.fixture(scope="module")
def live():
    with live_server(LLM.load()) as s:  # the embedded model: real text, real EOS
        yield s


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_stop_strings_cut_completions_streamed_or_not(live):
    c = client(live)
    full = c.completions.create(model="celeris-tiny", prompt=LONG_PROSE, max_tokens=32, seed=0).choices[0].text
    assert len(full) >= 24, full  # the test needs text past the stop
    stop = full[14:18]
    cut = c.completions.create(model="celeris-tiny", prompt=LONG_PROSE, max_tokens=32, seed=0, stop=[stop, "zzzz"])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="celeris-tiny", prompt=LONG_PROSE, max_tokens=32, seed=0, stop=stop, stream=True))
    assert streamed == cut.choices[0].text  # nothing past the stop was ever sent


def test_chat_stop_and_vllm_stop_token_ids(live):
    c = client(live)
    msgs = [{"role": "user", "content": "Continue: It is a truth universally acknowledged"}]
    long = {"ignore_eos": True}  # celeris-tiny answers briefly; the cut needs text on both sides
    full = c.chat.completions.create(model="celeris-tiny", messages=msgs, max_tokens=32, seed=1, extra_body=long)
    text = full.choices[0].message.content
    assert len(text) >= 6, "the model answered"
    cut = c.chat.completions.create(model="celeris-tiny", messages=msgs, max_tokens=32, seed=1, stop=text[3:6],
                                    extra_body=long)
    assert cut.choices[0].message.content == text[:text.find(text[3:6])]
    eos_off = c.completions.create(model="celeris-tiny", prompt="37+45=", max_tokens=8, seed=0,
                                   extra_body={"ignore_eos": True})
    assert eos_off.choices[0].finish_reason == "length" and eos_off.usage.completion_tokens == 8


def test_logprobs_completions_and_chat(live):
    c = client(live)
    r = c.completions.create(model="celeris-tiny", prompt=PROSE, max_tokens=16, seed=0, logprobs=2,
                             extra_body={"ignore_eos": True})  # all 16 tokens, whatever the model's EOS
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 16
    assert "".join(lp.tokens).strip() and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(alts) == 2 for alts in lp.top_logprobs) and lp.text_offset[0] == 0
    chat = c.chat.completions.create(model="celeris-tiny", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=8, seed=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content[:1])
    none = c.chat.completions.create(model="celeris-tiny", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=8, seed=0)
    assert none.choices[0].logprobs is None


def test_n_samples_are_batched_with_their_own_seeds(live):
    c = client(live)
    r = c.completions.create(model="celeris-tiny", prompt=PROSE, max_tokens=16, n=3, temperature=1.0, seed=7)
    texts = [ch.text for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len(set(texts)) > 1  # seeds 7, 8, 9
    again = c.completions.create(model="celeris-tiny", prompt=PROSE, max_tokens=16, temperature=1.0, seed=8)
    assert again.choices[0].text == texts[1]  # sample j is the request with seed + j
    assert r.usage.completion_tokens >= len(texts) and r.usage.prompt_tokens == again.usage.prompt_tokens
    chat = c.chat.completions.create(model="celeris-tiny", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=8, n=2, temperature=1.0, seed=1)
    assert [ch.index for ch in chat.choices] == [0, 1]
    chunks = list(c.completions.create(model="celeris-tiny", prompt=PROSE, max_tokens=16, n=2, stream=True,
                                       temperature=1.0, seed=7))
    streamed = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in (0, 1)}
    assert streamed == {0: texts[0], 1: texts[1]}


def test_list_prompts_and_echo(live):
    c = client(live)
    prompts = [PROSE, "Emma Woodhouse, handsome,"]
    r = c.completions.create(model="celeris-tiny", prompt=prompts, max_tokens=16, seed=0)
    solo = [c.completions.create(model="celeris-tiny", prompt=p, max_tokens=16, seed=0).choices[0].text
            for p in prompts]
    assert [ch.text for ch in r.choices] == solo
    echoed = c.completions.create(model="celeris-tiny", prompt=PROSE, max_tokens=16, seed=0, echo=True)
    assert echoed.choices[0].text == PROSE + solo[0]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="celeris-tiny", prompt=PROSE, max_tokens=16, n=17)
    assert "n" in str(e.value)


def test_model_names_are_checked(live):
    c = client(live)
    assert [m.id for m in c.models.list().data] == ["celeris-tiny"]
    assert c.models.retrieve("celeris-tiny").id == "celeris-tiny"
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt=PROSE, max_tokens=8)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="celeris-tiny", prompt=PROSE, max_tokens=8, frequency_penalty=2.5)
    assert e.value.body["param"] == "frequency_penalty" and "[-2, 2]" in e.value.body["message"]
