"""The mask predictor: padding invariance, GQA, tied heads, Dream's logit shift."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers import random_model, tiny_config


def test_left_padding_with_mask_gives_unpadded_logits():
    model = random_model(tiny_config(), seed=1)
    torch.manual_seed(0)
    seqs = [torch.randint(5, 300, (n,)) for n in (7, 12, 3)]
    width = 12
    batch = torch.stack([F.pad(s, (width - len(s), 0), value=0) for s in seqs])
    mask = torch.stack([torch.arange(width) >= width - len(s) for s in seqs])
    padded = model(batch, key_mask=mask)
    for row, s in enumerate(seqs):
        solo = model(s[None])[0]
        torch.testing.assert_close(padded[row, width - len(s):], solo, atol=1e-4, rtol=0)


def test_out_index_gathers_the_same_logits():
    model = random_model(tiny_config(), seed=2)
    ids = torch.randint(5, 300, (2, 10))
    full = model(ids)
    idx = torch.tensor([[3, 4, 5], [7, 8, 9]])
    part = model(ids, out_index=idx)
    torch.testing.assert_close(part, torch.gather(full, 1, idx[..., None].expand(-1, -1, full.shape[-1])))


def test_grouped_query_attention_equals_repeated_kv_heads():
    gqa = random_model(tiny_config(n_heads=4, n_kv_heads=2), seed=3)
    mha = random_model(tiny_config(n_heads=4, n_kv_heads=4), seed=3)
    sd = gqa.state_dict()
    hd = gqa.cfg.head_dim
    for k, v in sd.items():  # each kv head serves two query heads
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            sd[k] = v.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    ids = torch.randint(5, 300, (2, 9))
    torch.testing.assert_close(gqa(ids), mha(ids), atol=1e-4, rtol=1e-4)


def test_tied_head_uses_embedding():
    model = random_model(tiny_config(weight_tying=True), seed=4)
    assert not hasattr(model.transformer, "ff_out")
    h = torch.randn(1, 2, 64)
    expected = F.linear(model.transformer.ln_f(h), model.transformer.wte.weight[:model.cfg.vocab_size])
    torch.testing.assert_close(model.head(h), expected)


def test_dream_logits_are_shifted_right_by_one():
    llada = random_model(tiny_config(), seed=5)
    dream = random_model(tiny_config(arch="dream"), seed=5)
    ids = torch.randint(5, 300, (1, 8))
    a, b = llada(ids), dream(ids)
    torch.testing.assert_close(b[:, 1:], a[:, :-1])
    torch.testing.assert_close(b[:, 0], a[:, 0])


def test_bfloat16_forward_runs_and_norms_in_fp32():
    model = random_model(tiny_config(), seed=6).to(torch.bfloat16)
    out = model(torch.randint(5, 300, (1, 6)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
