"""The whole graph path on the CPU: `GraphCache.capture` emulated eagerly (`graphs.eager_capture`:
a replay reruns fn over the static inputs and writes the static output in place), so the runners'
static inputs, harmless padding rows, copies in and reuse of the output are exercised without a
device, and must decode what the eager path decodes."""

from __future__ import annotations

import pytest

from celeris.engine.config import EngineConfig
from celeris.engine.models.graphs import GraphCache, eager_capture
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.unit.block_references.checkpoints import write_llada2_checkpoint, write_sdar_checkpoint


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(GraphCache, "capture", staticmethod(eager_capture))


def full_canvas(folder, graphs: bool, cache: str, knobs: dict) -> tuple[list[list[int]], int]:
    llm = LLM.load(folder, EngineConfig(max_batch=8, max_prompt_tokens=64, max_gen_length=64, kv_cache=cache))
    llm.runner.use_graphs = graphs
    p = SamplingParams(gen_length=32, steps=16, block_length=8, seed=3, stop_at_eos=False, **knobs)
    out = [r.token_ids for r in llm.generate(["It is a truth", "Emma Woodhouse, handsome", "12+34="], p)]
    return out, len(llm.runner._graphs)


@pytest.mark.parametrize("cache,knobs", [
    ("dual", {"threshold": 0.5}),
    *(pytest.param(c, k, marks=pytest.mark.slow)
      for c, k in [("none", {}), ("prefix", {}), ("dual", {"cfg_scale": 1.0}), ("none", {"logprobs": 2})])])
def test_full_canvas_graph_path_decodes_what_eager_decodes(emulated, tiny_model_dir, cache, knobs):
    graphed, captured = full_canvas(tiny_model_dir, True, cache, knobs)
    assert captured > 0
    assert graphed == full_canvas(tiny_model_dir, False, cache, knobs)[0]


@pytest.mark.slow
@pytest.mark.parametrize("write", [write_sdar_checkpoint, write_llada2_checkpoint])
def test_block_graph_path_decodes_what_eager_decodes(emulated, tmp_path, write):
    folder = write(tmp_path, seed=0)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [21, 22]]
    outs = {}
    for graphs in (False, True):
        llm = LLM.load(folder, EngineConfig(max_batch=4, max_prompt_tokens=32, max_gen_length=32, prefill_chunk=8))
        llm.runner.static, llm.runner.use_graphs = graphs, graphs
        seqs = [llm.sequence(p, SamplingParams(seed=i, gen_length=16, block_length=4, steps=8, stop_at_eos=False,
                                               threshold=0.3 if i == 1 else None))
                for i, p in enumerate(prompts)]
        for s in seqs:
            llm.loop.add(s)
        llm.loop.run_to_completion()
        outs[graphs] = [s.generated() for s in seqs]
        assert bool(llm.runner._graphs) == graphs
    assert outs[True] == outs[False]
