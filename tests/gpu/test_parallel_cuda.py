"""Tensor and expert parallelism on CUDA (NCCL): size 2 decodes what one GPU decodes (skipped
without two GPUs; the CPU tests in tests/unit/models/test_parallel.py carry the same checks on gloo)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from tests.unit.block_references.checkpoints import write_llada2_checkpoint
from tests.unit.references.checkpoints import write_llada_checkpoint

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
PROMPTS = [[17, 301, 45], [88, 5, 640, 31, 77, 402, 15, 9]]


def decode(folder, tp: int, ep: bool = False) -> list[list[int]]:
    llm = LLM.load(folder, EngineConfig(device="cuda", max_batch=4, max_prompt_tokens=32, max_gen_length=16,
                                        tensor_parallel_size=tp, expert_parallel=ep))
    try:
        p = replace(llm.defaults, gen_length=16, block_length=8, steps=8)
        return [r.token_ids for r in llm.generate(PROMPTS, p)]
    finally:
        llm.close()


@pytest.mark.parametrize("write,ep", [(write_llada_checkpoint, False), (write_llada2_checkpoint, False),
                                      (write_llada2_checkpoint, True)])
def test_cuda_tp2_decodes_what_one_gpu_decodes(tmp_path, write, ep):
    folder = write(tmp_path)
    assert decode(folder, 2, ep) == decode(folder, 1)
