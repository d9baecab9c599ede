"""The whole-document path over HTTP with the official openai SDK (issue 42): a `$ref` schema in
`response_format` json_schema is served valid, and the response names the path it decoded on
(`x-celeris-structure-path`), as does the Prometheus counter by path."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from prometheus_client import generate_latest

from celeris.engine.llm import LLM
from tests.integration.live_server import live_server

REF = {"type": "object", "required": ["owner", "pets"], "additionalProperties": False,
       "$defs": {"pet": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
           "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 30}}}},
       "properties": {"owner": {"$ref": "#/$defs/pet"}, "pets": {"type": "array", "maxItems": 2,
                                                                 "items": {"$ref": "#/$defs/pet"}}}}
FLAT = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def live():
    with live_server(LLM.load()) as s:
        yield s


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_ref_schema_is_served_valid_on_the_document_path(live):
    c = openai.OpenAI(base_url=live.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    seen = []
    for schema, path in ((REF, "document"), (FLAT, "skeleton")):
        rf = {"type": "json_schema", "json_schema": {"name": "t", "strict": True, "schema": schema}}
        raw = c.chat.completions.with_raw_response.create(
            model="celeris-tiny", messages=[{"role": "user", "content": "Pets?"}], max_tokens=96, seed=3,
            temperature=1.0, response_format=rf)
        assert raw.headers["x-celeris-structure-path"] == path
        r = raw.parse()
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        seen.append(path)
    free = c.completions.with_raw_response.create(model="celeris-tiny", prompt="x", max_tokens=4)
    assert "x-celeris-structure-path" not in free.headers
    metrics = generate_latest(live.server.telemetry.metrics.registry).decode()
    for path in seen:
        assert f'celeris_structured_requests_total{{path="{path}"}} 1.0' in metrics


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_grpc_names_the_path_in_its_initial_metadata(live):
    import grpc

    from celeris.v1 import generation_pb2 as pb
    from celeris.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(live.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        req = pb.GenerateRequest(prompt="Pets:", gen_length=96, seed=4,
                                 structured_output=pb.StructuredOutput(json_schema=json.dumps(REF)))
        call = stub.Generate(req, timeout=300)
        assert dict(call.initial_metadata())["x-celeris-structure-path"] == "document"
        for _ in call:
            pass
