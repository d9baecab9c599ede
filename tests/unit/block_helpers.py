"""Block-model engines and a run-to-completion helper shared by the block-family tests."""

from __future__ import annotations

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams


# Lengths below, at and above a block, not multiples of it: prefill of 0, 1 and several blocks,
# first decode blocks that hold the prompt's tail.
PROMPTS = [[17, 301, 45], [88, 5, 640, 31, 77, 402, 15, 9], [12, 33, 999, 4, 58, 61, 700, 13, 90, 210, 6]]


def engine(folder, prefill_chunk: int = 256) -> LLM:
    return LLM.load(folder, EngineConfig(max_batch=8, max_prompt_tokens=64, max_gen_length=64,
                                         prefill_chunk=prefill_chunk))


def run_engine(llm: LLM, prompts, **params):
    seqs = [llm.sequence(p, SamplingParams(seed=0, **params)) for p in prompts]
    for s in seqs:
        llm.loop.add(s)
    llm.loop.run_to_completion()
    return seqs
