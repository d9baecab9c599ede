"""The full-canvas runner's graph shapes (batch and length buckets, padding rows on the spare
slot, the prefix cache's fresh width rounded up) decode what the exact shapes decode, run
eagerly on the CPU: every mode a CUDA graph now captures (full, cfg, store, cached prefix/dual)."""

from __future__ import annotations

import pytest

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams

PROMPTS = ["It is a truth", "Emma Woodhouse, handsome", "12+34="]
KNOBS = [dict(), dict(threshold=0.5), dict(frequency_penalty=0.5), dict(min_tokens=16), dict(logprobs=2),
         dict(cfg_scale=1.0)]


def decode(folder, static: bool, cache: str, knobs: dict) -> list[list[int]]:
    llm = LLM.load(folder, EngineConfig(max_batch=8, max_prompt_tokens=64, max_gen_length=64, kv_cache=cache))
    llm.runner.static = static
    params = SamplingParams(gen_length=32, steps=16, block_length=8, seed=3, stop_at_eos=False, **knobs)
    return [r.token_ids for r in llm.generate(PROMPTS, params)]


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(k) or "plain")
def test_bucket_shapes_decode_what_exact_shapes_decode(tiny_model_dir, cache, knobs):
    assert decode(tiny_model_dir, True, cache, knobs) == decode(tiny_model_dir, False, cache, knobs)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_bucket_shapes_decode_what_exact_shapes_decode(tiny_model_dir, cache):
    assert decode(tiny_model_dir, True, cache, {}) == decode(tiny_model_dir, False, cache, {})
