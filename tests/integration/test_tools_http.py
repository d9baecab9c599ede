"""Tools over HTTP with the official `openai` SDK against a real server on port 0: a two-turn agent
loop (a call, the tool's result, a final answer) plain and streamed, the streamed chunks
reassembling to the non-streamed tool_calls (ids included: they derive from the request id);
calls under "required" and a named function validating against the function's schema; a
malformed call under "auto" coming back as content with a 200; 400s naming the field; a tool
request beside other running requests leaving them as they were alone."""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import openai
import pytest

from celeris.engine.errors import EngineError
from celeris.engine.llm import LLM
from celeris.server import tools_api
from tests.integration.live_server import live_server

WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False, "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "required": ["a", "b"], "properties": {
                 "a": {"type": "integer", "minimum": 0, "maximum": 999},
                 "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def llm():
    from celeris.engine.config import EngineConfig

    # The template lists the tools' schemas: two tools and a three-turn history pass 512 tokens.
    return LLM.load(None, EngineConfig(max_prompt_tokens=896, max_gen_length=128))


@pytest.fixture(scope="module")
def live(llm):
    with live_server(llm) as s:  # celeris-tiny's template shows hermes calls: the parser is detected
        yield s


def sdk(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reassemble(chunks) -> tuple[str, list[dict], str]:
    """(content, tool_calls, finish_reason) from streamed chunks, as an agent framework does."""
    content, calls, finish = "", [], None
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or ():
            if tc.index == len(calls):
                calls.append({"id": tc.id, "type": tc.type, "function": {"name": tc.function.name, "arguments": ""}})
            calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
        finish = c.finish_reason or finish
    return content, calls, finish


def dumped(calls) -> list[dict]:
    return [c.model_dump(exclude_none=True) for c in calls]


def turn(c: openai.OpenAI, messages, rid: str, stream: bool, **kw):
    args = dict(model="celeris-tiny", messages=messages, tools=TOOLS, max_tokens=64, seed=0,
                extra_headers={"X-Request-Id": rid}, **kw)
    if stream:
        return reassemble(c.chat.completions.create(stream=True, **args))
    r = c.chat.completions.create(**args)
    msg = r.choices[0].message
    return msg.content or "", dumped(msg.tool_calls or []), r.choices[0].finish_reason


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_two_turn_tool_loop_plain_and_streamed(live):
    c = sdk(live)
    first = turn(c, ASK, "loop-1", False, tool_choice=NAMED)
    content, calls, finish = first
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    call = calls[0]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    assert turn(c, ASK, "loop-1", True, tool_choice=NAMED) == first  # the same calls, ids included
    # the live canvas beside them: delta events, then the parsed answer on the last one
    assert turn(c, ASK, "loop-1", True, tool_choice=NAMED, extra_body={"diffusing": True}) == first
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                     {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18, "sky": "clear"}'}]
    answer = turn(c, history, "loop-2", False, tool_choice="none")
    assert answer[1] == [] and answer[2] in ("stop", "length") and answer[0]
    assert turn(c, history, "loop-2", True, tool_choice="none") == answer


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_required_and_named_calls_validate_against_their_schemas(live):
    c = sdk(live)
    for seed, choice in enumerate(["required", NAMED, {"type": "function", "function": {"name": "add"}}] * 2):
        r = c.chat.completions.create(model="celeris-tiny", messages=ASK, tools=TOOLS, tool_choice=choice,
                                      max_tokens=64, seed=seed, temperature=1.0, parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r
        if isinstance(choice, dict):
            assert calls[0].function.name == choice["function"]["name"]
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_auto_parses_a_well_formed_call_and_returns_a_malformed_one_as_content(live):
    c = sdk(live)
    # The model's own text under "auto", pinned with a choice so the test does not depend on its taste.
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": </tool_call>'
    unknown = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    cases = ((good, True, (False, True)), (bad, False, (False, True)), (unknown, False, (False,)))
    for text, called, streams in cases:
        for stream in streams:
            kw = dict(model="celeris-tiny", messages=ASK, tools=TOOLS, max_tokens=96, seed=0,
                      extra_body={"structured_outputs": {"choice": [text]}})
            if stream:
                content, calls, finish = reassemble(c.chat.completions.create(stream=True, **kw))
            else:
                r = c.chat.completions.create(**kw)
                msg = r.choices[0].message
                content, calls, finish = msg.content or "", dumped(msg.tool_calls or []), r.choices[0].finish_reason
            if called:
                assert finish == "tool_calls" and content == "" and json.loads(calls[0]["function"]["arguments"]) == {
                    "a": 2, "b": 3}
            else:
                assert finish == "stop" and calls == [] and content == text


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_the_docs_agent_loop_runs(live, capsys):
    """docs/tools.md's "An agent loop with the openai SDK" example, run as written against this server."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "tools.md").read_text()
    section = text[text.index("## An agent loop with the openai SDK"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code.replace("http://127.0.0.1:8000/v1", live.http_url + "/v1"), "docs/tools.md", "exec"), {})
    assert capsys.readouterr().out.strip()  # the final answer was printed


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_fields_are_400s_naming_the_field(live, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(live).chat.completions.create(model="celeris-tiny", messages=ASK, max_tokens=16, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_openapi_lists_the_tool_fields(live):
    import urllib.request

    import jsonschema as js

    with urllib.request.urlopen(live.http_url + "/openapi.json") as r:
        schema = json.load(r)["components"]["schemas"]["ChatCompletionRequest"]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "tool", "tool_call_id": "c",
                                                                                "content": "1"}]
    js.validate({"messages": history, "tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False}, schema)


def test_completions_refuse_tools_by_name(live):
    with pytest.raises(openai.BadRequestError) as e:
        sdk(live).completions.create(model="celeris-tiny", prompt="x", max_tokens=8, extra_body={"tools": TOOLS})
    assert e.value.body["param"] == "tools"


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_tool_request_beside_running_requests_leaves_them_alone(live):
    c = sdk(live)
    prose = dict(model="celeris-tiny", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=64,
                 seed=5, temperature=1.0, extra_body={"ignore_eos": True})
    alone = c.chat.completions.create(**prose).choices[0].message.content
    got: dict = {}

    def run(k: int) -> None:
        got[k] = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **prose)
                         if ch.choices)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    r = c.chat.completions.create(model="celeris-tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                  max_tokens=64, seed=1)
    for t in threads:
        t.join(120)
    assert r.choices[0].finish_reason == "tool_calls"
    assert got == {0: alone, 1: alone}


def test_unknown_parser_names_fail_at_start_up(llm):
    for field in ("tool_call_parser", "reasoning_parser"):
        with pytest.raises(EngineError, match="not a known parser"):
            tools_api.resolve(llm.tokenizer.chat_template, **{field: "bogus"})
    assert tools_api.resolve(llm.tokenizer.chat_template, "hermes", "none").names == {
        "tool_call_parser": "hermes", "reasoning_parser": None}
    from celeris.server.cli import build_parser

    a = build_parser().parse_args(["serve", "--tool-call-parser", "hermes", "--reasoning-parser", "none",
                                   "--enable-auto-tool-choice"])
    assert (a.tool_call_parser, a.reasoning_parser, a.enable_auto_tool_choice) == ("hermes", "none", True)


# ------------------------------------------------------------------ family chat templates, random checkpoints


def _family(kind: str, folder):
    from tests.unit import agent_templates
    from tests.unit.block_references.checkpoints import write_llada2_checkpoint, write_sdar_checkpoint
    from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint

    write, template = {"sdar": (write_sdar_checkpoint, agent_templates.QWEN_STYLE),
                       "llada2": (write_llada2_checkpoint, agent_templates.LLADA2_STYLE),
                       "gemma": (write_bpe_checkpoint, agent_templates.GEMMA_STYLE)}[kind]
    write(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    return folder


@pytest.fixture(scope="module", params=["sdar", "llada2", "gemma"])
def family(request, tmp_path_factory):
    from celeris.engine.config import EngineConfig

    folder = _family(request.param, tmp_path_factory.mktemp(request.param))
    llm = LLM.load(folder, EngineConfig(max_batch=4, max_queue=8, max_prompt_tokens=768, max_gen_length=128))
    with live_server(llm) as s:  # no parser flags: both detected from the template
        yield request.param, s


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_family_templates_run_the_tool_loop_plain_and_streamed(family):  # about 5 s a family
    kind, live = family
    c = sdk(live)
    model = c.models.list().data[0].id
    tools = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": {
        "type": "object", "required": ["a", "b"], "additionalProperties": False,
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}]
    ask = [{"role": "user", "content": "What is 2 plus 3?"}]

    def run(messages, rid, stream, **kw):
        args = dict(model=model, messages=messages, tools=tools, max_tokens=64, seed=0,
                    extra_headers={"X-Request-Id": rid}, **kw)
        if stream:
            return reassemble(c.chat.completions.create(stream=True, **args))
        r = c.chat.completions.create(**args)
        return (r.choices[0].message.content or "", dumped(r.choices[0].message.tool_calls or []),
                r.choices[0].finish_reason)

    named = {"type": "function", "function": {"name": "add"}}
    first_turn = {"tool_choice": named}
    if kind == "gemma":  # a revising model: the named call is enforced in Gemma's format (keys and types,
        # not numeric bounds: docs/tools.md), so its arguments validate without the bounds
        content, calls, finish = run(ask, f"{kind}-0", False, tool_choice=named)
        assert finish == "tool_calls" and [c["function"]["name"] for c in calls] == ["add"]
        unbounded = {**tools[0]["function"]["parameters"], "properties": {"a": {"type": "integer"},
                                                                          "b": {"type": "integer"}}}
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), unbounded)
        # "auto" reads what the model writes in its own format (pinned here: a random model's taste varies)
        first_turn = {"extra_body": {"structured_outputs": {"choice": ["<|tool_call>call:add{a:2,b:3}<tool_call|>"]}}}
    first = run(ask, f"{kind}-1", False, **first_turn)
    assert first[2] == "tool_calls" and len(first[1]) == 1, first
    call = first[1][0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), tools[0]["function"]["parameters"])
    assert run(ask, f"{kind}-1", True, **first_turn) == first
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
    answer = run(history, f"{kind}-2", False, tool_choice="none")
    assert answer[1] == [] and answer[2] in ("stop", "length")
    assert run(history, f"{kind}-2", True, tool_choice="none") == answer


def test_tools_are_checked_off_the_event_loop_and_enforced_with_the_tokenizers_markers(live, llm, monkeypatch):
    """Checking a tool compiles its schema (tens of ms the first time): never on the event loop, on
    either door. An enforced call writes the format's markers as the tokenizer's added tokens."""
    import celeris.engine.requests as agent_tools  # where the doors find parse_tools (the engine's request vocabulary)

    threads, real = [], agent_tools.parse_tools

    def spy(*a, **kw):
        try:
            asyncio.get_running_loop()
            threads.append("the event loop")
        except RuntimeError:  # no loop runs here: a worker thread
            threads.append("a worker")
        return real(*a, **kw)

    monkeypatch.setattr(agent_tools, "parse_tools", spy)
    r = sdk(live).chat.completions.create(model="celeris-tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                          max_tokens=64, seed=0)
    assert r.choices[0].finish_reason == "tool_calls"
    from celeris_client import CelerisClient

    with CelerisClient(live.grpc_target) as c:
        c.generate(ASK, tools=TOOLS, tool_choice="required", gen_length=64, seed=0)
    assert threads == ["a worker", "a worker"]
    assert live.server.http.parsers.specials == llm.tokenizer.special_markers
