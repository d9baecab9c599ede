"""The agent clients people use, installed and run against a real server on the embedded model:
the `openai` SDK's Responses API, the OpenAI Agents SDK (its default Responses model), the
`anthropic` SDK's Messages API and LangChain's `ChatOpenAI(...).bind_tools(...)`."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import anthropic
import jsonschema
import openai
import pytest

from celeris.engine.llm import LLM
from tests.integration.live_server import live_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
           "additionalProperties": False}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def live():
    with live_server(LLM.load()) as s:  # the embedded model, as `celeris serve` starts it
        yield s


def oa(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def an(live, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.http_url, api_key=key, max_retries=0, timeout=120)


# ---------------------------------------------------------------- openai: responses.create


def test_responses_plain_and_streamed_say_the_same(live):
    c = oa(live)
    r = c.responses.create(model="celeris-tiny", input="It is a truth", instructions="Continue the text.",
                           max_output_tokens=32, extra_body={"seed": 4})
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    events = list(c.responses.create(model="celeris-tiny", input="It is a truth", instructions="Continue the text.",
                                     max_output_tokens=32, stream=True, extra_body={"seed": 4}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-1] == f"response.{r.status}" and "response.output_text.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text  # the same seed, the same answer
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_tool_call_and_its_output_as_input(live):
    c = oa(live)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
              "strict": True}]
    r = c.responses.create(model="celeris-tiny", input=QUESTION, tools=tools, tool_choice="required",
                           max_output_tokens=64, extra_body={"seed": 1})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = [{"role": "user", "content": QUESTION}, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18C and sunny"}]
    streamed = list(c.responses.create(model="celeris-tiny", input=follow, tools=tools, tool_choice="none",
                                       max_output_tokens=32, stream=True, extra_body={"diffusing": True}))
    kinds = {e.type for e in streamed}
    assert "celeris.canvas" in kinds and streamed[-1].type in ("response.completed", "response.incomplete")
    assert not [o for o in streamed[-1].response.output if o.type == "function_call"]  # "none": text only


def test_responses_refuses_stored_state_and_names_its_fields(live):
    c = oa(live)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="celeris-tiny", input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="celeris-tiny", input="hi", max_output_tokens=10**6)
    assert e.value.body["param"] == "max_output_tokens"  # the chat path's limit, in this API's name
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="gpt-4o", input="hi")


# ---------------------------------------------------------------- the OpenAI Agents SDK


@pytest.mark.slow
def test_agents_sdk_runs_an_agent_with_one_function_tool_to_a_final_answer(live):
    from dataclasses import dataclass

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @dataclass
    class Answer:
        weather: str

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "18C and sunny"

    client = openai.AsyncOpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    # tool_choice "required" makes the first turn a call (its text.format set aside: a call has no
    # text); the SDK resets it after the call (reset_tool_choice), so the second turn answers
    # under "auto" in the output type's schema (text.format), which ends the canvas by its own stop.
    agent = Agent(name="weather", instructions="Answer with the tool's result.", tools=[get_weather],
                  output_type=Answer, model=OpenAIResponsesModel(model="celeris-tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=48,
                                               extra_body={"seed": 2, "steps": 24}))
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=4))
    assert asked and isinstance(asked[0], str)  # the tool ran with the model's arguments
    assert isinstance(result.final_output.weather, str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds


# ---------------------------------------------------------------- anthropic: messages.create


def test_messages_plain_streamed_and_with_a_tool(live):
    a = an(live)
    msgs = [{"role": "user", "content": "It is a truth"}]
    m = a.messages.create(model="celeris-tiny", max_tokens=32, system="Continue the text.", messages=msgs,
                          extra_body={"seed": 5})
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    with a.messages.stream(model="celeris-tiny", max_tokens=32, system="Continue the text.", messages=msgs,
                           extra_body={"seed": 5}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.stop_reason == m.stop_reason
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}]
    t = a.messages.create(model="celeris-tiny", max_tokens=64, tools=tools, tool_choice={"type": "any"},
                          messages=[{"role": "user", "content": QUESTION}], extra_body={"seed": 1})
    uses = [b for b in t.content if b.type == "tool_use"]
    assert t.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="celeris-tiny", max_tokens=16, messages=[{"role": "user", "content": "x"}],
                          tool_choice={"type": "tool", "name": "nope"}, tools=tools)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"


def test_messages_take_the_key_as_x_api_key(tiny_llm):
    with live_server(tiny_llm, api_token="s3cret") as s:
        with pytest.raises(anthropic.AuthenticationError):
            an(s, "wrong").messages.create(model=tiny_llm.name, max_tokens=8, messages=[{"role": "user", "content": "x"}])
        m = an(s, "s3cret").messages.create(model=tiny_llm.name, max_tokens=8,
                                             messages=[{"role": "user", "content": "x"}])
        assert m.type == "message"


# ---------------------------------------------------------------- LangChain, and the route table


def test_langchain_bind_tools_gets_a_call(live):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "18C"

    llm = ChatOpenAI(model="celeris-tiny", base_url=live.http_url + "/v1", api_key="unused", max_tokens=64,
                     max_retries=0, timeout=120, seed=1)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION)
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)


def test_openapi_lists_both_apis(live):
    with urllib.request.urlopen(live.http_url + "/openapi.json") as r:
        doc = json.load(r)
    for path, schema in (("/v1/responses", "ResponsesRequest"), ("/v1/messages", "MessagesRequest")):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(schema) and doc["components"]["schemas"][schema]["properties"]


# ---------------------------------------------------------------- celeris batch


def test_batch_lines_take_tools_and_tool_choice(live, tmp_path, capsys):
    from celeris.server.cli import main as celeris

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    lines = [{"id": "call", "messages": [{"role": "user", "content": QUESTION}], "tools": tools,
              "tool_choice": "required", "gen_length": 64, "seed": 1},
             {"id": "named", "messages": [{"role": "user", "content": QUESTION}], "tools": tools, "gen_length": 64,
              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False},
             {"id": "unknown-tool", "messages": [{"role": "user", "content": "x"}], "tools": tools,
              "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             {"id": "not-chat", "prompt": "x", "tools": tools}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert celeris(["batch", str(src), str(dst), "--server", live.grpc_target]) == 1
    assert "in.jsonl:4: skipped: tools, tool_choice and parallel_tool_calls need" in capsys.readouterr().err
    recs = {r["id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    for k in ("call", "named"):
        assert recs[k]["status"] == "ok" and recs[k]["finish_reason"] == "tool_calls", recs[k]
        call = recs[k]["tool_calls"][0]
        assert call["function"]["name"] == "get_weather" and call["id"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    assert recs["unknown-tool"]["status"] == "error" and recs["unknown-tool"]["error"]["code"] == "INVALID_ARGUMENT"
