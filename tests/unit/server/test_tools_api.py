"""The HTTP door's tool fields (server/tools_api.py) and how answers are read (server/tool_answers.py),
with a stand-in parser: field names in every refusal, the history an agent loop sends, enforcement's
conflicts, parsed answers and their streamed deltas reassembling to the same calls."""

from __future__ import annotations

import json
import re

import pytest

from celeris.engine.agents.tools import ToolCall
from celeris.engine.errors import InvalidRequest
from celeris.engine.sampling.params import SamplingParams
from celeris.server import tool_answers, tools_api
from celeris.server.http.openai_api import parse_request
from celeris.server.tool_answers import AnswerReader

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def parse(body: dict, chat: bool = True):
    return parse_request(body, SamplingParams(), chat)


class Hermes:
    """A stand-in tool parser: `<tool_call>{"name", "arguments"}</tool_call>`, malformed ones kept."""

    name = "stand-in"
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def extract(self, text, names=None):
        calls, kept = [], text
        for m in self.CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
                calls.append(ToolCall("x", obj["name"], json.dumps(obj["arguments"])))
                kept = kept.replace(m.group(0), "")
            except (ValueError, KeyError, TypeError):
                pass
        return kept.strip(), calls

    def render(self, name, arguments):  # plan() checks an enforced call reads back as a call
        return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"

    def enforced(self, tools, choice, parallel, specials=None):
        return ("enforced", choice.mode, parallel)

    def lazy(self, tools, parallel, specials=None):
        return ("lazy", parallel)


class Broken:
    name = "broken"

    def extract(self, text, names=None):
        raise RuntimeError("a parser bug")


class Think:
    name = "think"

    def split(self, text):
        head, found, tail = text.partition("</think>")
        return (head.removeprefix("<think>"), tail) if found else (None, text)


def test_tools_and_choice_are_read():
    r = parse({"messages": USER, "tools": [WEATHER]})
    assert [t.name for t in r.tools.tools] == ["get_weather"] and r.tools.choice.mode == "auto" and r.tools.parallel
    named = parse({"messages": USER, "tools": [WEATHER], "parallel_tool_calls": False,
                   "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.tools.enforced and named.tools.choice.name == "get_weather" and not named.tools.parallel
    assert parse({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}).tools.parsed is False
    assert parse({"messages": USER, "tools": []}).tools is None


@pytest.mark.parametrize("extra, field", [
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"function_call": {"name": "get_weather"}}, "function_call"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "structured_outputs": {"choice": ["a", "b"]}}, "tool_choice"),
])
def test_bad_tool_fields_are_named(extra, field):
    with pytest.raises(InvalidRequest) as e:
        parse({"messages": USER, **extra})
    assert field in [v.field for v in e.value.violations]


def test_deprecated_functions_say_to_use_tools():
    with pytest.raises(InvalidRequest) as e:
        parse({"messages": USER, "functions": [{"name": "f", "parameters": {}}]})
    assert "use `tools`" in e.value.violations[0].description


def test_completions_refuse_tools_but_take_their_neutral_values():
    with pytest.raises(InvalidRequest) as e:
        parse({"prompt": "x", "tools": [WEATHER]}, chat=False)
    assert [v.field for v in e.value.violations] == ["tools"]
    assert parse({"prompt": "x", "tools": [], "tool_choice": "none", "parallel_tool_calls": True}, chat=False)


def test_an_agent_loop_history_is_carried():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]
    r = parse({"messages": msgs, "tools": [WEATHER]})
    assert r.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert r.messages[2] == {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1", "name": "get_weather"}
    with pytest.raises(InvalidRequest) as e:
        parse({"messages": USER + [{"role": "tool", "content": "x"}, {"role": "user", "tool_calls": [call],
                                                                       "content": "y"}]})
    assert {v.field for v in e.value.violations} == {"messages[1].tool_call_id", "messages[2].tool_calls"}


def test_plan_enforces_required_and_named_and_refuses_without_a_parser():
    auto = parse({"messages": USER, "tools": [WEATHER]}).tools
    required = parse({"messages": USER, "tools": [WEATHER], "tool_choice": "required"}).tools
    parsers = tools_api.Parsers(Hermes())
    assert tools_api.plan(auto, parsers, None) == ("lazy", True)  # "auto": text or calls, decided by the model
    assert tools_api.plan(auto, parsers, "own") == "own"  # a structure of its own: parsed after the fact
    assert tools_api.plan(auto, tools_api.Parsers(Hermes(), Think()), None) is None  # thinking comes first
    assert tools_api.plan(required, parsers, None) == ("enforced", "required", True)
    assert tools_api.plan(None, tools_api.Parsers(), "own") == "own"
    with pytest.raises(InvalidRequest) as e:
        tools_api.plan(auto, tools_api.Parsers(), None)
    assert e.value.violations[0].field == "tools" and "--tool-call-parser" in e.value.violations[0].description


def test_answers_parsed_malformed_kept_and_parser_failures_are_content():
    reader = AnswerReader(Hermes())
    a = reader.read('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "r1", 0)
    assert a.content == "Sure." and [(c.name, json.loads(c.arguments)) for c in a.calls] == [
        ("get_weather", {"city": "Paris"})]
    assert a.calls[0].id == reader.read('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "r1", 0).calls[0].id
    assert a.calls[0].id != reader.read('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "r2", 0).calls[0].id
    only = reader.read('<tool_call>{"name": "f", "arguments": {}}</tool_call>', "r1", 0)
    assert only.content is None and tool_answers.finish_reason(only, "stop") == "tool_calls"
    bad = '<tool_call>{"name": "f", "arguments": {</tool_call>'
    assert reader.read(bad, "r1", 0) == tool_answers.Answer(bad)
    assert AnswerReader(Broken()).read("text", "r1", 0) == tool_answers.Answer("text")
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in AnswerReader(Hermes(), parallel=False).read(two, "r", 0).calls] == ["a"]


def test_streamed_deltas_reassemble_to_the_message():
    reader = AnswerReader(Hermes(), Think(), reports_reasoning=True)
    text = ('<think>Paris, so weather.</think>Checking. <tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Paris, France, the one on the Seine, not the Texan one"}}</tool_call>')
    answer = reader.read(text, "req", 0)
    msg = tool_answers.message(answer, reader)
    assert msg["reasoning_content"] == "Paris, so weather." and msg["content"] == "Checking."
    got: dict = {"reasoning_content": "", "content": "", "tool_calls": []}
    for d in tool_answers.deltas(answer):
        got["reasoning_content"] += d.get("reasoning_content", "")
        got["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(got["tool_calls"]):
                got["tool_calls"].append({"id": tc["id"], "type": tc["type"],
                                          "function": {"name": tc["function"]["name"], "arguments": ""}})
            got["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    assert got["tool_calls"] == msg["tool_calls"] and got["content"] == msg["content"]
    assert sum("tool_calls" in d for d in tool_answers.deltas(answer)) > 2  # the arguments came in pieces


def test_an_enforced_call_that_would_not_read_back_is_a_400_not_a_200_without_calls():
    """Issue 60 item 4: "required" or a named call always parses, or the request is refused."""
    class Unreadable(Hermes):
        def render(self, name, arguments):
            return f"<tool_call>{{\"name\": \"{name}\n\"}}</tool_call>"  # a name the JSON cannot hold

    required = parse({"messages": USER, "tools": [WEATHER], "tool_choice": "required"}).tools
    with pytest.raises(InvalidRequest) as e:
        tools_api.plan(required, tools_api.Parsers(Unreadable()), None)
    assert e.value.violations[0].field == "tools[0].function.name" and "read back" in e.value.violations[0].description
