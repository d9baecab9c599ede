"""Hostile clients, round five (issue 60): tools and the history are doors too.

Each shape the issue saw, sent to a real server on port 0 (celeris-tiny, its hermes tool-call
format) through both doors: JSON nested thousands deep in every field that holds JSON is a 400 /
INVALID_ARGUMENT naming the nesting limit (never a RecursionError's 500 / UNKNOWN); a tool name
ending in a newline is refused by name; the history's tool-call arguments and every other text
field count in the prompt's size limit before anything is tokenized; the routes open without the
API key and the Content-Type rule hold for every POST. Behavioural only: no clock bounds.
"""

from __future__ import annotations

import json

import grpc
import pytest

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.v1 import generation_pb2 as pb
from celeris.v1 import generation_pb2_grpc as pb_grpc
from tests.integration.http_helpers import post
from tests.integration.live_server import LiveServer, live_server

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.fixture(scope="module")
def live():
    llm = LLM.load(None, EngineConfig(max_prompt_tokens=512, max_gen_length=64))
    with live_server(llm) as s:
        yield s


def _http(live: LiveServer, body: dict) -> tuple[int, dict]:
    r = post(live, "/v1/chat/completions", {"model": "celeris-tiny", "max_tokens": 16, **body})
    return r.status, json.loads(r.read() or b"{}")


def _grpc(live: LiveServer, req: pb.GenerateRequest) -> tuple[str, str]:
    with grpc.insecure_channel(live.grpc_target) as ch:
        try:
            list(pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=120))
        except grpc.RpcError as e:
            return e.code().name, e.details() or ""
    return "OK", ""


def _history(arguments: str) -> list[dict]:
    return ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18"}]


def _pb_history(arguments: str) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content=ASK[0]["content"]),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather", arguments=arguments)]),
        pb.ChatMessage(role="tool", tool_call_id="c1", content="18")])


HTTP_NESTED = {  # every HTTP field that holds JSON, nested past any parser's recursion
    "history arguments": {"messages": _history(_deep(5000)), "tools": [TOOL]},
    "response_format schema text": {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _deep(20000)}}},
    "structured_outputs json text": {"messages": ASK, "structured_outputs": {"json": _deep(20000)}},
}


@pytest.mark.parametrize("case", sorted(HTTP_NESTED))
def test_http_json_nested_thousands_deep_is_a_400(live, case):
    status, body = _http(live, HTTP_NESTED[case])
    assert status == 400, (case, status, body)
    assert "deep" in json.dumps(body), body
    assert _http(live, {"messages": ASK})[0] == 200  # and the server serves on


def test_http_tool_parameters_nested_deep_are_a_400(live):
    """Parameters as parsed JSON: the body parser's own depth bound answers first, as a 400."""
    deep: object = {}
    for _ in range(400):  # 800 deep: under json's recursion limit, far over the schema's nesting limit
        deep = {"type": "object", "properties": {"a": deep}}
    body = {"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}
    status, out = _http(live, body)
    assert status == 400 and "deep" in json.dumps(out), out


GRPC_NESTED = {
    "history arguments": dict(chat=_pb_history(_deep(5000)), tools=[pb.Tool(name="get_weather")]),
    "tool parameters": dict(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                            tools=[pb.Tool(name="f", parameters=_deep(20000))]),
    "structured_output schema": dict(prompt="hi", structured_output=pb.StructuredOutput(json_schema=_deep(20000))),
}


@pytest.mark.parametrize("case", sorted(GRPC_NESTED))
def test_grpc_json_nested_thousands_deep_is_invalid_argument(live, case):
    code, details = _grpc(live, pb.GenerateRequest(gen_length=16, **GRPC_NESTED[case]))
    assert code == "INVALID_ARGUMENT" and "deep" in details, (case, code, details[:300])


@pytest.mark.parametrize("name", ["get_weather\n", "get_weather\r\n", "\nget_weather"])
def test_a_tool_name_with_a_newline_is_refused_on_both_doors(live, name):
    tool = {"type": "function", "function": {"name": name, "parameters": TOOL["function"]["parameters"]}}
    status, body = _http(live, {"messages": ASK, "tools": [tool],
                                "tool_choice": {"type": "function", "function": {"name": name}}})
    assert status == 400 and "tools[0].function.name" in json.dumps(body), (status, body)
    code, details = _grpc(live, pb.GenerateRequest(
        gen_length=16, chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
        tools=[pb.Tool(name=name)], tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)))
    assert code == "INVALID_ARGUMENT" and "tools[0].name" in details, (code, details)


def test_named_and_required_calls_always_come_back_as_calls(live):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        status, body = _http(live, {"messages": ASK, "tools": [TOOL], "tool_choice": choice, "max_tokens": 48})
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "tool_calls" and body["choices"][0]["message"]["tool_calls"]


def test_every_post_without_a_content_type_is_a_415_ping_included(live):
    import http.client
    from urllib.parse import urlparse

    from celeris.server.http.gateway import ROUTES

    u = urlparse(live.http_url)
    for route in (r for r in ROUTES if r.method == "POST"):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.putrequest("POST", route.path)
        conn.putheader("Content-Length", "2")
        conn.endheaders(b"{}")
        r = conn.getresponse()
        assert r.status == 415, (route.path, r.status, r.read())
        conn.close()
    assert post(live, "/ping", {}).status == 200  # with its JSON type it answers as /health does


def test_the_docs_list_every_route_open_without_the_key():
    from pathlib import Path

    from celeris.server.http.gateway import PUBLIC_PATHS

    auth = next(p for p in (Path(__file__).parents[2] / "docs" / "operations.md").read_text().split("\n- ")
                if p.startswith("Auth:"))
    missing = [p for p in PUBLIC_PATHS if f"`{p}`" not in auth]
    assert not missing, missing
