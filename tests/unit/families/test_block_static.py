"""The block runner's static-shape path (what a CUDA graph captures: batch buckets, one masked
attention kernel per layer over the cache read in place, every MoE expert at a static shape)
decodes the very tokens of the per-row path, run eagerly on the CPU (float32)."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.models.attention import Spans
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.unit.block_references.checkpoints import write_llada2_checkpoint, write_sdar_checkpoint

PROMPTS = [[17, 301, 45], [88, 5, 640, 31, 77, 402, 15, 9], [12, 33, 999, 4, 58, 61, 700, 13, 90, 210, 6]]
KNOBS = [dict(), dict(threshold=0.3), dict(frequency_penalty=0.5, presence_penalty=0.3), dict(min_tokens=12),
         dict(logprobs=2), dict(temperature=0.8, top_k=5)]


@pytest.fixture(scope="module", params=["sdar", "llada2"])
def folder(request, tmp_path_factory):
    write = write_sdar_checkpoint if request.param == "sdar" else write_llada2_checkpoint
    return write(tmp_path_factory.mktemp(request.param), seed=0)


def decode(folder, static: bool, prompts, knobs_per_row) -> list[tuple]:
    llm = LLM.load(folder, EngineConfig(max_batch=8, max_prompt_tokens=64, max_gen_length=64, prefill_chunk=8))
    llm.runner.static = static
    seqs = [llm.sequence(p, SamplingParams(seed=i, gen_length=16, block_length=4, steps=8, stop_at_eos=False, **k))
            for i, (p, k) in enumerate(zip(prompts, knobs_per_row))]
    for s in seqs:
        llm.loop.add(s)
    llm.loop.run_to_completion()
    # Decode steps, not forwards: chunked prefill splits a prompt by what else runs, so a row's
    # prefill forwards depend on its batch; its tokens and decode steps must not.
    return [(s.generated(), s.noise_step) for s in seqs]


@pytest.mark.slow
def test_static_path_decodes_what_the_per_row_path_decodes_in_a_mixed_batch(folder):
    prompts = (PROMPTS * 2)[:len(KNOBS)]
    assert decode(folder, True, prompts, KNOBS) == decode(folder, False, prompts, KNOBS)


@pytest.mark.slow
def test_static_path_is_batch_invariant_in_tokens(folder):
    alone = decode(folder, True, PROMPTS[1:2], [{}])
    together = decode(folder, True, PROMPTS, [{}] * 3)
    assert together[1] == alone[0]


def test_span_mask_is_the_per_row_spans():
    spans = Spans(torch.tensor([3, 8, 0]), torch.tensor([7, 8, 1]))
    mask = spans.mask(8, 10)
    for b, s in enumerate(spans.rows()):
        row = mask[b, 0]
        assert not row[:, s.k1:].any()
        expect = torch.ones(s.q1, s.k1, dtype=torch.bool) if s.allowed is None else s.allowed
        assert torch.equal(row[:s.q1, :s.k1], expect)
        assert row[s.q1:, :s.k1].all()  # padded queries see every real key: no empty softmax row


def test_every_expert_agrees_with_the_chosen_experts(tmp_path):
    # Equal up to rounding: an expert's GEMM over all tokens or over those that chose it (the
    # loop's row count already depends on the batch) may sum in another order.
    llm = LLM.load(write_llada2_checkpoint(tmp_path, seed=0), EngineConfig(max_batch=2))
    moe = next(m for m in llm.model.modules() if m.__class__.__name__ == "MoE")
    x = torch.randn(2, 9, llm.model.cfg.d_model)
    moe.static = False
    loop = moe(x)
    moe.static = True
    torch.testing.assert_close(moe(x), loop, rtol=1e-5, atol=1e-5)


def test_block_cache_writes_in_place_and_reads_views_of_the_store():
    from celeris.engine.models.cache import BlockCache, BlockKVStore
    from celeris.engine.config import ModelConfig
    cfg = ModelConfig(arch="sdar", d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, mlp_hidden_size=64,
                      vocab_size=64, embedding_size=64, mask_token_id=3, eos_token_id=2, block_length=4)
    store = BlockKVStore(cfg, rows=3, max_len=16, device=torch.device("cpu"), dtype=torch.float32, scratch=4)
    slots, cols = torch.tensor([2, 0]), torch.tensor([[4, 5, 6, 7], [8, 9, 16, 17]])  # row 1: two padded -> scratch
    k, v = torch.randn(2, 2, 4, cfg.head_dim), torch.randn(2, 2, 4, cfg.head_dim)
    keys, values = BlockCache(store, slots, cols, 16, rows=[(2, 8), (0, 10)]).attach(0, k, v)
    assert torch.equal(store.keys[0][2, :, 4:8], k[0]) and torch.equal(store.values[0][0, :, 8:10], v[1, :, :2])
    assert torch.equal(store.keys[0][0, :, 16:18], k[1, :, 2:])  # padded positions: scratch columns
    assert keys[0].shape == (1, 2, 8, cfg.head_dim) and keys[1].shape == (1, 2, 10, cfg.head_dim)
    assert keys[0].untyped_storage().data_ptr() == store.keys[0].untyped_storage().data_ptr()  # a view, no copy
    batched, _ = BlockCache(store, slots, cols, 12).attach(0, k, v)  # the static path: (B, Hk, length, Dh)
    assert batched.shape == (2, 2, 12, cfg.head_dim) and torch.equal(batched[0], store.keys[0][2, :, :12])
