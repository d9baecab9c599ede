"""Block-wise KV cache: exact when the cache is fresh, batch-invariant, and fewer FLOPs per step."""

from __future__ import annotations

import pytest
import torch

from engine.cache import KVCacheStore
from engine.config import EngineConfig
from engine.llm import LLM
from engine.params import SamplingParams
from tests.helpers import random_model, tiny_config


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_cached_forward_equals_full_forward_when_cache_is_fresh(mode):
    model = random_model(tiny_config(), seed=0)
    max_len, L = 32, 24
    lengths = torch.tensor([24, 17])
    ids = torch.randint(5, 300, (2, L))
    col = torch.arange(L)
    valid = col[None] >= (L - lengths)[:, None]
    positions = (max_len - L + col).expand(2, L)
    full, kvs = model(ids, key_mask=valid, positions=positions, return_kv=True)
    store = KVCacheStore(model.cfg, rows=3, max_len=max_len, device=torch.device("cpu"), dtype=torch.float32)
    rows = torch.tensor([2, 0])
    store.write(rows, kvs)
    start, blen = torch.tensor([16, 12]), 4
    if mode == "dual":
        fresh = start[:, None] + torch.arange(blen)
        cached_ok = valid & ~((col >= start[:, None]) & (col < (start + blen)[:, None]))
    else:
        fresh = (start[:, None] + torch.arange(L - 12)).clamp(max=L - 1)
        cached_ok = valid & (col < start[:, None])
    fresh_ok = (start[:, None] + torch.arange(fresh.shape[1])) < L
    out = model(torch.gather(ids, 1, fresh), key_mask=fresh_ok, positions=torch.gather(positions, 1, fresh),
                cache=store.read(rows, L, cached_ok))
    for r in range(2):
        n = int(fresh_ok[r].sum())
        torch.testing.assert_close(out[r, :n], full[r, fresh[r, :n]], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module", params=["dual", "prefix"])
def cached_llm(request, tiny_model_dir):
    cfg = EngineConfig(max_batch=8, max_prompt_tokens=64, max_gen_length=64, kv_cache=request.param)
    return LLM.load(tiny_model_dir, cfg)


def test_cache_first_step_matches_and_runs_to_completion(cached_llm, tiny_llm):
    params = SamplingParams(gen_length=32, steps=32, block_length=8, seed=0, stop_at_eos=False)
    ids = tiny_llm.encode_prompt("It is a truth universally")
    first = {}
    for name, llm in (("cache", cached_llm), ("plain", tiny_llm)):
        seq = llm.sequence(ids, params)
        llm.loop.add(seq)
        events, _ = llm.loop.step()
        first[name] = events[0].committed, events[0].canvas
        llm.loop.run_to_completion()
        assert seq.nfe == 32 and tiny_llm.tokenizer.mask_id not in seq.canvas
    assert first["cache"] == first["plain"]  # a block's first step is a full forward


def test_cache_is_batch_invariant(cached_llm):
    params = SamplingParams(gen_length=32, steps=16, block_length=8, seed=4, temperature=0.5, stop_at_eos=False)
    alone = cached_llm.generate(["It is a truth"], params)[0]
    mixed = cached_llm.generate(["Emma", "It is a truth", "12+34=", "must be"], params)[1]
    assert alone.token_ids == mixed.token_ids


def test_cache_with_threshold_decoding(cached_llm):
    params = SamplingParams(gen_length=32, steps=32, block_length=8, threshold=0.05, seed=0, stop_at_eos=False)
    res = cached_llm.generate(["It is a truth"], params)[0]
    assert 4 <= res.steps < 32  # at least one commit per step and block, far fewer than the schedule
