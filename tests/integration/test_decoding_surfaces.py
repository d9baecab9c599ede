"""The decoders of the engine-exactness work reach every surface: gRPC, HTTP, the Python client
and the `celeris` command take kv_cache / factor_rule / schedule / eps / top_k / top_p, report the
cache a request decoded over, and fit steps and block length to a length given alone."""

from __future__ import annotations

import json
import urllib.request

import pytest

from celeris.v1 import generation_pb2 as pb
from celeris_client import CelerisClient, InvalidArgument
from celeris.engine.sampling.params import SamplingParams
from tests.integration.conftest import collect, running_server
from tests.integration.live_server import live_server

PROMPT = "It is a truth universally"


@pytest.mark.parametrize("cache,pb_cache", [("prefix", pb.KV_CACHE_PREFIX), ("dual", pb.KV_CACHE_DUAL)])
async def test_grpc_kv_cache_per_request_decodes_like_the_engine_and_is_reported(tiny_llm, cache, pb_cache):
    params = SamplingParams(gen_length=16, steps=16, block_length=8, threshold=0.3, seed=2, kv_cache=cache)
    expected = tiny_llm.generate_one(PROMPT, params)
    req = pb.GenerateRequest(prompt=PROMPT, gen_length=16, steps=16, block_length=8, threshold=0.3, seed=2,
                             kv_cache=pb_cache)
    async with running_server(tiny_llm) as (_, stub, _):
        msgs = await collect(stub.Generate(req))
        plain = await collect(stub.Generate(pb.GenerateRequest(prompt=PROMPT, gen_length=16, seed=2)))
    assert msgs[-1].kv_cache == pb_cache and msgs[-1].usage.forward_passes == expected.steps
    assert msgs[-1].text == expected.text
    assert all(m.kv_cache == pb.KV_CACHE_UNSPECIFIED for m in msgs[:-1])  # last message only
    assert plain[-1].kv_cache == pb.KV_CACHE_NONE  # the server default


async def test_grpc_gen_length_alone_fits_steps_and_block(tiny_llm):
    async with running_server(tiny_llm) as (_, stub, _):
        for g in (16, 4, 7):
            msgs = await collect(stub.Generate(pb.GenerateRequest(prompt=PROMPT, gen_length=g, seed=0)))
            assert msgs[-1].done and len(msgs[-1].tokens) == g


async def test_grpc_new_knobs_are_validated_by_the_engine(tiny_llm):
    import grpc

    async with running_server(tiny_llm) as (_, stub, _):
        for req, field in ((pb.GenerateRequest(prompt=PROMPT, top_p=1.5), "top_p"),
                           (pb.GenerateRequest(prompt=PROMPT, eps=0.0, schedule=pb.SCHEDULE_DREAM), "eps"),
                           (pb.GenerateRequest(prompt=PROMPT, kv_cache=pb.KV_CACHE_EXACT), "kv_cache"),
                           (pb.GenerateRequest(prompt=PROMPT, factor_rule=99), "factor_rule")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_http_and_the_python_client_take_the_knobs_and_report_the_cache(tiny_llm):
    params = SamplingParams(gen_length=16, steps=16, block_length=16, factor=1.0, factor_rule="paper", seed=4,
                            kv_cache="dual")
    expected = tiny_llm.generate_one(PROMPT, params)
    with live_server(tiny_llm) as live:
        body = {"model": tiny_llm.name, "prompt": PROMPT, "max_tokens": 16, "block_length": 16, "steps": 16,
                "factor": 1.0, "factor_rule": "paper", "seed": 4, "kv_cache": "dual"}
        req = urllib.request.Request(live.http_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            out = json.loads(resp.read())
        assert out["choices"][0]["text"] == expected.text and out["celeris"]["kv_cache"] == "dual"
        with CelerisClient(live.grpc_target) as c:
            res = c.generate(PROMPT, gen_length=16, steps=16, block_length=16, factor=1.0, factor_rule="paper",
                             seed=4, kv_cache="dual")
            assert res.text == expected.text and res.kv_cache == "dual"
            assert c.model_info().defaults.gen_length == tiny_llm.defaults.gen_length


async def test_grpc_stop_options_reach_the_engine():
    from celeris.engine.llm import LLM

    llm = LLM.load()  # the embedded model ends its answers with EOS
    base = dict(prompt="37+45=", gen_length=8, steps=8, block_length=8, seed=0)
    async with running_server(llm) as (_, stub, _):
        plain = (await collect(stub.Generate(pb.GenerateRequest(**base))))[-1]
        ignored = (await collect(stub.Generate(pb.GenerateRequest(**base, ignore_eos=True))))[-1]
        stop_id = ignored.tokens[1].id
        cut = (await collect(stub.Generate(pb.GenerateRequest(**base, ignore_eos=True, stop_token_ids=[stop_id]))))[-1]
        late = (await collect(stub.Generate(pb.GenerateRequest(**base, min_tokens=4))))[-1]
    assert plain.finish_reason == pb.FINISH_REASON_STOP and ignored.finish_reason == pb.FINISH_REASON_LENGTH
    assert ignored.usage.generated_tokens == 8
    assert cut.finish_reason == pb.FINISH_REASON_STOP and cut.usage.generated_tokens == 1
    assert late.usage.generated_tokens >= 4


async def test_grpc_logprobs_on_the_last_message(tiny_llm):
    expected = tiny_llm.generate_one(PROMPT, SamplingParams(gen_length=16, steps=8, block_length=8, seed=1,
                                                            logprobs=2))
    req = pb.GenerateRequest(prompt=PROMPT, gen_length=16, steps=8, block_length=8, seed=1, logprobs=2)
    async with running_server(tiny_llm) as (_, stub, _):
        msgs = await collect(stub.Generate(req))
    last = msgs[-1]
    n = last.usage.generated_tokens
    assert n == len(expected.token_ids)
    assert [round(t.logprob, 4) for t in last.tokens[:n]] == [round(lp, 4) for lp, _ in expected.logprobs]
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               for t in last.tokens[:n])
    assert not any(t.HasField("logprob") for m in msgs[:-1] for t in m.tokens)


async def test_grpc_stop_strings_cut_the_final_text():
    from celeris.engine.llm import LLM

    llm = LLM.load()
    base = dict(prompt="She was", gen_length=32, steps=32, block_length=8, seed=0)  # a full canvas of text
    async with running_server(llm) as (_, stub, _):
        full = (await collect(stub.Generate(pb.GenerateRequest(**base))))[-1]
        assert len(full.text) >= 24, full.text  # the test needs text past the stop
        stop = full.text[14:18]
        cut = (await collect(stub.Generate(pb.GenerateRequest(**base, stop=[stop]))))[-1]
    assert cut.text == full.text[:full.text.find(stop)] and cut.finish_reason == pb.FINISH_REASON_STOP
    assert cut.usage.forward_passes < full.usage.forward_passes


def test_grpc_n_samples_each_equal_the_single_seeded_request(tiny_llm):
    with live_server(tiny_llm) as live, CelerisClient(live.grpc_target) as c:
        samples = c.sample(PROMPT, 3, gen_length=16, steps=8, block_length=8, temperature=1.0, seed=40)
        assert [r.seed for r in samples] == [40, 41, 42]
        for r in samples:
            assert r.text == c.generate(PROMPT, gen_length=16, steps=8, block_length=8, temperature=1.0,
                                        seed=r.seed).text
        snaps = list(c.stream(PROMPT, gen_length=16, steps=8, block_length=8, n=2, seed=1))
        assert sorted(s.choice for s in snaps if s.done) == [0, 1]
        with pytest.raises(Exception, match="n"):
            c.generate(PROMPT, n=17)


def test_celeris_generate_n_prints_each_sample(tiny_llm):
    import subprocess
    import sys

    with live_server(tiny_llm) as live:
        out = subprocess.run([sys.executable, "-m", "celeris.server.cli", "generate", "--server", live.grpc_target, PROMPT,
                              "--gen-length", "8", "--steps", "8", "--block-length", "8", "--temperature", "1",
                              "--seed", "3", "--n", "3"], capture_output=True, text=True, timeout=120, check=True)
        with CelerisClient(live.grpc_target) as c:
            expected = [r.text for r in c.sample(PROMPT, 3, gen_length=8, steps=8, block_length=8, temperature=1.0,
                                                 seed=3)]
    assert out.stdout.splitlines() == expected


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_penalties_reach_the_engine_on_every_surface():
    """frequency / presence penalty over gRPC, HTTP and the Python client decode as the engine
    does; out of range is refused by name."""
    from celeris.engine.llm import LLM

    llm = LLM.load()  # celeris-tiny: its greedy prose loops without a penalty
    prompt = "Edward had been staying several weeks in the"
    knobs = dict(gen_length=32, steps=32, block_length=8, seed=0)
    expected = llm.generate_one(prompt, SamplingParams(**knobs, frequency_penalty=0.7, presence_penalty=0.2))
    neutral = llm.generate_one(prompt, SamplingParams(**knobs, frequency_penalty=0.0, presence_penalty=0.0))
    assert expected.text != neutral.text
    with live_server(llm) as live, CelerisClient(live.grpc_target) as c:
        assert c.generate(prompt, **knobs, frequency_penalty=0.7, presence_penalty=0.2).text == expected.text
        assert c.generate(prompt, **knobs, frequency_penalty=0.0, presence_penalty=0.0).text == neutral.text
        shown = c.model_info().defaults  # what an unset knob gets: the model's generation_config
        assert (shown.frequency_penalty, shown.presence_penalty) == pytest.approx(
            (llm.defaults.frequency_penalty, llm.defaults.presence_penalty))
        body = {"model": llm.name, "prompt": prompt, "max_tokens": 32, "steps": 32, "block_length": 8, "seed": 0,
                "frequency_penalty": 0.7, "presence_penalty": 0.2}
        req = urllib.request.Request(live.http_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["choices"][0]["text"] == expected.text
        with pytest.raises(InvalidArgument) as e:
            c.generate(prompt, presence_penalty=-2.5)
        assert [v.field for v in e.value.field_violations] == ["presence_penalty"]
