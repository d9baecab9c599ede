"""Self-consistency of the test-side block-diffusion references (not engine tests).

The references in tests/unit/block_references/ are what the engine's SDAR and LLaDA2 paths will
be held to; these tests check the references agree with themselves: cached = uncached forwards,
the loops commit every block, and the MoE router follows the published math.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from tests.unit.block_references.checkpoints import (EOS_ID, MASK_ID, write_llada2_checkpoint,
                                                     write_sdar_checkpoint)
from tests.unit.block_references.generate import llada21_generate, llada2_generate, sdar_generate, transfer_schedule
from tests.unit.block_references.modeling import (LLaDA2Model, SDARModel, block_causal_mask, load_block_model,
                                                  swiglu)


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    return write_sdar_checkpoint(tmp_path_factory.mktemp("sdar"), seed=0)


@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory):
    return write_llada2_checkpoint(tmp_path_factory.mktemp("llada2"), seed=1)


@pytest.fixture(scope="module")
def sdar(sdar_dir):
    return SDARModel(sdar_dir)


@pytest.fixture(scope="module")
def llada2(llada2_dir):
    return LLaDA2Model(llada2_dir)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(7, 1000, (1, n), generator=g)  # skip the special ids 0..6


def test_block_causal_mask_is_the_published_expanded_tril():
    b, n = 4, 3
    published = torch.tril(torch.ones(n, n)).repeat_interleave(b, 0).repeat_interleave(b, 1).bool()
    assert torch.equal(block_causal_mask(0, n * b, n * b, b), published)
    assert torch.equal(block_causal_mask(b, b, 2 * b, b), published[b:2 * b, :2 * b])


def test_checkpoint_folders_carry_the_published_format(sdar_dir, llada2_dir):
    for folder, arch in ((sdar_dir, "SDARForCausalLM"), (llada2_dir, "LLaDA2MoeModelLM")):
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == [arch]
        tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        assert cfg["vocab_size"] >= tok.get_vocab_size()
        assert tok.token_to_id("<|mask|>") == MASK_ID and tok.token_to_id("<|eos|>") == EOS_ID
        for name in ("tokenizer_config.json", "generation_config.json"):
            json.loads((folder / name).read_text())
    s = load_file(str(sdar_dir / "model.safetensors"))
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.2.mlp.down_proj.weight"} <= set(s)
    t = load_file(str(llada2_dir / "model.safetensors"))
    assert {"model.word_embeddings.weight", "model.layers.0.attention.query_key_value.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.expert_bias",
            "model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.2.mlp.shared_experts.down_proj.weight",
            "model.layers.1.attention.query_layernorm.weight", "model.layers.1.attention.dense.weight"} <= set(t)
    assert "model.layers.0.mlp.gate.weight" not in t  # first_k_dense_replace=1: layer 0 is dense


def test_loading_is_strict(tmp_path):
    folder = write_sdar_checkpoint(tmp_path / "m", seed=0)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tie_word_embeddings"] = True  # now lm_head.weight is unexpected
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unexpected"):
        SDARModel(folder)


@pytest.mark.parametrize("which", ["sdar", "llada2"])
@pytest.mark.parametrize("block_length", [4, 8])
def test_cached_block_forward_equals_full_block_causal_forward(request, which, block_length):
    model = request.getfixturevalue(which)
    n_blocks = 4
    ids = _ids(n_blocks * block_length, seed=block_length)
    full = model.forward_full(ids, block_length)  # (1, L, V)
    # Prefill two blocks, then each later block over the cache, committing its keys/values.
    n = 2 * block_length
    _, cache = model.forward(ids[:, :n], torch.arange(n), None, block_causal_mask(0, n, n, block_length))
    for blk in range(2, n_blocks):
        lo, hi = blk * block_length, (blk + 1) * block_length
        logits, fresh = model.forward(ids[:, lo:hi], torch.arange(lo, hi), cache, None)
        torch.testing.assert_close(logits, full[:, lo:hi], atol=1e-5, rtol=1e-5)
        cache = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(cache, fresh)]
    assert full.abs().max() > 1.0  # peaked logits: the comparison is not between near-zeros


def test_block_causal_mask_matters(sdar):
    """Changing a later block must not change earlier blocks' logits, and must change its own."""
    b = 4
    ids = _ids(3 * b, seed=3)
    other = ids.clone()
    other[0, 2 * b + 1] = 42
    a, c = sdar.forward_full(ids, b), sdar.forward_full(other, b)
    torch.testing.assert_close(a[:, : 2 * b], c[:, : 2 * b], atol=0, rtol=0)
    assert not torch.allclose(a[:, 2 * b:], c[:, 2 * b:])


def test_transfer_schedule():
    assert transfer_schedule(4, 4) == [1, 1, 1, 1]
    assert transfer_schedule(8, 3) == [3, 3, 2]
    assert transfer_schedule(4, 8) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert sum(transfer_schedule(32, 5)) == 32


@pytest.mark.parametrize("prompt_len", [8, 6])  # whole prompt blocks, and a prompt tail in the first decode block
@pytest.mark.parametrize("remasking", ["low_confidence_static", "low_confidence_dynamic", "sequential"])
def test_sdar_generate_commits_every_block(sdar, prompt_len, remasking):
    b, steps, gen = 4, 2, 12
    prompt = _ids(prompt_len, seed=5)[0].tolist()
    out = sdar_generate(sdar, prompt, gen, b, steps, remasking=remasking, threshold=0.5, mask_id=MASK_ID, stop_ids=None)
    total = -(-(prompt_len + gen) // b) * b
    assert len(out.ids) == total - prompt_len and MASK_ID not in out.ids
    assert out.blocks == total // b - prompt_len // b
    # prefill + per block (denoising forwards + one store forward)
    assert out.forwards == 1 + out.denoise_forwards + out.blocks
    if remasking != "low_confidence_dynamic":
        assert out.denoise_forwards <= steps * out.blocks


def test_sdar_dynamic_threshold_extremes(sdar):
    b, prompt = 4, _ids(8, seed=6)[0].tolist()
    static = sdar_generate(sdar, prompt, 16, b, 4, remasking="low_confidence_static", mask_id=MASK_ID)
    never = sdar_generate(sdar, prompt, 16, b, 4, remasking="low_confidence_dynamic", threshold=1.0, mask_id=MASK_ID)
    assert never.ids == static.ids and never.denoise_forwards == static.denoise_forwards == 16
    always = sdar_generate(sdar, prompt, 16, b, 4, remasking="low_confidence_dynamic", threshold=0.0, mask_id=MASK_ID)
    assert always.denoise_forwards == always.blocks == 4  # every mask above 0: one step per block


def test_sdar_stops_after_the_block_holding_a_stop_id(sdar):
    b, prompt = 4, _ids(8, seed=7)[0].tolist()
    free = sdar_generate(sdar, prompt, 24, b, 4, remasking="low_confidence_static", mask_id=MASK_ID)
    stop = free.ids[5]  # a token committed in the second generated block
    first = free.ids.index(stop)
    out = sdar_generate(sdar, prompt, 24, b, 4, remasking="low_confidence_static", mask_id=MASK_ID, stop_ids=[stop])
    assert out.blocks == first // b + 1
    assert out.ids[: out.blocks * b] == free.ids[: out.blocks * b]
    assert set(out.ids[out.blocks * b:]) == {MASK_ID}


def test_sdar_overwrite_unmasked_only_differs_when_topk_exceeds_masks(sdar):
    b, prompt = 4, _ids(8, seed=8)[0].tolist()  # whole blocks, steps == b: k never exceeds masks
    a = sdar_generate(sdar, prompt, 8, b, 4, remasking="low_confidence_static", mask_id=MASK_ID)
    c = sdar_generate(sdar, prompt, 8, b, 4, remasking="low_confidence_static", mask_id=MASK_ID,
                      overwrite_unmasked=True)
    assert a.ids == c.ids


@pytest.mark.parametrize("prompt_len", [8, 11])
@pytest.mark.parametrize("threshold", [0.95, 0.3])
def test_llada2_generate_cached_equals_published_recompute(llada2, prompt_len, threshold):
    prompt = _ids(prompt_len, seed=9)[0].tolist()
    kw = dict(gen_length=20, block_length=8, steps=4, threshold=threshold, mask_id=MASK_ID, eos_id=None)
    plain = llada2_generate(llada2, prompt, use_cache=False, **kw)
    cached = llada2_generate(llada2, prompt, use_cache=True, **kw)
    assert plain.ids == cached.ids and len(plain.ids) == 20 and MASK_ID not in plain.ids
    assert plain.denoise_forwards == cached.denoise_forwards == plain.forwards
    assert cached.forwards == int(prompt_len >= 8) + cached.denoise_forwards + cached.blocks


def test_llada2_output_is_cut_after_the_first_eos(llada2):
    prompt = _ids(8, seed=10)[0].tolist()
    free = llada2_generate(llada2, prompt, 24, 8, 8, threshold=0.95, mask_id=MASK_ID, eos_id=None)
    eos = free.ids[10]
    first = free.ids.index(eos)
    out = llada2_generate(llada2, prompt, 24, 8, 8, threshold=0.95, mask_id=MASK_ID, eos_id=eos)
    assert out.ids == free.ids[: first + 1]
    assert out.blocks == first // 8 + 1


def test_moe_routing_follows_the_published_gate(llada2):
    torch.manual_seed(0)
    h = torch.randn(37, llada2.cfg["hidden_size"])
    idx, w = llada2.route(1, h)
    k, G, Tg = llada2.top_k, llada2.n_group, llada2.topk_group
    E = llada2.cfg["num_experts"]
    assert idx.shape == w.shape == (37, k)
    torch.testing.assert_close(w.sum(-1), torch.full((37,), llada2.scaling), atol=1e-5, rtol=0)
    gate_w, bias = llada2.w["model.layers.1.mlp.gate.weight"], llada2.w["model.layers.1.mlp.gate.expert_bias"]
    for n in range(37):  # one token at a time, the slow obvious way
        s = torch.sigmoid(h[n] @ gate_w.T)
        sb = (s + bias).view(G, E // G)
        best_groups = set(sb.sort(-1, descending=True).values[:, :2].sum(-1).topk(Tg).indices.tolist())
        allowed = [e for e in range(E) if e // (E // G) in best_groups]
        chosen = sorted(allowed, key=lambda e: -float(s[e] + bias[e]))[:k]
        assert sorted(idx[n].tolist()) == sorted(chosen)
        expect = s[idx[n]] / s[idx[n]].sum() * llada2.scaling
        torch.testing.assert_close(w[n], expect, atol=1e-6, rtol=1e-6)
    assert (bias != 0).any()


def test_moe_layer_output_is_weighted_experts_plus_shared(llada2):
    torch.manual_seed(1)
    h = torch.randn(1, 5, llada2.cfg["hidden_size"])
    y = llada2.moe(1, h)
    idx, w = llada2.route(1, h[0])
    p = "model.layers.1.mlp"
    for n in range(5):
        expect = swiglu(h[0, n], llada2.w, f"{p}.shared_experts")
        for j in range(llada2.top_k):
            expect = expect + w[n, j] * swiglu(h[0, n], llada2.w, f"{p}.experts.{int(idx[n, j])}")
        torch.testing.assert_close(y[0, n], expect, atol=1e-5, rtol=1e-5)


def test_load_block_model_dispatches_on_architecture(sdar_dir, llada2_dir):
    assert isinstance(load_block_model(sdar_dir), SDARModel)
    assert isinstance(load_block_model(llada2_dir), LLaDA2Model)


def test_tied_sdar_head_uses_the_embedding(tmp_path):
    m = SDARModel(write_sdar_checkpoint(tmp_path / "tied", seed=2, tie_word_embeddings=True, num_hidden_layers=2))
    assert m.head_weight() is m.w["model.embed_tokens.weight"]
    assert m.forward_full(_ids(8), 4).shape == (1, 8, 1024)


@pytest.mark.parametrize("prompt_len", [8, 6])
def test_llada21_without_editing_is_llada20_one_token_a_step(llada2, prompt_len):
    """With editing off (a threshold no probability exceeds) and one mask a step, LLaDA2.1's loop
    commits what LLaDA2.0's does with one step per position; it only spends one more forward per
    block (the post step that finds nothing to edit)."""
    prompt = _ids(prompt_len, seed=11)[0].tolist()
    old = llada2_generate(llada2, prompt, 12, 4, 4, threshold=0.3, mask_id=MASK_ID, eos_id=None, use_cache=False)
    new = llada21_generate(llada2, prompt, 12, 4, threshold=0.3, editing_threshold=1.0, max_post_steps=16,
                           mask_id=MASK_ID, eos_id=None)
    assert new.ids == old.ids and new.edits == 0
    assert new.forwards == old.denoise_forwards + new.blocks == old.denoise_forwards + new.post_forwards


def test_llada21_post_steps_are_bounded(llada2):
    prompt = _ids(6, seed=12)[0].tolist()  # the first decoded block holds two prompt tokens
    for post in (0, 2):
        r = llada21_generate(llada2, prompt, 8, 4, threshold=0.5, editing_threshold=0.0, max_post_steps=post,
                             mask_id=MASK_ID, eos_id=None)
        assert r.post_forwards <= post * r.blocks and MASK_ID not in r.ids
