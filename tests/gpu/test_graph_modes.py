"""Graph replay commits exactly what eager commits, token for token, in every mode a graph now
captures: full-canvas cache none/prefix/dual with every sampling knob, CFG, mixed batches, and
the SDAR / LLaDA2 block denoise step (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.unit.block_references.checkpoints import write_llada2_checkpoint, write_sdar_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KNOBS = [dict(), dict(threshold=0.5), dict(frequency_penalty=0.5, presence_penalty=0.3), dict(min_tokens=16),
         dict(logprobs=2), dict(cfg_scale=1.0), dict(temperature=0.8, top_k=3, top_p=0.9)]
TEXTS = ["It is a truth", "Emma Woodhouse", "12+34=", "must be in want of a wife"]


def mixed(llm: LLM, prompts, knobs, **shared) -> list[list[int]]:
    """One batch whose rows each carry their own knobs."""
    seqs = [llm.sequence(p, SamplingParams(seed=i, stop_at_eos=False, **shared, **k))
            for i, (p, k) in enumerate(zip(prompts, knobs))]
    for s in seqs:
        llm.loop.add(s)
    llm.loop.run_to_completion()
    return [s.generated() for s in seqs]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(k) or "plain")
def test_full_canvas_graphs_match_eager(tiny_model_dir, cache, knobs):
    outs = {}
    for graphs in (False, True):
        llm = LLM.load(tiny_model_dir, EngineConfig(device="cuda", max_batch=8, max_prompt_tokens=64,
                                                    max_gen_length=64, cuda_graphs=graphs, kv_cache=cache))
        params = SamplingParams(gen_length=32, steps=16, block_length=8, seed=3, stop_at_eos=False, **knobs)
        outs[graphs] = [r.token_ids for r in llm.generate(TEXTS, params)]
        assert bool(llm.runner._graphs) == graphs
        if graphs and cache != "none" and "cfg_scale" not in knobs:  # the cached steps replay too
            assert any(mode.startswith("cached") for mode, _ in llm.runner._graphs.graphs)
    assert outs[True] == outs[False]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_mixed_batch_graphs_match_eager(tiny_model_dir, cache):
    outs = {}
    for graphs in (False, True):
        llm = LLM.load(tiny_model_dir, EngineConfig(device="cuda", max_batch=8, max_prompt_tokens=64,
                                                    max_gen_length=64, cuda_graphs=graphs, kv_cache=cache))
        prompts = [llm.tokenizer.encode(t) for t in TEXTS + TEXTS[:3]]
        outs[graphs] = mixed(llm, prompts, KNOBS, gen_length=32, steps=16, block_length=8)
    assert outs[True] == outs[False]


@pytest.mark.parametrize("write", [write_sdar_checkpoint, write_llada2_checkpoint])
def test_block_graphs_match_eager_and_the_cpu(tmp_path, write):
    folder = write(tmp_path, seed=0)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [21, 22], [30] * 13]
    knobs = [dict(), dict(threshold=0.3), dict(frequency_penalty=0.5), dict(logprobs=2)]
    outs = {}
    for device, graphs in (("cpu", False), ("cuda", False), ("cuda", True)):
        llm = LLM.load(folder, EngineConfig(device=device, max_batch=4, max_prompt_tokens=32, max_gen_length=32,
                                            cuda_graphs=graphs, prefill_chunk=8))
        outs[device, graphs] = mixed(llm, prompts, knobs, gen_length=16, block_length=4, steps=8)
        assert bool(llm.runner._graphs) == graphs
    assert outs["cuda", True] == outs["cuda", False] == outs["cpu", False]
