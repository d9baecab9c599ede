"""Block-diffusion models on CUDA decode what they decode on the CPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.unit.block_references.checkpoints import write_llada2_checkpoint, write_sdar_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("write", [write_sdar_checkpoint, write_llada2_checkpoint])
def test_cuda_block_decoding_matches_cpu(tmp_path, write):
    folder = write(tmp_path, seed=0)
    params = SamplingParams(gen_length=16, block_length=4, steps=16, threshold=0.3, seed=0)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM.load(folder, EngineConfig(device=device, max_batch=4, max_prompt_tokens=32, max_gen_length=32))
        outs[device] = [r.token_ids for r in llm.generate(prompts, params)]
    assert outs["cuda"] == outs["cpu"]
