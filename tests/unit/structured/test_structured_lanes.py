"""Tools are admitted as structured outputs are (issue 60 item 1, engine/structured/lanes.py):
cheap checks first (the prompt's length, which the tools' rendering decides, before any schema
compiles), compiled on the compile lanes in the verdicts' child process, a per-client cap."""

from __future__ import annotations

import asyncio
import threading

import pytest

from celeris.engine.errors import InvalidRequest, Overloaded
from celeris.engine.requests import Request
from celeris.engine.structured import verdicts as verdicts_module
from celeris.engine.structured.lanes import COMPILES_PER_CLIENT

ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llm():
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM

    return LLM.load(None, EngineConfig(max_prompt_tokens=896, max_gen_length=64))  # one tool renders ~400 tokens


def _tools(n: int, tag: str = "") -> list[dict]:
    return [{"type": "function", "function": {"name": f"t{tag}{i}", "description": "", "parameters": {
        "type": "object", "properties": {f"p{tag}{i}": {"type": "string"}}}}} for i in range(n)]


@pytest.fixture
def asked(monkeypatch):
    """Every grammar the verdicts' child is asked about, and the thread that asked."""
    seen: list[str] = []
    real = verdicts_module.Verdicts.problem

    def spy(self, grammar, deadline_s):
        seen.append(threading.current_thread().name)
        return real(self, grammar, deadline_s)

    monkeypatch.setattr(verdicts_module.Verdicts, "problem", spy)
    return seen


def test_a_prompt_too_long_for_its_tools_is_refused_before_any_schema_compiles(llm, asked):
    with pytest.raises(InvalidRequest) as e:
        llm.build(Request(messages=ASK, tools=_tools(40)))  # the tools render past 896 tokens
    assert [v.field for v in e.value.violations] == ["messages"] and "tokens" in e.value.violations[0].description
    assert asked == []


def test_tools_compile_on_the_compile_lane_in_the_child_process(llm, asked):
    async def main():
        return await llm.build_async(Request(messages=ASK, tools=_tools(1, "lane")), client="a")

    asyncio.run(main())
    assert asked and all(name.startswith("celeris-compile") for name in asked), asked


def test_one_clients_flood_waits_behind_itself_not_in_front_of_another_client(llm, monkeypatch):
    """The hog's builds beyond COMPILES_PER_CLIENT wait at its own gate: a build of another client
    sent after all of them compiles before the hog's later ones; nothing is refused."""
    release, order = threading.Event(), []
    build = type(llm.requests).build

    def held(self, req):
        release.wait(60)
        order.append(req.request_id)
        return build(self, req)

    monkeypatch.setattr(type(llm.requests), "build", held)

    async def main():
        hog = [asyncio.ensure_future(llm.build_async(Request(messages=ASK, tools=_tools(1, f"c{k}"),
                                                             request_id=f"hog-{k}"), client="hog")) for k in range(6)]
        await asyncio.sleep(0)  # each has counted itself
        other = asyncio.ensure_future(llm.build_async(Request(messages=ASK, tools=_tools(1, "o"), request_id="other"),
                                                      client="b"))
        await asyncio.sleep(0.2)
        release.set()
        return await asyncio.gather(*hog, other)

    assert len(asyncio.run(main())) == 7
    assert order.index("other") <= COMPILES_PER_CLIENT, order  # behind at most the hog's share
    assert not llm.requests.lanes._by_client and not llm.requests.lanes._gates  # every place given back
