"""FP8 (E4M3) weights on the CPU (issue #46): packing, the reference W8A8 matmul, which modules
quantize_fp8 packs in each model family, logit closeness, and the refusals at load."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from celeris.engine.config import EngineConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.models import fp8
from celeris.engine.models.fp8 import (E4M3, E4M3_MAX, Fp8Grouped, Fp8Linear, kernel_mm, quantize_fp8, quantize_rows,
                                       reference_mm, to_e4m3)
from tests.helpers import make_model_dir, random_model, tiny_config

MOE = dict(arch="llada2", num_experts=4, experts_per_token=2, moe_hidden_size=32, n_group=2, topk_group=1,
           first_dense_layers=1, num_shared_experts=1, qk_norm=True, logits_fp32=True, partial_rotary_factor=0.5)


def _gemma(seed: int = 0):
    from celeris.engine.families.revise.config import gemma_config
    from celeris.engine.families.revise.model import DiffusionGemma
    from tests.unit.revise_references.gemma_checkpoint import TEXT

    cfg = gemma_config({"text_config": TEXT, "canvas_length": 8})
    torch.manual_seed(seed)
    model = DiffusionGemma(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model.eval()


# ------------------------------------------------------------------ packing


def test_rows_pack_to_one_byte_with_amax_over_448_scales_and_zero_rows_safe():
    torch.manual_seed(0)
    w = torch.randn(8, 32) * torch.logspace(-3, 2, 8)[:, None]  # rows six decades apart
    w[3] = 0
    q, scale = quantize_rows(w)
    assert q.dtype == E4M3 and q.element_size() == 1 and scale.dtype == torch.float32
    torch.testing.assert_close(scale[[0, 1, 2, 4]], w[[0, 1, 2, 4]].abs().amax(-1) / E4M3_MAX)
    assert scale[3] == 1 and not q[3].float().any()  # a zero row: scale 1, values 0, no NaN
    assert (q.float().abs().amax(-1)[[0, 1, 2, 4, 5, 6, 7]] == E4M3_MAX).all()  # each row spans the range
    back = fp8.dequantize(q, scale)
    # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; subnormals (below 2^-6) 2^-10 absolute
    bound = torch.maximum(w.abs() * 2 ** -4, 2 ** -10 * scale[:, None]) * 1.0001
    assert ((back - w).abs() <= bound).all()


def test_the_cast_saturates_at_448_instead_of_nan():
    out = to_e4m3(torch.tensor([1e6, -1e6, 448.0, 500.0, 0.0])).float()
    assert out.tolist() == [448.0, -448.0, 448.0, 448.0, 0.0]


def test_a_linear_is_packed_and_padded_to_multiples_of_16():
    lin = nn.Linear(40, 24, bias=True)
    packed = Fp8Linear.from_linear(lin)
    assert packed.qweight.shape == (32, 48) and packed.weight_scale.shape == (32,)
    assert not packed.qweight[24:].float().any() and not packed.qweight[:, 40:].float().any()
    assert packed.qweight.untyped_storage().nbytes() == 32 * 48  # one byte a weight
    assert packed(torch.randn(3, 5, 40)).shape == (3, 5, 24)
    assert Fp8Linear(torch.randn(24, 40))(torch.randn(3, 5, 40)).shape == (3, 5, 24)  # no bias


# ------------------------------------------------------------------ the matmuls


def _independent(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """W8A8 written out without the module: per-token and per-channel scales, an fp32 product,
    both scales applied after it (the order the GPU epilogue uses)."""
    sx = x.abs().amax(-1, keepdim=True) / 448  # (M, 1)
    sw = w.abs().amax(-1) / 448  # (N,)
    xq = (x / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    wq = (w / sw[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (xq @ wq.T) * sx * sw + bias


@pytest.mark.parametrize("k, n", [(64, 48), (40, 24)])  # aligned, and padded on both axes
def test_the_reference_matmul_equals_an_independent_dequantised_product(k, n):
    torch.manual_seed(1)
    lin = nn.Linear(k, n)
    x = torch.randn(7, k) * torch.logspace(-2, 2, 7)[:, None]  # tokens of very different sizes
    out = Fp8Linear.from_linear(lin)(x, kernel=False)
    torch.testing.assert_close(out, _independent(x, lin.weight.detach(), lin.bias.detach()), rtol=1e-5, atol=1e-5)


def test_the_device_matmul_call_matches_the_reference_where_torch_runs_it_on_the_cpu():
    """torch._scaled_mm's argument layout (row-wise scales, column-major second operand), run by
    torch's CPU kernel: the same product as the reference to bf16 rounding."""
    torch.manual_seed(2)
    xq, sx = quantize_rows(torch.randn(5, 64))
    wq, sw = quantize_rows(torch.randn(32, 64))
    try:
        fast = kernel_mm(xq, sx, wq, sw, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch has no CPU _scaled_mm: {e}")
    torch.testing.assert_close(fast.float(), reference_mm(xq, sx, wq, sw, torch.float32), rtol=1e-2, atol=1e-2)


def test_grouped_experts_equal_one_packed_linear_per_expert():
    torch.manual_seed(3)
    w = torch.randn(4, 32, 16)  # (E, N, K)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 16)
    out = Fp8Grouped(w).grouped_linear(x, counts, kernel=False)
    rows = x.split(counts.tolist())
    want = torch.cat([Fp8Linear(w[e])(rows[e], kernel=False) for e in range(4) if counts[e]])
    torch.testing.assert_close(out, want)


# ------------------------------------------------------------------ whole models


def test_dense_model_packs_every_block_projection_and_keeps_embedding_and_head():
    model = random_model(tiny_config(), seed=0)
    summary = quantize_fp8(model)
    t = model.transformer
    assert summary.linears == 7 * len(t.blocks) and summary.kept == ("transformer.ff_out",)
    for block in t.blocks:
        for name in ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"):
            assert isinstance(getattr(block, name), Fp8Linear), name
    assert type(t.ff_out) is nn.Linear and type(t.wte) is nn.Embedding
    assert summary.bytes_after < summary.bytes_before / 3.5  # fp32 -> one byte (+ a scale a row)


def test_moe_model_packs_routed_and_shared_experts_and_keeps_the_router():
    model = random_model(tiny_config(**MOE), seed=0)
    quantize_fp8(model)
    moe = model.transformer.blocks[1].mlp
    assert type(moe.gate.weight) is nn.Parameter and moe.gate.weight.dtype == torch.float32
    for expert in [*moe.experts, moe.shared_experts]:
        assert all(isinstance(getattr(expert, n), Fp8Linear) for n in ("ff_proj", "up_proj", "ff_out"))
    assert not any(type(m) is nn.Linear for n, m in model.named_modules() if n != "transformer.ff_out")


def test_diffusion_gemma_packs_attention_glus_and_3d_experts_and_keeps_routers():
    model = _gemma()
    summary = quantize_fp8(model)
    n = model.cfg.n_layers
    assert summary.grouped == 2 * n and summary.kept == tuple(f"layers.{i}.router.proj" for i in range(n))
    for layer in model.layers:
        assert isinstance(layer.experts.gate_up_proj, Fp8Grouped) and isinstance(layer.experts.down_proj, Fp8Grouped)
        assert isinstance(layer.mlp.gate_proj, Fp8Linear) and isinstance(layer.self_attn.q_proj, Fp8Linear)
        assert type(layer.router.proj) is nn.Linear
    assert not any(p.dim() == 3 for p in model.parameters())


def _agreement(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """(mean cosine over positions, top-1 agreement)  ref, out (..., V)"""
    cos = F.cosine_similarity(ref.flatten(0, -2).float(), out.flatten(0, -2).float(), dim=-1)
    return cos.mean().item(), (ref.argmax(-1) == out.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("extra", [{}, MOE], ids=["dense", "moe"])
def test_logits_stay_close_to_the_unquantised_model_and_a_broken_scale_does_not(extra):
    model = random_model(tiny_config(**extra), seed=1, std=0.1)
    packed = copy.deepcopy(model)
    quantize_fp8(packed)
    ids = torch.randint(5, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = model(ids), packed(ids)
        cos, top1 = _agreement(ref, out)
        assert cos > 0.98 and top1 > 0.7, (cos, top1)  # measured: cosine 0.995 dense, 0.993 MoE; top-1 0.86, 0.77
        for m in packed.modules():  # the negative control: every scale off by half again
            if isinstance(m, Fp8Linear):
                m.weight_scale.mul_(1.5)
        assert _agreement(ref, packed(ids))[0] < 0.95


def test_diffusion_gemma_denoising_logits_stay_close():
    from celeris.engine.families.revise.model import KVCache

    model = _gemma()
    packed = copy.deepcopy(model)
    quantize_fp8(packed)
    caches = [KVCache(model.cfg), KVCache(model.cfg)]
    canvas = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    logits = []
    for m, cache in zip((model, packed), caches):
        m.encode(torch.tensor([[2, 5, 6, 7]]), cache)
        logits.append(m.denoise(canvas, cache, None))
    cos, _ = _agreement(*logits)
    assert cos > 0.95, cos


# ------------------------------------------------------------------ refusals


def test_unknown_methods_and_parallel_are_refused_by_the_config():
    with pytest.raises(ModelLoadError, match="'awq' is not supported.*fp8"):
        EngineConfig(quantization="awq")
    with pytest.raises(ModelLoadError, match="one process only"):
        EngineConfig(quantization="fp8", tensor_parallel_size=2)


def test_fp8_on_the_cpu_is_refused_by_the_real_loader(tmp_path):
    from celeris.engine.llm import LLM

    folder = make_model_dir(tmp_path / "m")
    with pytest.raises(ModelLoadError, match=r"8\.9 or newer.*device 'cpu' has none"):
        LLM.load(folder, EngineConfig(quantization="fp8"))


def test_a_gpu_without_fp8_matmuls_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(fp8, "_capability", lambda index: (8, 0))
    with pytest.raises(ModelLoadError, match=r"'cuda:0' \(NVIDIA A100-SXM4-80GB, compute capability 8\.0\).*8\.9"):
        fp8.check_fp8_device("cuda:0")
    monkeypatch.setattr(fp8, "_capability", lambda index: (9, 0))
    fp8.check_fp8_device("cuda:0")  # an H100 passes


def test_the_cli_takes_vllms_flag_and_refuses_clearly(capsys):
    from celeris.server.cli import main

    assert main(["run", "--quantization", "fp8", "--prompt", "hi"]) == 2
    assert "needs a GPU with FP8 matmuls" in capsys.readouterr().err
    assert main(["run", "-q", "awq", "--prompt", "hi"]) == 2
    assert "'awq' is not supported (choices: fp8" in capsys.readouterr().err
