"""OpenAI request parsing, schedule fitting and the HTTP error table (no server)."""

from __future__ import annotations

import pytest

from celeris.engine.errors import FieldViolation, InvalidRequest, Overloaded, Unavailable
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.params import fit_lengths
from celeris.server.http.openai_api import error_response, parse_request, rename_fields

D = SamplingParams(gen_length=64, steps=64, block_length=32)


def parse(body, chat=False):
    return parse_request(body, D, chat)


def fit_schedule(gen_length, d, block=None):
    """max_tokens given alone (or with a block): what the gateway fits, through fit_lengths."""
    p = fit_lengths(d, {"gen_length": gen_length} | ({} if block is None else {"block_length": block}))
    return p.block_length, p.steps


@pytest.mark.parametrize("gen, expected", [(64, (32, 64)), (16, (16, 16)), (96, (32, 96)), (40, (20, 40)),
                                           (37, (37, 37)), (1, (1, 1))])
def test_fit_schedule_keeps_the_defaults_shape(gen, expected):
    block, steps = fit_schedule(gen, D)
    assert (block, steps) == expected
    assert gen % block == 0 and steps % (gen // block) == 0  # always valid for SamplingParams
    SamplingParams(gen_length=gen, steps=steps, block_length=block).validate(512)


def test_fit_schedule_halves_steps_like_the_defaults():
    assert fit_schedule(32, SamplingParams(gen_length=64, steps=32, block_length=32)) == (32, 16)
    assert fit_schedule(64, D, block=8) == (8, 64)


def test_completion_fields_map_to_sampling_params():
    r = parse({"prompt": "hi", "max_tokens": 16, "temperature": 0.5, "seed": 3, "stream": True,
               "diffusing": True, "threshold": 0.9, "remasking": "margin"})
    p = r.params
    assert (p.gen_length, p.block_length, p.steps, p.temperature, p.seed) == (16, 16, 16, 0.5, 3)
    assert (p.threshold, p.remasking, r.stream, r.diffusing, r.chat) == (0.9, "margin", True, True, False)
    assert parse({"prompt": ["one"]}).prompt == "one" and parse({"prompt": [1, 2]}).prompt == [1, 2]
    untouched = parse({"prompt": "x"}).params
    assert untouched == D


def test_explicit_diffusion_fields_win_over_fitting():
    p = parse({"prompt": "x", "max_tokens": 32, "block_length": 8, "steps": 8}).params
    assert (p.gen_length, p.block_length, p.steps) == (32, 8, 8)
    p = parse({"prompt": "x", "max_tokens": 32, "block_length": 8}).params
    assert (p.block_length, p.steps) == (8, 32)


def test_chat_messages_and_max_completion_tokens():
    r = parse({"messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
               "max_completion_tokens": 8}, chat=True)
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert r.params.gen_length == 8 and r.length_param == "max_completion_tokens"


@pytest.mark.parametrize("body, chat, param", [
    ({"prompt": "x", "max_tokens": "many"}, False, "max_tokens"),
    ({"prompt": "x", "temperature": True}, False, "temperature"),
    ({"prompt": "x", "n": 17}, False, "n"),
    ({"prompt": ["a"] * 9, "n": 2}, False, "n"),
    ({"prompt": "x", "echo": 1}, False, "echo"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, False, "echo"),
    ({"prompt": "x", "stop": [1]}, False, "stop"),
    ({"prompt": "x", "stop_token_ids": "2"}, False, "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, True, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, True, "top_logprobs"),
    ({"prompt": "x", "logprobs": "yes"}, False, "logprobs"),
    ({"prompt": ["a", 5]}, False, "prompt"),
    ({"prompt": []}, False, "prompt"),
    ({"prompt": "x", "diffusing": True}, False, "diffusing"),
    ({"messages": []}, True, "messages"),
])
def test_bad_fields_are_named(body, chat, param):
    with pytest.raises(InvalidRequest) as e:
        parse(body, chat)
    assert e.value.violations[0].field == param


def test_several_prompts_and_n_become_one_engine_request_per_choice():
    from celeris.server.http.openai_api import engine_requests

    r = parse({"prompt": ["a", [5, 6]], "n": 2, "seed": 10})
    reqs = engine_requests(r, "req")
    assert [q.request_id for q in reqs] == ["req-0", "req-1", "req-2", "req-3"]
    assert [q.params.seed for q in reqs] == [10, 11, 10, 11]
    assert (reqs[0].prompt, reqs[2].token_ids) == ("a", [5, 6])
    assert [q.request_id for q in engine_requests(parse({"prompt": "a"}), "one")] == ["one"]
    assert all(q.params.seed is None for q in engine_requests(parse({"prompt": "a", "n": 3}), ""))


def test_the_developer_role_is_the_system_role():
    r = parse({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}]},
              chat=True)
    assert [m["role"] for m in r.messages] == ["system", "user"]


def test_stop_and_logprobs_map_onto_the_engine():
    p = parse({"prompt": "x", "stop": "\n", "stop_token_ids": [7], "min_tokens": 2, "ignore_eos": True,
               "logprobs": 3}).params
    assert (p.stop, p.stop_token_ids, p.min_tokens, p.ignore_eos, p.logprobs) == (("\n",), (7,), 2, True, 3)
    assert parse({"prompt": "x", "stop": ["a", "b"], "logprobs": 0}).params.stop == ("a", "b")
    assert parse({"prompt": "x", "stop": None, "logprobs": None}).params == D
    chat = parse({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, chat=True)
    assert chat.params.logprobs == 2
    assert parse({"messages": [{"role": "user", "content": "x"}], "logprobs": False}, chat=True).params.logprobs is None


def test_roles_and_content_are_checked_once_by_the_engine(tiny_llm):
    """The gateway only maps; the engine's request builder validates roles, as for gRPC."""
    from celeris.server.http.openai_api import engine_requests

    req = parse({"messages": [{"role": "robot", "content": "x"}, {"role": "user",
                              "content": [{"type": "text", "text": 5}]}]}, chat=True)
    with pytest.raises(InvalidRequest) as e:
        tiny_llm.build(engine_requests(req, "")[0])
    assert [v.field for v in e.value.violations] == ["messages[0].role", "messages[1].content"]


def test_engine_field_names_become_openai_params():
    req = parse({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 8}, chat=True)
    renamed = rename_fields(InvalidRequest([FieldViolation("gen_length", "too long")]), req)
    assert renamed.violations[0].field == "max_completion_tokens"


def test_error_table():
    status, body, _ = error_response(InvalidRequest([FieldViolation("max_tokens", "too big")]))
    assert status == 400 and body["error"]["param"] == "max_tokens" and body["error"]["type"] == "invalid_request_error"
    status, body, headers = error_response(Overloaded("queue full", retry_after_s=2.5))
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert headers["Retry-After"] in ("3", "4") and 2500 <= int(headers["retry-after-ms"]) < 3750  # jittered up
    assert error_response(Unavailable("draining"))[0] == 503
    assert error_response(RuntimeError("bug"))[0] == 500


def test_one_error_table_serves_both_doors():
    import grpc

    from celeris.engine.errors import ModelLoadError, StepFailed
    from celeris.server.errors import Unauthenticated, UnsupportedMediaType, kind_of, to_openai, to_status

    cases = [(InvalidRequest([FieldViolation("x", "bad")]), grpc.StatusCode.INVALID_ARGUMENT, 400),
             (UnsupportedMediaType([FieldViolation("Content-Type", "bad")]), grpc.StatusCode.INVALID_ARGUMENT, 415),
             (Unauthenticated("no"), grpc.StatusCode.UNAUTHENTICATED, 401),
             (Overloaded("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
             (Unavailable("draining"), grpc.StatusCode.UNAVAILABLE, 503),
             (ModelLoadError("gone"), grpc.StatusCode.UNAVAILABLE, 503),
             (StepFailed("boom"), grpc.StatusCode.INTERNAL, 500),
             (RuntimeError("bug"), grpc.StatusCode.INTERNAL, 500)]
    for exc, code, http in cases:
        assert kind_of(exc).grpc == code and to_status(exc).code == code and to_openai(exc)[0] == http


@pytest.mark.parametrize("body, chat, param", [
    ({"prompt": "x", "frequency_penalty": [1]}, False, "frequency_penalty"),
    ({"prompt": "x", "presence_penalty": "high"}, False, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 1.2}, False, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"50256": -100}}, False, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, True,
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, True, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, True, "functions"),
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, False, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, True, "tool_choice"),
    ({"prompt": "x", "temprature": 0.5}, False, "temprature"),  # a typo is named, not ignored
    ({"prompt": "x", "guided_json": {}}, False, "guided_json"),
    ({"prompt": "x", "max_completion_tokens": 8}, False, "max_completion_tokens"),  # a chat field
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, True, "prompt"),
    ({"prompt": "x", "frequency_penalty": False}, False, "frequency_penalty"),
])
def test_unsupported_and_unknown_fields_are_refused_by_name(body, chat, param):
    with pytest.raises(InvalidRequest) as e:
        parse(body, chat)
    assert [v.field for v in e.value.violations] == [param]


def test_every_bad_field_is_named_at_once():
    with pytest.raises(InvalidRequest) as e:
        parse({"prompt": "x", "repetition_penalty": 1.1, "logit_bias": {"1": 2}, "bogus": 1})
    assert {v.field for v in e.value.violations} == {"repetition_penalty", "logit_bias", "bogus"}


def test_openai_penalties_reach_the_sampler():
    p = parse({"prompt": "x", "frequency_penalty": 0.5, "presence_penalty": -1}).params
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -1.0)


@pytest.mark.parametrize("extra", [
    {"repetition_penalty": 1.0},
    {"logit_bias": {}},
    {"logit_bias": None, "response_format": None, "stop": None, "n": None},
    {"response_format": {"type": "text"}},
    {"n": 1, "best_of": 1, "echo": False, "stop": [], "logprobs": False, "suffix": ""},
    {"user": "u-1", "stream_options": {"include_usage": True}, "metadata": {"k": "v"}},
    {"min_tokens": 4, "ignore_eos": True},
    {"top_k": -1, "top_p": 1.0},
])
def test_neutral_values_and_metadata_are_accepted(extra):
    assert parse({"prompt": "x", **extra}).params.gen_length == D.gen_length


def test_chat_accepts_its_neutral_tool_fields():
    msgs = [{"role": "user", "content": "x"}]
    r = parse({"messages": msgs, "tools": [], "tool_choice": "none", "parallel_tool_calls": False,
               "response_format": {"type": "text"}, "store": False}, chat=True)
    assert r.chat and r.messages == msgs
