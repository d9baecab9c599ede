"""The Responses and Messages APIs as shapes over the chat path: bodies in, answers and events out."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from celeris.engine.errors import FieldViolation, InvalidRequest
from celeris.server.http.messages_api import MessagesShape
from celeris.server.http.responses_api import ResponsesShape

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
EV = SimpleNamespace(prompt_tokens=7, generated=[1, 2, 3], cached_tokens=2, stop_text="")


def fields(exc: pytest.ExceptionInfo) -> list[str]:
    return [f.field for f in exc.value.violations]


# ---------------------------------------------------------------- Responses: the request


def test_responses_items_become_one_chat_conversation():
    body = ResponsesShape().request({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 48, "temperature": 0, "seed": 3,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "store": True, "include": [],
        "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
        "input": [{"role": "developer", "content": "No chatter."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call_output", "call_id": "call_1", "output": "18C"}]})
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "No chatter."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                               "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert "response_format" not in body  # a forced call has no text to shape: the format waits for a text turn
    auto = ResponsesShape().request({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto",
                                     "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}})
    assert auto["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    assert (body["max_tokens"], body["temperature"], body["seed"], body["model"]) == (48, 0, 3, "m")
    assert "store" not in body and "include" not in body


def test_responses_refuses_by_its_own_fields():
    with pytest.raises(InvalidRequest) as e:
        ResponsesShape().request({"input": [{"type": "input_image", "image_url": "x"}, {"role": "user", "content": [
            {"type": "input_file", "file_id": "f"}]}], "previous_response_id": "resp_1", "temprature": 1,
            "tools": [{"type": "web_search"}], "include": ["file_search_call.results"], "background": True})
    assert set(fields(e)) == {"input[0].type", "input[1].content[0]", "previous_response_id", "temprature",
                              "tools[0].type", "include", "background"}
    with pytest.raises(InvalidRequest) as e:
        ResponsesShape().request({"input": []})
    assert fields(e) == ["input"]


def test_responses_names_the_clients_field_in_a_chat_error():
    shape = ResponsesShape()
    shape.request({"instructions": "x", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
    e = shape.rename(InvalidRequest([FieldViolation("messages[2].content", "bad"), FieldViolation("max_tokens", "big"),
                                     FieldViolation("tools[1].function.parameters.x", "no"),
                                     FieldViolation("response_format.json_schema.schema", "no")]))
    assert [f.field for f in e.violations] == ["input[1].content", "max_output_tokens", "tools[1].parameters.x",
                                               "text.format.schema"]


# ---------------------------------------------------------------- Responses: the answer


def chat_final(content, calls=(), finish="stop") -> dict:
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [{"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": a}}
                             for k, (n, a) in enumerate(calls)]
    return {"id": "chatcmpl-r1", "model": "celeris-tiny", "choices": [{"index": 0, "message": msg,
                                                                       "finish_reason": finish}]}


def chat_stream(content: str, calls=(), finish="stop", canvas=False) -> list[dict]:
    """The chunks the chat path sends for such an answer (text in two pieces, arguments in two)."""
    def chunk(delta, finish_reason=None, extra=None):
        c = {"id": "chatcmpl-r1", "model": "celeris-tiny",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        return c | ({"celeris": extra} if extra else {})
    out = [chunk({"role": "assistant", "content": ""}, extra={"step": 1} if canvas else None)]
    if content:
        out += [chunk({"content": content[:2]}), chunk({"content": content[2:]})]
    for k, (name, args) in enumerate(calls):
        out.append(chunk({"tool_calls": [{"index": k, "id": f"call_{k}", "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": k, "function": {"arguments": a}}]}) for a in (args[:3], args[3:])]
    return out + [chunk({"content": ""}, finish)]


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_responses_final_body_has_message_and_call_items():
    shape = ResponsesShape()
    shape.request({"input": "hi", "max_output_tokens": 32})
    r = shape.final(chat_final("Sure.", [("get_weather", '{"city": "Paris"}')], "tool_calls"), EV)
    assert r["id"] == "resp_r1" and r["status"] == "completed" and r["max_output_tokens"] == 32
    assert [o["type"] for o in r["output"]] == ["message", "function_call"]
    assert r["output"][0]["content"][0]["text"] == "Sure."
    assert r["output"][1] | {} == {"type": "function_call", "id": "fc_0", "call_id": "call_0", "name": "get_weather",
                                   "arguments": '{"city": "Paris"}', "status": "completed"}
    assert r["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3,
                          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10}
    cut = shape.final(chat_final("Sur", finish="length"), EV)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize("calls", [(), [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]])
def test_responses_stream_reassembles_to_the_final_body(calls):
    shape = ResponsesShape()
    shape.request({"input": "hi"})
    enc = shape.encoder("r1")
    finish = "tool_calls" if calls else "stop"
    evs = events(b"".join(enc(c, EV) for c in chat_stream("Hello", calls, finish, canvas=True)))
    kinds = [k for k, _ in evs]
    assert kinds[:3] == ["response.created", "response.in_progress", "celeris.canvas"]
    assert kinds[-1] == "response.completed" and [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert "".join(d["delta"] for k, d in evs if k == "response.output_text.delta") == "Hello"
    for k, (name, args) in enumerate(calls):
        assert "".join(d["delta"] for kind, d in evs if kind == "response.function_call_arguments.delta"
                       and d["item_id"] == f"fc_{k}") == args
    done = [d["item"] for k, d in evs if k == "response.output_item.done"]
    final = shape.final(chat_final("Hello", calls, finish), EV)
    assert done == final["output"] == evs[-1][1]["response"]["output"]


# ---------------------------------------------------------------- Messages


def test_messages_turns_and_blocks_become_chat_messages():
    body = MessagesShape().request({
        "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["\n\n"],
        "tools": [{"name": "get_weather", "description": "w", "input_schema": WEATHER}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "Paris?"},
                     {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                       {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18C"},
                                                  {"type": "text", "text": "And so?"}]}]})
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "18C"}, {"role": "user", "content": "And so?"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                               "description": "w"}}]
    assert (body["tool_choice"], body["parallel_tool_calls"], body["stop"]) == ("required", False, ["\n\n"])
    for given, chat in (("auto", "auto"), ("none", "none")):
        assert MessagesShape().request({"messages": [{"role": "user", "content": "x"}],
                                        "tool_choice": {"type": given}})["tool_choice"] == chat


def test_messages_refuses_by_field_and_answers_in_anthropics_error_shape():
    with pytest.raises(InvalidRequest) as e:
        MessagesShape().request({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]},
                                              {"role": "system", "content": "x"}],
                                 "thinking": {"type": "enabled", "budget_tokens": 9}, "tool_choice": {"type": "all"}})
    assert set(fields(e)) == {"messages[0].content[0].type", "messages[1].role", "thinking", "tool_choice"}
    body = MessagesShape().error_body(400, {"error": {"message": "bad", "type": "invalid_request_error",
                                                      "param": "max_tokens", "code": None}})
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad",
                                               "param": "max_tokens"}}


def test_messages_final_and_stream_agree():
    shape = MessagesShape()
    shape.request({"model": "celeris-tiny", "messages": [{"role": "user", "content": "x"}]})
    calls = [("get_weather", '{"city": "Paris"}')]
    m = shape.final(chat_final("Hello", calls, "tool_calls"), EV)
    assert m["stop_reason"] == "tool_use" and m["id"] == "msg_r1"
    assert m["content"] == [{"type": "text", "text": "Hello"},
                            {"type": "tool_use", "id": "toolu_0", "name": "get_weather", "input": {"city": "Paris"}}]
    enc = shape.encoder("r1")
    evs = events(b"".join(enc(c, EV) for c in chat_stream("Hello", calls, "tool_calls")))
    kinds = [k for k, _ in evs]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert evs[0][1]["message"]["content"] == [] and evs[0][1]["message"]["stop_reason"] is None
    assert "".join(d["delta"]["partial_json"] for k, d in evs if k == "content_block_delta" and d["index"] == 1) == \
        calls[0][1]
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    stopped = SimpleNamespace(**(vars(EV) | {"stop_text": "\n\n"}))
    assert shape.final(chat_final("Hi"), stopped)["stop_sequence"] == "\n\n"
    assert shape.final(chat_final("Hi", finish="length"), EV)["stop_reason"] == "max_tokens"
