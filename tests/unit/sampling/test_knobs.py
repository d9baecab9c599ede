"""The knob table (engine/sampling/knobs.py) against SamplingParams, the proto, and every surface.

Each test fails when a knob is added, renamed or retyped in one place and not the others: the
table is derived from SamplingParams; the HTTP parser, CLI flags and gRPC converter read it; the
proto, the client's keywords, the web page's controls and docs/sampling.md are checked here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD

from celeris.v1 import generation_pb2 as pb
from celeris_client import types as client_types
from celeris.engine.sampling.knobs import BOOL, CHOICE, FLOAT, IDS, INT, KNOBS, STRINGS, markdown, on
from celeris.engine.sampling.params import SamplingParams
from celeris.server.cli.args import add_sampling_args, sampling_from_args
from celeris.server.grpc.convert import sampling_params
from celeris.server.http.openai_api import parse_request

ROOT = Path(__file__).resolve().parents[3]
# One non-default value per knob, exactly representable in float32 (the proto's floats).
SAMPLES = {"gen_length": 16, "steps": 32, "block_length": 16, "temperature": 0.5, "remasking": "margin",
           "threshold": 0.75, "factor": 1.5, "editing_threshold": 0.5, "max_post_steps": 4,
           "factor_rule": "paper", "schedule": "dream", "eps": 0.0625,
           "kv_cache": "dual", "top_k": 5, "top_p": 0.5, "min_p": 0.25, "stop": ("x",), "stop_token_ids": (3,),
           "ignore_eos": True, "min_tokens": 2, "frequency_penalty": 0.5, "presence_penalty": 0.25, "logprobs": 2,
           "provisional": True, "cfg_scale": 1.5, "seed": 7, "stop_at_eos": False, "max_denoising_steps": 8,
           "entropy_bound": 0.25, "t_min": 0.25, "t_max": 0.5, "stability_threshold": 2, "confidence_threshold": 0.125,
           "decoding": "linear_spec"}
# GenerateRequest fields that are not sampling knobs.
NOT_KNOBS = {"request_id", "prompt", "token_ids", "chat", "stream_options", "n", "structured_output", "cache_salt",
             "tools", "tool_choice", "parallel_tool_calls"}
PROTO_KINDS = {INT: (FD.TYPE_UINT32, FD.TYPE_UINT64), FLOAT: (FD.TYPE_FLOAT,), BOOL: (FD.TYPE_BOOL,),
               CHOICE: (FD.TYPE_ENUM,), STRINGS: (FD.TYPE_STRING,), IDS: (FD.TYPE_UINT32,)}


def test_the_table_is_sampling_params():
    fields = dataclasses.fields(SamplingParams)
    assert [k.name for k in KNOBS] == [f.name for f in fields]
    assert [k.default for k in KNOBS] == [f.default for f in fields]
    assert set(SAMPLES) == {k.name for k in KNOBS}, "give a new knob a sample value here"
    for k in KNOBS:
        assert isinstance(SAMPLES[k.name], k.python_type) and SAMPLES[k.name] != k.default, k.name
        assert k.help and (k.kind != CHOICE or SAMPLES[k.name] in k.choices), k.name


def test_the_proto_carries_each_knob_with_its_type():
    fields = {f.name: f for f in pb.GenerateRequest.DESCRIPTOR.fields}
    assert set(fields) == {k.proto for k in on("proto")} | NOT_KNOBS
    for k in on("proto"):
        f = fields[k.proto]
        assert f.type in PROTO_KINDS[k.kind], k.name
        repeated = k.kind in (STRINGS, IDS)
        assert f.is_repeated == repeated, k.name
        if k.kind in (INT, FLOAT, BOOL):  # zero is meaningful: presence tells "unset" apart
            assert f.has_presence, f"{k.proto} must be optional"
        if k.kind == CHOICE:
            prefix = f.enum_type.values[0].name.removesuffix("UNSPECIFIED")
            names = {v.name.removeprefix(prefix).lower() for v in f.enum_type.values}
            assert set(k.choices) <= names, k.name


def test_grpc_reads_every_proto_knob():
    for k in on("proto"):
        value = SAMPLES[k.name]
        if k.kind == CHOICE:  # REMASKING_MARGIN for "margin"
            enum = pb.GenerateRequest.DESCRIPTOR.fields_by_name[k.proto].enum_type
            value = enum.values_by_name[enum.values[0].name.removesuffix("UNSPECIFIED") + value.upper()].number
        req = pb.GenerateRequest(prompt="x", **{k.proto: value})
        assert getattr(sampling_params(req, SamplingParams()), k.name) == SAMPLES[k.name], k.name


def test_http_reads_every_http_knob():
    for k in on("http"):
        body = {"prompt": "x", k.http: list(SAMPLES[k.name]) if k.kind in (STRINGS, IDS) else SAMPLES[k.name]}
        if k.name == "provisional":
            body |= {"stream": True, "diffusing": True}
        params = parse_request(body, SamplingParams(), chat=False).params
        assert getattr(params, k.name) == SAMPLES[k.name], k.name


def test_the_cli_has_a_flag_for_every_cli_knob():
    ap = argparse.ArgumentParser()
    add_sampling_args(ap)
    for k in on("cli"):
        value = SAMPLES[k.name]
        if k.kind == BOOL:
            argv = [k.cli]
        elif k.kind == IDS:
            argv = [k.cli, ",".join(map(str, value))]
        elif k.kind == STRINGS:
            argv = [x for v in value for x in (k.cli, v)]
        else:
            argv = [k.cli, str(value)]
        a = ap.parse_args(argv)
        given = {name: getattr(a, name) for name in vars(a) if getattr(a, name) is not None}
        assert set(given) == {k.name}, k.name
        if k.name in ("gen_length", "steps", "block_length", "schedule"):
            continue  # valid only with others; the parse above is what this test is about
        assert getattr(sampling_from_args(a), k.name) == value, k.name


def test_the_client_takes_every_proto_knob_by_name():
    assert set(client_types.KNOBS) == {k.proto for k in on("proto")} | {"n"}


def test_the_page_controls_are_http_knobs():
    html = (ROOT / "clients" / "web" / "index.html").read_text()
    controls = set(re.findall(r'<(?:input|select)[^>]*\bid="([a-z_]+)"', html)) - {"prompt", "token", "structured"}  # not knobs: input, auth
    assert controls and controls <= {k.http for k in on("http")}, controls - {k.http for k in on("http")}


@pytest.mark.parametrize("doc", ["docs/sampling.md"])
def test_the_knob_doc_is_generated_from_the_table(doc):
    assert (ROOT / doc).read_text() == markdown(), "regenerate: python -m celeris.engine.sampling.knobs > docs/sampling.md"
