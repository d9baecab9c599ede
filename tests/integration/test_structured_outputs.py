"""Structured outputs against a real server on port 0: the official `openai` SDK
(response_format json_schema / json_object, vLLM's structured_outputs) and gRPC through the
Python client (structured_output); unsupported schemas are refused naming their path."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from celeris_client import CelerisClient, InvalidArgument
from celeris.engine.llm import LLM
from tests.integration.live_server import live_server

SCHEMA = {"type": "object", "required": ["name", "n", "tags"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 1, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}}}


@pytest.fixture(scope="module")
def live():
    with live_server(LLM.load()) as s:
        yield s


def sdk(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_openai_sdk_json_schema_json_object_and_vllm_fields(live):
    c = sdk(live)
    rf = {"type": "json_schema", "json_schema": {"name": "thing", "strict": True, "schema": SCHEMA}}
    for seed in (0, 1):
        r = c.chat.completions.create(model="celeris-tiny", messages=[{"role": "user", "content": "A thing?"}],
                                      max_tokens=64, seed=seed, temperature=1.0, response_format=rf)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="celeris-tiny", prompt="Obj:", max_tokens=64, seed=2, stream=True,
        extra_body={"response_format": {"type": "json_object"}}))
    assert isinstance(json.loads(streamed), dict)
    choice = c.completions.create(model="celeris-tiny", prompt="Yes or no?", max_tokens=16, seed=3,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "not sure"]}})
    assert choice.choices[0].text in ("yes", "no", "not sure")
    rx = c.completions.create(model="celeris-tiny", prompt="Date:", max_tokens=16, seed=4,
                              extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", rx.choices[0].text)


def test_openai_sdk_refuses_unsupported_schema_by_path(live):
    bad = {"type": "object", "required": ["tags"], "properties": {  # `not`: honoured by neither path
        "tags": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {}, "not": {}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        sdk(live).chat.completions.create(
            model="celeris-tiny", messages=[{"role": "user", "content": "x"}], max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": bad}})
    assert "response_format.json_schema.schema.properties.tags.items" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        sdk(live).completions.create(model="celeris-tiny", prompt="x", max_tokens=64, extra_body={
            "structured_outputs": {"json": {"type": "object", "properties": {"a": {"anyOf": [
                {"type": "string"}, {"type": "array", "uniqueItems": True}]}}}}})
    assert e.value.status_code == 400 and "structured_outputs.json.properties.a.anyOf[1].uniqueItems" in str(e.value)


def test_grpc_client_structured_output_and_refusal(live):
    with CelerisClient(live.grpc_target) as c:
        r = c.generate("A thing:", gen_length=64, seed=5, temperature=1.0, structured_output={"json_schema": SCHEMA})
        jsonschema.validate(json.loads(r.text), SCHEMA)
        first = next(iter(c.stream("A thing:", gen_length=64, seed=5, structured_output={"json_schema": SCHEMA})))
        assert first.text.startswith('{"name":')  # the skeleton from the first message
        r = c.generate("Pick:", gen_length=16, seed=6, structured_output={"choice": ["red", "blue"]})
        assert r.text in ("red", "blue")
        with pytest.raises(InvalidArgument) as e:
            c.generate("x", gen_length=16, structured_output={"regex": "a+"})
        assert "structured_output.regex" in str(e.value) and "unbounded" in str(e.value)
        bad = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}  # neither path
        with pytest.raises(InvalidArgument) as e:
            c.generate("x", gen_length=32, structured_output={"json_schema": bad})
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.field_violations[0].field == "structured_output.json_schema.properties.n.not"


def test_a_revising_model_serves_structured_outputs_on_both_doors(tmp_path):
    """DiffusionGemma (tiny random checkpoint, byte-level BPE): the openai SDK's json_schema, plain
    streaming (final text only) and gRPC's structured_output all give valid outputs."""
    pytest.importorskip("transformers")
    from celeris.engine.config import EngineConfig
    from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint

    llm = LLM.load(write_bpe_checkpoint(tmp_path / "dg"), EngineConfig(max_batch=4, max_queue=8, max_prompt_tokens=64,
                                                                      max_gen_length=128))
    with live_server(llm) as s:
        c = sdk(s)
        model = c.models.list().data[0].id
        rf = {"type": "json_schema", "json_schema": {"name": "thing", "strict": True, "schema": SCHEMA}}
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "A thing?"}],
                                      max_tokens=96, seed=0, response_format=rf, extra_body={"max_denoising_steps": 3})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        chunks = [ch.choices[0].text for ch in c.completions.create(
            model=model, prompt="Obj:", max_tokens=96, seed=1, stream=True,
            extra_body={"response_format": rf, "max_denoising_steps": 3})]
        jsonschema.validate(json.loads("".join(chunks)), SCHEMA)
        with CelerisClient(s.grpc_target) as g:
            out = g.generate("Pick:", gen_length=16, seed=2, max_denoising_steps=3,
                             structured_output={"choice": ["red", "blue"]})
    assert out.text in ("red", "blue") and out.finish_reason == "stop"


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_without_max_tokens_the_canvas_is_sized_from_the_schema(live):
    """A skeleton longer than the default canvas (64): with max_tokens it is refused naming the
    canvas; without, on both doors, the canvas grows to what the schema needs and the output
    validates."""
    wide = {"type": "object", "required": [f"k{i}" for i in range(8)], "additionalProperties": False,
            "properties": {f"k{i}": {"type": "string", "maxLength": 8} for i in range(8)}}
    rf = {"type": "json_schema", "json_schema": {"name": "wide", "strict": True, "schema": wide}}
    ask = dict(model="celeris-tiny", messages=[{"role": "user", "content": "Fill it."}], seed=0, response_format=rf)
    with pytest.raises(openai.BadRequestError, match="canvas"):
        sdk(live).chat.completions.create(max_tokens=64, **ask)
    r = sdk(live).chat.completions.create(**ask)
    jsonschema.validate(json.loads(r.choices[0].message.content), wide)
    assert r.usage.completion_tokens > 64
    with CelerisClient(live.grpc_target) as c:
        out = c.generate("Fill it.", structured_output={"json_schema": wide}, seed=0)
    jsonschema.validate(json.loads(out.text), wide)
