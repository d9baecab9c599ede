"""The client's tool shapes: OpenAI-shaped tools, tool_choice and tool turns into a GenerateRequest;
the last message's tool_calls, reasoning and content into Result; Result.message() as the turn to
send back; `celeris generate --tools` flags into knobs."""

from __future__ import annotations

import json

import pytest

from celeris.v1 import generation_pb2 as pb
from celeris_client.cli import build_parser, print_result, tool_knobs
from celeris_client.types import Result, Snapshot, ToolCall, build_request

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tools_choice_and_tool_turns_build_the_request():
    history = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"}]
    req = build_request(history, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                        parallel_tool_calls=False)
    (tool,) = req.tools
    assert (tool.name, tool.description, json.loads(tool.parameters)) == ("get_weather", "Weather", WEATHER)
    assert req.tool_choice == pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_FUNCTION, name="get_weather")
    assert req.HasField("parallel_tool_calls") and not req.parallel_tool_calls
    user, assistant, tool_msg = req.chat.messages
    assert assistant.content == "" and list(assistant.tool_calls) == [
        pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]
    assert (tool_msg.role, tool_msg.tool_call_id, tool_msg.name, tool_msg.content) == ("tool", "call_1", "get_weather",
                                                                                       "18C")
    bare = build_request(history[:1], tools=[{"name": "f"}], tool_choice="required")  # function dicts alone
    assert bare.tools[0].name == "f" and bare.tools[0].parameters == ""
    assert bare.tool_choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED and not bare.HasField("parallel_tool_calls")
    assert not build_request("x").tools and not build_request("x").HasField("tool_choice")
    with pytest.raises(ValueError, match="tool_choice"):
        build_request(history, tools=TOOLS, tool_choice="always")


def test_the_last_message_carries_calls_reasoning_and_content():
    m = pb.GenerateResponse(done=True, text="<think>hm</think><tool_call>...", finish_reason=pb.FINISH_REASON_TOOL_CALLS,
                            tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
                            reasoning="hm")
    res = Result.from_snapshot(Snapshot.from_pb(m))
    assert res.finish_reason == "tool_calls" and res.reasoning == "hm" and res.content is None
    assert res.tool_calls == (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    assert res.tool_calls[0].args == {"city": "Paris"} and res.tool_calls[0].openai() == CALL
    assert res.message() == {"role": "assistant", "content": "", "tool_calls": [CALL]}
    plain = Result.from_snapshot(Snapshot.from_pb(pb.GenerateResponse(done=True, text="Hello")))
    assert plain.tool_calls == () and plain.reasoning is None and plain.content is None
    assert plain.message() == {"role": "assistant", "content": "Hello"}
    read = Result.from_snapshot(Snapshot.from_pb(pb.GenerateResponse(done=True, text="<think>a</think>b",
                                                                      reasoning="a", content="b")))
    assert read.message() == {"role": "assistant", "content": "b"}


def test_cli_tool_flags(tmp_path, capsys):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    a = build_parser().parse_args(["generate", "hi", "--tools", str(path), "--tool-choice", "get_weather",
                                   "--no-parallel-tool-calls"])
    assert tool_knobs(a) == {"tools": TOOLS, "tool_choice": {"name": "get_weather"}, "parallel_tool_calls": False}
    a = build_parser().parse_args(["generate", "hi", "--tool-choice", "required"])
    assert tool_knobs(a) == {"tool_choice": "required"}
    assert tool_knobs(build_parser().parse_args(["generate", "hi"])) == {}
    path.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="JSON list of tools"):
        tool_knobs(build_parser().parse_args(["generate", "hi", "--tools", str(path)]))
    print_result(Result.from_snapshot(Snapshot.from_pb(pb.GenerateResponse(
        done=True, text="raw", reasoning="think", content="Let me look.",
        tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]))))
    assert capsys.readouterr().out.splitlines() == [
        "reasoning: think", "Let me look.", 'tool call call_1: get_weather({"city": "Paris"})']
