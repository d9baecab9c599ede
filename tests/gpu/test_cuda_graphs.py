"""CUDA-graph replay must commit exactly what the eager step commits (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# Only the forward is captured: every sampling knob runs after the replay, on the graph path.
@pytest.mark.parametrize("extra", [{}, {"temperature": 0.8}, {"threshold": 0.5}, {"remasking": "random"},
                                   {"frequency_penalty": 0.5, "presence_penalty": 0.3}, {"min_tokens": 16},
                                   {"logprobs": 2}, {"top_k": 3, "top_p": 0.9, "temperature": 0.7},
                                   {"factor": 1.0}])
def test_graph_replay_matches_eager(tiny_model_dir, extra):
    outs = {}
    for graphs in (False, True):
        llm = LLM.load(tiny_model_dir, EngineConfig(device="cuda", max_batch=8, max_prompt_tokens=64,
                                                    max_gen_length=64, cuda_graphs=graphs))
        params = SamplingParams(gen_length=32, steps=16, block_length=8, seed=3, stop_at_eos=False, **extra)
        res = llm.generate(["It is a truth", "Emma Woodhouse", "12+34=", "must be in want of a wife"], params)
        outs[graphs] = [r.token_ids for r in res]
        assert bool(llm.runner._graphs) == graphs
    assert outs[True] == outs[False]


def test_graph_buckets_are_reused(tiny_model_dir):
    llm = LLM.load(tiny_model_dir, EngineConfig(device="cuda", max_batch=8, max_prompt_tokens=64, max_gen_length=64))
    params = SamplingParams(gen_length=16, steps=16, block_length=8, seed=0)
    llm.generate(["It is a truth"] * 3, params)
    captured = len(llm.runner._graphs)
    llm.generate(["Emma"] * 3, params)
    assert len(llm.runner._graphs) == captured  # same (batch, length, window) buckets: replay only
