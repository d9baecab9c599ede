"""Block-diffusion models (SDAR, LLaDA2) against their published loops, token for token (float32).

The references (tests/unit/block_references) are written from JetAstra/SDAR's generate loop
and LLaDA2's published generate(), over an independent forward that reads the published tensor
names. The engine decodes every prompt of a case in one batch: different prompt lengths put
the requests at different blocks and phases (prefill, denoise, store) in the same steps.
"""

from __future__ import annotations

import pytest
import torch

from celeris.engine.errors import InvalidRequest
from celeris.engine.sampling.params import SamplingParams
from tests.unit.block_references.checkpoints import (EOS_ID, MASK_ID, cut, write_llada2_checkpoint,
                                                     write_llada21_checkpoint, write_sdar_checkpoint)
from tests.unit.block_references.generate import llada2_generate, llada21_generate, sdar_generate
from tests.unit.block_references.modeling import load_block_model
from tests.unit.block_helpers import PROMPTS, engine, run_engine


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    return write_sdar_checkpoint(tmp_path_factory.mktemp("sdar"), seed=0)


@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory):
    return write_llada2_checkpoint(tmp_path_factory.mktemp("llada2"), seed=0)


SDAR_CASES = [  # (block_length, steps per block, remasking, threshold)
    (4, 4, "low_confidence_static", None),
    (4, 2, "low_confidence_static", None),
    (8, 4, "low_confidence_static", None),
    (4, 4, "low_confidence_dynamic", 0.3),
    (8, 8, "low_confidence_dynamic", 0.15),
]


@pytest.mark.parametrize("block_length,spb,remasking,threshold", SDAR_CASES)
def test_sdar_equals_its_published_loop(sdar_dir, block_length, spb, remasking, threshold):
    G = 16
    llm = engine(sdar_dir)
    params = dict(gen_length=G, block_length=block_length, steps=spb * G // block_length)
    if threshold is not None:
        params["threshold"] = threshold
    seqs = run_engine(llm, PROMPTS, **params)
    ref_model = load_block_model(sdar_dir)
    for p, s in zip(PROMPTS, seqs):
        ref = sdar_generate(ref_model, p, G, block_length, spb, remasking=remasking, threshold=threshold,
                            mask_id=MASK_ID, stop_ids=[EOS_ID])
        assert s.generated() == cut(ref.ids, G)
        assert s.finished


@pytest.mark.parametrize("block_length,steps,threshold", [(8, 8, 0.95), (4, 4, 0.3), (8, 4, 0.2), (4, 2, 0.9)])
def test_llada2_equals_its_published_loop(llada2_dir, block_length, steps, threshold):
    G = 16
    llm = engine(llada2_dir)
    seqs = run_engine(llm, PROMPTS, gen_length=G, block_length=block_length, steps=steps * G // block_length,
                      threshold=threshold)
    ref_model = load_block_model(llada2_dir)
    for p, s in zip(PROMPTS, seqs):
        ref = llada2_generate(ref_model, p, G, block_length, steps, threshold=threshold, mask_id=MASK_ID,
                              eos_id=EOS_ID)
        assert s.generated() == cut(ref.ids, G)


def test_forward_count_matches_the_cached_reference(sdar_dir):
    """One prefill forward for the prompt's whole blocks, which also runs the first block's first
    denoise step (the CPU's per-row path fuses them), then per block its denoise steps and one
    store forward (except the block that ends the request)."""
    llm = engine(sdar_dir)
    p = PROMPTS[2]
    s = run_engine(llm, [p], gen_length=16, block_length=4, steps=16, stop_at_eos=False)[0]
    ref = sdar_generate(load_block_model(sdar_dir), p, 16, 4, 4, remasking="low_confidence_static",
                        threshold=None, mask_id=MASK_ID, stop_ids=None)
    assert s.canvas[:16] == ref.ids[:16]
    assert s.nfe == ref.forwards - 2  # the reference also stores its last block, and prefills apart


def test_chunked_prefill_gives_the_same_tokens(sdar_dir):
    long = [5 + (i * 37) % 900 for i in range(40)]
    params = dict(gen_length=16, block_length=4, steps=16)
    whole = run_engine(engine(sdar_dir), [long], **params)[0]
    chunked = run_engine(engine(sdar_dir, prefill_chunk=8), [long], **params)[0]
    assert chunked.generated() == whole.generated()
    assert chunked.nfe == whole.nfe + 40 // 8 - 1  # five prefill steps of 8 tokens instead of one (each
    # run's last one also denoises the first block)


def test_batched_rows_match_their_solo_runs_at_every_block(llada2_dir):
    llm = engine(llada2_dir)
    params = dict(gen_length=24, block_length=8, steps=24, threshold=0.5)
    together = run_engine(llm, PROMPTS, **params)
    for p, s in zip(PROMPTS, together):
        assert run_engine(llm, [p], **params)[0].generated() == s.generated()


def test_requests_that_block_models_cannot_serve_are_refused(sdar_dir):
    llm = engine(sdar_dir)
    for field, kw in (("kv_cache", dict(kv_cache="dual")), ("schedule", dict(schedule="dream")),
                      ("cfg_scale", dict(cfg_scale=1.0))):
        with pytest.raises(InvalidRequest, match=field):
            llm.sequence(PROMPTS[0], SamplingParams(gen_length=16, block_length=4, steps=16, **kw))


def test_defaults_decode_in_the_trained_block_size(sdar_dir):
    llm = engine(sdar_dir)
    assert llm.defaults.block_length == 4 and llm.defaults.steps == llm.defaults.gen_length
    assert llm.kv_cache == "exact"
    res = llm.generate_one(PROMPTS[1])
    assert res.finish_reason.value in ("stop", "length") and len(res.token_ids) <= llm.defaults.gen_length


def test_moe_router_picks_top_k_within_the_best_groups(llada2_dir):
    llm = engine(llada2_dir)
    moe = llm.model.transformer.blocks[1].mlp
    ref = load_block_model(llada2_dir)
    h = torch.randn(20, llm.model.cfg.d_model)
    idx, w = moe.gate(h)
    ref_idx, ref_w = ref.route(1, h)
    assert torch.equal(idx.sort(-1).values, ref_idx.sort(-1).values)
    torch.testing.assert_close(w.sum(-1), torch.full((20,), llm.model.cfg.routed_scaling_factor))
    torch.testing.assert_close(moe(h[None]), ref.moe(1, h[None]), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sdar", "llada2", "llada21"])
def test_celeris_run_json_equals_the_published_loop(tmp_path, kind):
    import json
    import subprocess
    import sys

    writer = {"sdar": write_sdar_checkpoint, "llada2": write_llada2_checkpoint, "llada21": write_llada21_checkpoint}
    folder = writer[kind](tmp_path, seed=1)
    prompt = "It is a truth universally acknowledged"
    editing = ["--editing-threshold", "0.0", "--max-post-steps", "3"] if kind == "llada21" else []
    out = subprocess.run([sys.executable, "-m", "celeris.server.cli", "run", "--model", str(folder), "--prompt", prompt,
                          "--gen-length", "16", "--block-length", "4", "--steps", "16", "--threshold", "0.3",
                          "--temperature", "0", "--json", *editing], capture_output=True, text=True, timeout=300,
                         check=True)
    got = json.loads(out.stdout)
    ids = engine(folder).encode_prompt(prompt)
    model = load_block_model(folder)
    if kind == "sdar":
        ref = sdar_generate(model, ids, 16, 4, 4, remasking="low_confidence_dynamic", threshold=0.3,
                            mask_id=MASK_ID, stop_ids=[EOS_ID]).ids
    elif kind == "llada2":
        ref = llada2_generate(model, ids, 16, 4, 4, threshold=0.3, mask_id=MASK_ID, eos_id=EOS_ID).ids
    else:
        ref = llada21_generate(model, ids, 16, 4, threshold=0.3, editing_threshold=0.0, max_post_steps=3,
                               mask_id=MASK_ID, eos_id=EOS_ID).ids
    assert MASK_ID not in ref[:16]  # the comparison's precondition (see test_block_serving)
    assert got["token_ids"] == cut(ref, 16) and got["kv_cache"] == "exact"


def test_seeded_sampling_reproduces_alone_and_batched(sdar_dir):
    llm = engine(sdar_dir)
    params = dict(gen_length=16, block_length=4, steps=8, temperature=0.8, stop_at_eos=False)
    seqs = [llm.sequence(p, SamplingParams(seed=7, **params)) for p in PROMPTS]
    for s in seqs:
        llm.loop.add(s)
    llm.loop.run_to_completion()
    alone = llm.sequence(PROMPTS[1], SamplingParams(seed=7, **params))
    other = llm.sequence(PROMPTS[1], SamplingParams(seed=8, **params))
    for s in (alone, other):
        llm.loop.add(s)
    llm.loop.run_to_completion()
    assert alone.canvas == seqs[1].canvas
    assert other.canvas != alone.canvas


def test_planned_steps_cover_prefill_denoise_and_store_forwards(sdar_dir):
    llm = engine(sdar_dir, prefill_chunk=8)
    whole = run_engine(llm, [[5 + i for i in range(16)]], gen_length=16, block_length=4, steps=16,
                       stop_at_eos=False)[0]  # 4 prompt blocks: 2 prefill chunks, 4 blocks, 3 stores
    assert whole.total_steps == 2 + 4 * 4 + 3 - 1 == whole.nfe  # the last chunk's forward denoises too
    tail = run_engine(llm, [[6 + i for i in range(18)]], gen_length=16, block_length=4, steps=16,
                      stop_at_eos=False)[0]  # the first block holds 2 prompt tokens: it may finish early
    # (a prompt of its own: one that shared whole blocks with the first would plan fewer prefill
    # steps, its blocks copied from the prefix cache)
    assert tail.total_steps == 2 + 5 * 4 + 4 - 1 and tail.nfe <= tail.total_steps
