"""Block-wise KV cache: exact when the cache is fresh, batch-invariant, and fewer FLOPs per step."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.models.cache import KVCacheStore
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.helpers import random_model, tiny_config


@pytest.mark.parametrize("mode", ["dual", "prefix"])
def test_cached_forward_equals_full_forward_when_cache_is_fresh(mode):
    model = random_model(tiny_config(), seed=0)
    max_len, L = 32, 24
    lengths = torch.tensor([24, 17])
    ids = torch.randint(5, 300, (2, L))
    col = torch.arange(L)
    valid = col[None] >= (L - lengths)[:, None]
    positions = (col[None] - (L - lengths)[:, None]).clamp_min(0)
    full, kvs = model(ids, key_mask=valid, positions=positions, return_kv=True)
    store = KVCacheStore(model.cfg, rows=3, max_len=max_len, device=torch.device("cpu"), dtype=torch.float32)
    rows = torch.tensor([2, 0])
    store.write(rows, kvs)
    start, blen = torch.tensor([16, 12]), 4
    if mode == "dual":
        fresh = start[:, None] + torch.arange(blen)
    else:
        fresh = (start[:, None] + torch.arange(L - 12)).clamp(max=L - 1)
    out = model(torch.gather(ids, 1, fresh), positions=torch.gather(positions, 1, fresh),
                cache=store.read(rows, L, valid, fresh))
    for r in range(2):
        n = int((start[r] + torch.arange(fresh.shape[1]) < L).sum())
        torch.testing.assert_close(out[r, :n], full[r, fresh[r, :n]], atol=1e-4, rtol=1e-4)


def test_cached_forward_sees_the_fresh_block_not_the_stale_one():
    """After the block changes, a dual-cache forward of the block uses the new block keys.

    With one layer the keys of unchanged columns depend only on their own ids, so the dual
    cache is exact there and the cached block must equal a full forward of the new canvas."""
    model = random_model(tiny_config(n_layers=1), seed=1)
    L = 12
    ids = torch.randint(5, 300, (1, L))
    _, kvs = model(ids, return_kv=True)
    store = KVCacheStore(model.cfg, rows=1, max_len=L, device=torch.device("cpu"), dtype=torch.float32)
    store.write(torch.tensor([0]), kvs)
    changed = ids.clone()
    changed[0, 4:8] = torch.randint(5, 300, (4,))
    fresh = torch.arange(4, 8)[None]
    out = model(changed[:, 4:8], positions=fresh, cache=store.read(torch.tensor([0]), L, None, fresh))
    exact_dual = model(changed)[:, 4:8]
    torch.testing.assert_close(out, exact_dual, atol=1e-4, rtol=1e-4)


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


def test_cache_allocated_on_first_use_serves_offline_and_server_steps(tiny_model_dir):
    """The first cached request may run under inference_mode (LLM.generate); the server's step
    thread later writes the same buffers under no_grad."""
    llm = LLM.load(tiny_model_dir, EngineConfig(max_batch=2, max_prompt_tokens=64, max_gen_length=64))
    assert llm.runner.kv is None  # no cache unless a request asks for one
    params = SamplingParams(gen_length=16, steps=16, block_length=8, seed=0, kv_cache="dual")
    first = llm.generate(["It is a truth"], params)[0]
    seq = llm.sequence(llm.encode_prompt("It is a truth"), params)
    llm.loop.add(seq)
    with torch.no_grad():
        llm.loop.run_to_completion()
    assert seq.generated() == first.token_ids


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_dream_with_llada_schedule_and_a_cache_keeps_the_blocks_first_logit_fresh(tmp_path, mode):
    """No published loop exists for this mix: the cached window starts one column before the
    block (Dream reads each logit from the column to its left). A block's first step is a full
    forward, so it commits what the uncached run commits; every block completes."""
    from tests.helpers import make_model_dir

    folder = make_model_dir(tmp_path, seed=3, arch="dream")
    cached = LLM.load(folder, EngineConfig(max_batch=2, max_prompt_tokens=64, max_gen_length=64, kv_cache=mode))
    plain = LLM.load(folder, EngineConfig(max_batch=2, max_prompt_tokens=64, max_gen_length=64))
    params = SamplingParams(gen_length=16, steps=8, block_length=8, seed=0, stop_at_eos=False)
    ids = plain.encode_prompt("It is a truth universally")
    firsts = []
    for llm in (cached, plain):
        seq = llm.sequence(ids, params)
        llm.loop.add(seq)
        events, _ = llm.loop.step()
        firsts.append(events[0].canvas)
        llm.loop.run_to_completion()
        assert seq.nfe == 8 and llm.tokenizer.mask_id not in seq.canvas
    assert firsts[0] == firsts[1]


def test_dream_lead_column_dual_cache_is_exact_for_one_layer(tmp_path):
    """With one layer a column's keys depend on its own id only, so the dual cache (and the
    recomputed lead column) is exact: the whole run must equal the uncached one."""
    from tests.helpers import make_model_dir

    folder = make_model_dir(tmp_path, seed=4, arch="dream", n_layers=1)
    params = SamplingParams(gen_length=16, steps=16, block_length=8, seed=0, stop_at_eos=False)
    outs = []
    for mode in ("dual", "none"):
        llm = LLM.load(folder, EngineConfig(max_batch=2, max_prompt_tokens=64, max_gen_length=64, kv_cache=mode))
        outs.append(llm.generate(["It is a truth universally"], params)[0].token_ids)
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_dual_cache_row_decodes_alone_what_it_decodes_beside_a_wider_block(tiny_model_dir):
    """The fresh columns a wider block in the batch adds past a row's own block repeat its last
    block column, so the row's cached suffix (written in place by nobody else) stays as stored."""
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM
    from celeris.engine.sampling.params import SamplingParams
    llm = LLM.load(tiny_model_dir, EngineConfig(max_batch=4, max_prompt_tokens=64, max_gen_length=64, kv_cache="dual"))
    narrow = SamplingParams(gen_length=32, steps=16, block_length=8, seed=1, stop_at_eos=False)
    wide = SamplingParams(gen_length=32, steps=8, block_length=16, seed=2, stop_at_eos=False)
    prompt = llm.tokenizer.encode("Emma Woodhouse")

    def run(pairs):
        seqs = [llm.sequence(p, params) for p, params in pairs]
        for s in seqs:
            llm.loop.add(s)
        llm.loop.run_to_completion()
        return [s.generated() for s in seqs]

    alone = run([(prompt, narrow)])[0]
    assert run([(prompt, narrow), (prompt, wide)])[0] == alone
    assert run([(prompt, narrow)])[0] == alone  # the store was left as it should be
