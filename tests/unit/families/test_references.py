"""Smoke and self-consistency tests of the independent references (tests/unit/references).

Only the references are exercised here: they run, they agree with a plain float64 computation,
their caches agree with a full forward where they must, and their published quirks are pinned.
Holding the engine to them is done elsewhere.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.unit.llada_reference import llada_generate as older_llada_reference
from tests.unit.references.checkpoints import (TINY_MASK, read_checkpoint, write_dream_checkpoint,
                                               write_llada_checkpoint)
from tests.unit.references.dream_generate import dream_generate, dream_generate_cached
from tests.unit.references.dream_modeling import DreamReference
from tests.unit.references.llada_generate import factor_count, get_num_transfer_tokens, llada_generate
from tests.unit.references.llada_modeling import LLaDAReference

MASK = TINY_MASK
LLADA_VARIANTS = {
    "plain": {},
    "gqa": {"n_kv_heads": 2},
    "tied_bias_flags": {"weight_tying": True, "include_qkv_bias": True, "input_emb_norm": True, "scale_logits": True},
    "include_bias": {"include_bias": True, "rope_full_precision": False},
}


def _prompt(B=1, L=7, seed=0):
    return torch.randint(10, 1000, (B, L), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- plain float64 forwards

def _rope64(z, pos, theta):  # z (B, h, L, hs), pos (B, L): rotate-half RoPE in float64
    hs = z.shape[-1]
    inv = theta ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    ang = pos.double()[:, None, :, None] * inv  # (B, 1, L, hs/2)
    a, b = z[..., : hs // 2], z[..., hs // 2:]
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)


def _attend64(q, k, v, keep):  # keep (B, 1, Lq, Lk) bool or None; fully masked rows -> 0
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.nan_to_num(torch.softmax(s, -1)) @ v


def _rms64(z, w, eps, b=None):
    out = z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w
    return out if b is None else out + b


def llada_float64(folder, ids, attention_mask=None):
    cfg, t = read_checkpoint(folder)
    t = {k: v.double() for k, v in t.items()}
    d, H = cfg["d_model"], cfg["n_heads"]
    Hk, hs, eps = cfg["n_kv_heads"], d // H, cfg["rms_norm_eps"]
    B, L = ids.shape
    bias = cfg["include_bias"]

    def lin(z, n, with_bias=bias):
        return z @ t[f"{n}.weight"].T + (t[f"{n}.bias"] if with_bias else 0)

    def norm(z, n):
        return _rms64(z, t[f"{n}.weight"], eps, t.get(f"{n}.bias"))

    x = t["model.transformer.wte.weight"][ids]
    if cfg["input_emb_norm"]:
        x = x * math.sqrt(d)
    pos = torch.arange(L).expand(B, L)
    keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}"
        h = norm(x, f"{p}.attn_norm")
        qb = bias or cfg["include_qkv_bias"]
        q = lin(h, f"{p}.q_proj", qb).view(B, L, H, hs).transpose(1, 2)
        k = lin(h, f"{p}.k_proj", qb).view(B, L, Hk, hs).transpose(1, 2).repeat_interleave(H // Hk, 1)
        v = lin(h, f"{p}.v_proj", qb).view(B, L, Hk, hs).transpose(1, 2).repeat_interleave(H // Hk, 1)
        a = _attend64(_rope64(q, pos, cfg["rope_theta"]), _rope64(k, pos, cfg["rope_theta"]), v, keep)
        x = x + lin(a.transpose(1, 2).reshape(B, L, d), f"{p}.attn_out")
        h = norm(x, f"{p}.ff_norm")
        x = x + lin(torch.nn.functional.silu(lin(h, f"{p}.ff_proj")) * lin(h, f"{p}.up_proj"), f"{p}.ff_out")
    x = norm(x, "model.transformer.ln_f")
    logits = x @ t["model.transformer.wte.weight"].T if cfg["weight_tying"] else lin(x, "model.transformer.ff_out")
    return logits / math.sqrt(d) if cfg["scale_logits"] else logits


def dream_float64(folder, ids, keep=None, tok_idx=None):
    cfg, t = read_checkpoint(folder)
    t = {k: v.double() for k, v in t.items()}
    d, H, Hk = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hs, eps = d // H, cfg["rms_norm_eps"]
    B, L = ids.shape
    pos = torch.arange(L).expand(B, L) if tok_idx is None else tok_idx
    x = t["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = _rms64(x, t[f"{p}.input_layernorm.weight"], eps)
        proj = {n: h @ t[f"{p}.self_attn.{n}.weight"].T + t[f"{p}.self_attn.{n}.bias"] for n in ("q_proj", "k_proj", "v_proj")}
        q = proj["q_proj"].view(B, L, H, hs).transpose(1, 2)
        k = proj["k_proj"].view(B, L, Hk, hs).transpose(1, 2).repeat_interleave(H // Hk, 1)
        v = proj["v_proj"].view(B, L, Hk, hs).transpose(1, 2).repeat_interleave(H // Hk, 1)
        a = _attend64(_rope64(q, pos, cfg["rope_theta"]), _rope64(k, pos, cfg["rope_theta"]), v, keep)
        x = x + a.transpose(1, 2).reshape(B, L, d) @ t[f"{p}.self_attn.o_proj.weight"].T
        h = _rms64(x, t[f"{p}.post_attention_layernorm.weight"], eps)
        g, u = h @ t[f"{p}.mlp.gate_proj.weight"].T, h @ t[f"{p}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ t[f"{p}.mlp.down_proj.weight"].T
    return _rms64(x, t["model.norm.weight"], eps) @ t["lm_head.weight"].T


def _close(ref: torch.Tensor, exact: torch.Tensor, tol=1e-5):
    err = (ref.double() - exact).abs().max().item()
    assert err <= tol * max(1.0, exact.abs().max().item()), err


# ---------------------------------------------------------------- checkpoints

def test_checkpoints_use_published_names_and_keys(tmp_path):
    f = write_llada_checkpoint(tmp_path / "llada", torch.bfloat16, seed=1)
    cfg, t = read_checkpoint(f)
    assert {"d_model", "n_heads", "n_layers", "mlp_hidden_size", "embedding_size", "mask_token_id",
            "weight_tying", "rope_theta", "rope_full_precision", "include_qkv_bias"} <= set(cfg)
    assert "model.transformer.blocks.1.q_proj.weight" in t and "model.transformer.ff_out.weight" in t
    assert all(v.dtype == torch.bfloat16 for v in t.values()) and cfg["torch_dtype"] == "bfloat16"
    assert (f / "tokenizer.json").is_file()
    vocab = len(json.loads((f / "tokenizer.json").read_text())["model"]["vocab"])
    assert cfg["vocab_size"] >= vocab
    g = write_dream_checkpoint(tmp_path / "dream", torch.float32, seed=1)
    cfg, t = read_checkpoint(g)
    assert cfg["model_type"] == "Dream" and {"hidden_size", "num_key_value_heads", "intermediate_size"} <= set(cfg)
    assert "model.layers.0.self_attn.k_proj.bias" in t and "lm_head.weight" in t
    assert not torch.all(t["model.layers.0.input_layernorm.weight"] == 1)  # norm weights not ones


# ---------------------------------------------------------------- forwards

@pytest.mark.parametrize("variant", list(LLADA_VARIANTS))
def test_llada_float32_reference_matches_float64(tmp_path, variant):
    f = write_llada_checkpoint(tmp_path, torch.float32, seed=2, **LLADA_VARIANTS[variant])
    ids = _prompt(2, 12)
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, :3] = 0  # left padding in row 1
    m = LLaDAReference(f)
    _close(m(ids).logits, llada_float64(f, ids))
    out = m(ids, attention_mask=am).logits
    exact = llada_float64(f, ids, am)
    _close(out[1, 3:], exact[1, 3:])
    _close(out[0], exact[0])


def test_dream_float32_reference_matches_float64(tmp_path):
    f = write_dream_checkpoint(tmp_path, torch.float32, seed=3)
    ids = _prompt(2, 12)
    m = DreamReference(f)
    _close(m(ids).logits, dream_float64(f, ids))
    from tests.unit.references.dream_generate import dream_masks
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    mask, tok_idx = dream_masks(ids[:, :8], 4, am)
    out = m(ids, mask, tok_idx).logits
    exact = dream_float64(f, ids, mask, tok_idx)
    _close(out[1, 3:], exact[1, 3:])
    _close(out[0], exact[0])


def test_bfloat16_references_compute_in_bfloat16(tmp_path):
    ids = _prompt(1, 10)
    lm = LLaDAReference(write_llada_checkpoint(tmp_path / "l", torch.bfloat16, seed=4))
    dm = DreamReference(write_dream_checkpoint(tmp_path / "d", torch.bfloat16, seed=4))
    for m in (lm, dm):
        logits = m(ids).logits
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    # RMSNorm: cast to bf16 BEFORE the weight multiply (published), which differs from after.
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + lm.eps)
    w = lm.w["model.transformer.blocks.0.attn_norm.weight"]
    assert torch.equal(lm.norm(x, "model.transformer.blocks.0.attn_norm"), w * xf.to(torch.bfloat16))
    assert not torch.equal(w * xf.to(torch.bfloat16), (w.float() * xf).to(torch.bfloat16))


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_cached_forward_at_block_start_equals_full_forward(tmp_path, arch):
    write = write_llada_checkpoint if arch == "llada" else write_dream_checkpoint
    Model = LLaDAReference if arch == "llada" else DreamReference
    m = Model(write(tmp_path, torch.float32, seed=5))
    x = torch.cat([_prompt(1, 6), torch.full((1, 16), MASK)], 1)
    x[0, 6:9] = torch.tensor([11, 12, 13])
    start, end = 10, 18
    full = m(x, use_cache=True)
    cut = 1 if arch == "dream" else 2  # LLaDA keeps (B, Hk, L, hs); Dream (B, L, Hk*hs)
    prefix = [(k.narrow(cut, 0, start), v.narrow(cut, 0, start)) for k, v in full.past_key_values]
    dual = [(k.clone(), v.clone()) for k, v in full.past_key_values]
    rp = torch.zeros_like(x, dtype=torch.bool)
    rp[:, start:end] = True
    kw = dict(dual_cache=True) if arch == "dream" else {}
    pre = m(x[:, start:], past_key_values=prefix, use_cache=True).logits
    du = m(x[:, start:end], past_key_values=dual, use_cache=True, replace_position=rp, **kw).logits
    assert (pre - full.logits[:, start:]).abs().max() < 1e-5
    assert (du - full.logits[:, start:end]).abs().max() < 1e-5


# ---------------------------------------------------------------- LLaDA / Fast-dLLM generate

def test_num_transfer_tokens_and_factor_rule():
    assert get_num_transfer_tokens(torch.ones(1, 10, dtype=torch.bool), 4).tolist() == [[3, 3, 2, 2]]
    c = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    # Fast-dLLM's `top_i == len(threshs) - 1` branch: the last rank fails yet all n are committed.
    assert factor_count(c(0.9, 0.8, 0.5), 1.0) == 3 and factor_count(c(0.9, 0.8, 0.5), 1.0, "paper") == 2
    assert factor_count(c(0.9, 0.5, 0.4), 1.0) == 1 == factor_count(c(0.9, 0.5, 0.4), 1.0, "paper")
    assert factor_count(c(0.99, 0.99, 0.99), 1.0) == 3 == factor_count(c(0.99, 0.99, 0.99), 1.0, "paper")
    assert factor_count(c(0.1,), 1.0) == 1
    assert factor_count(c(0.9, 0.8, 0.7, 0.2), 1.0) == 2 == factor_count(c(0.9, 0.8, 0.7, 0.2), 1.0, "paper")
    assert factor_count(c(0.95, 0.9, 0.85, 0.1), 1.0) == 4 and factor_count(c(0.95, 0.9, 0.85, 0.1), 1.0, "paper") == 3


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def llada(request, tmp_path_factory):
    return LLaDAReference(write_llada_checkpoint(tmp_path_factory.mktemp("llada"), request.param, seed=6, n_kv_heads=2))


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
@pytest.mark.parametrize("rule", [{}, {"threshold": 0.5}, {"factor": 1.0}, {"threshold": -1.0}, {"threshold": 1.5}])
def test_llada_generate_variants_run(llada, cache, rule):
    prompt = _prompt(1, 5)
    x, nfe = llada_generate(llada, prompt, steps=8, gen_length=16, block_length=8, mask_id=MASK,
                            cache=cache, return_nfe=True, **rule)
    assert torch.equal(x[:, :5], prompt) and not (x == MASK).any()
    if not rule:
        assert nfe == 8
    if rule.get("threshold") == -1.0:  # everything passes: one forward per block
        assert nfe == 2
    if rule.get("threshold") == 1.5:  # nothing passes: only the top-1 per forward
        assert nfe == 16


def test_llada_generate_batch_matches_the_older_reference(tmp_path):
    """Two independent writings of LLaDA generate() agree: padding, CFG, float32 softmax."""
    m = LLaDAReference(write_llada_checkpoint(tmp_path, torch.float32, seed=7))
    prompt = _prompt(2, 6)
    am = torch.ones(2, 6, dtype=torch.long)
    am[0, :2] = 0
    for cfg_scale in (0.0, 1.5):
        ours = llada_generate(m, prompt, steps=8, gen_length=16, block_length=4, mask_id=MASK,
                              attention_mask=am, cfg_scale=cfg_scale, confidence_dtype=None)
        theirs = older_llada_reference(lambda x, a: m(x, attention_mask=a).logits, prompt, 8, 16, 4, MASK,
                                       cfg_scale=cfg_scale, attention_mask=am)
        assert torch.equal(ours, theirs)


def test_fast_dllm_generate_without_cache_threshold_batch(tmp_path):
    m = LLaDAReference(write_llada_checkpoint(tmp_path, torch.float32, seed=8))
    prompt = _prompt(3, 5)
    for rule in ({"threshold": 0.3}, {"factor": 2.0}):
        x = llada_generate(m, prompt, steps=4, gen_length=16, block_length=8, mask_id=MASK, **rule)
        assert not (x == MASK).any()
        for b in range(3):  # a batch row decodes as it would alone
            alone = llada_generate(m, prompt[b:b + 1], steps=4, gen_length=16, block_length=8, mask_id=MASK, **rule)
            assert torch.equal(alone[0], x[b])


# ---------------------------------------------------------------- Dream

@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dream(request, tmp_path_factory):
    return DreamReference(write_dream_checkpoint(tmp_path_factory.mktemp("dream"), request.param, seed=9))


@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_dream_generate_runs(dream, alg):
    prompt = _prompt(2, 5)
    x = dream_generate(dream, prompt, steps=6, gen_length=16, mask_id=MASK, alg=alg)
    assert torch.equal(x[:, :5], prompt) and not (x == MASK).any()


def test_dream_generate_with_left_padding(tmp_path):
    m = DreamReference(write_dream_checkpoint(tmp_path, torch.float32, seed=10))
    prompt = _prompt(2, 6)
    am = torch.ones(2, 6, dtype=torch.long)
    am[0, :2] = 0
    x = dream_generate(m, prompt, steps=4, gen_length=8, mask_id=MASK, alg="maskgit_plus", attention_mask=am)
    assert not (x == MASK).any()
    alone = dream_generate(m, prompt[1:], steps=4, gen_length=8, mask_id=MASK, alg="maskgit_plus")
    assert torch.equal(alone[0], x[1])


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("threshold", [None, 0.3])
def test_dream_block_cache_runs(dream, dual, threshold):
    prompt = _prompt(1, 5)
    x, nfe = dream_generate_cached(dream, prompt, steps=8, gen_length=16, block_length=8, mask_id=MASK,
                                   threshold=threshold, dual_cache=dual, return_nfe=True)
    assert torch.equal(x[:, :5], prompt) and not (x == MASK).any()
    if threshold is None:
        assert nfe <= 8 + 2 * 1  # 4 steps a block; the break test follows a forward


def test_dream_block_cache_single_step_blocks_leave_masks(tmp_path):
    """Published quirk: with one step per block, step 0 commits the block's first token and the
    `i == steps_per_block` break fires at once, leaving block_length - 1 masks per block."""
    m = DreamReference(write_dream_checkpoint(tmp_path, torch.float32, seed=11))
    x = dream_generate_cached(m, _prompt(1, 5), steps=2, gen_length=8, block_length=4, mask_id=MASK)
    assert int((x == MASK).sum()) == 2 * 3
