"""Both shipped models load by name and serve through every surface: gRPC (delta stream, the
client's default), the OpenAI-compatible completions and chat endpoints."""

from __future__ import annotations

import openai
import pytest

from celeris_client.client import CelerisClient
from celeris.engine.llm import EMBEDDED_MODELS, LLM
from tests.integration.live_server import live_server


@pytest.fixture(scope="module", params=sorted(EMBEDDED_MODELS))
def embedded(request):
    llm = LLM.load(request.param)
    with live_server(llm) as live:
        yield request.param, llm, live


def test_loads_by_name_with_its_own_family(embedded):
    name, llm, _ = embedded
    assert llm.name == name
    assert llm.family.kind == ("block" if name.endswith("-block") else "full")


def test_grpc_stream_rebuilds_to_the_final_text(embedded):
    name, llm, live = embedded
    with CelerisClient(live.grpc_target) as client:
        snaps = list(client.stream("37+45=", gen_length=16, seed=0))
        whole = client.generate("37+45=", gen_length=16, seed=0)
    assert snaps[-1].done and len(snaps) > 1 and snaps[-1].text == whole.text


def test_openai_completions_and_chat(embedded):
    name, _, live = embedded
    api = openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    done = api.completions.create(model=name, prompt="It was a truth universally", max_tokens=32, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens <= 32
    chat = api.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is 37+45?"}],
                                       max_tokens=16, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.model == name
