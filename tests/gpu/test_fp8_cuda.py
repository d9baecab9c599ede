"""FP8 weights on a GPU with FP8 matmuls (issue #46): torch._scaled_mm's path computes what the
reference path computes, and a served model loads, quantises, graphs and decodes (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from celeris.engine.models.fp8 import Fp8Grouped, Fp8Linear, fp8_capable, quantize_fp8, use_kernel

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and fp8_capable("cuda")),
                                reason="needs a CUDA GPU with FP8 matmuls (compute capability 8.9+)")


@pytest.mark.parametrize("m, k, n", [(1, 64, 48), (5, 40, 24), (32, 4096, 1024), (257, 1024, 4096)])
def test_scaled_mm_matches_the_reference_path(m, k, n):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    packed = Fp8Linear.from_linear(lin)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    fast, ref = packed(x, kernel=True), packed(x, kernel=False)
    assert fast.dtype == torch.bfloat16
    # the same quantised operands; the two differ by fp32 summation order and the bf16 output
    torch.testing.assert_close(fast.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_grouped_experts_match_the_reference_path():
    torch.manual_seed(1)
    w = torch.randn(8, 256, 128, device="cuda", dtype=torch.bfloat16)  # (E, N, K)
    counts = torch.tensor([3, 0, 17, 1, 40, 0, 2, 9], device="cuda")
    x = torch.randn(int(counts.sum()), 128, device="cuda", dtype=torch.bfloat16)
    packed = Fp8Grouped(w)
    fast, ref = packed.grouped_linear(x, counts, kernel=True), packed.grouped_linear(x, counts, kernel=False)
    torch.testing.assert_close(fast.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_a_quantised_model_on_the_device_agrees_with_its_reference_path():
    from tests.helpers import random_model, tiny_config

    model = random_model(tiny_config(), seed=1, std=0.1).to("cuda", torch.bfloat16)
    quantize_fp8(model)
    ids = torch.randint(5, 300, (4, 32), device="cuda")
    with torch.no_grad():
        fast = model(ids).float()
        use_kernel(model, False)
        ref = model(ids).float()
    cos = F.cosine_similarity(fast.flatten(0, 1), ref.flatten(0, 1), dim=-1)
    assert cos.min() > 0.99, cos.min()


def test_served_fp8_loads_quantises_and_decodes_with_graphs(tmp_path):
    from celeris.engine.config import EngineConfig
    from celeris.engine.llm import LLM
    from celeris.engine.sampling.params import SamplingParams
    from tests.helpers import make_model_dir

    folder = make_model_dir(tmp_path / "m", seed=0)
    cfg = EngineConfig(device="cuda", dtype="bfloat16", quantization="fp8", max_batch=4, max_prompt_tokens=32,
                       max_gen_length=32)
    llm = LLM.load(folder, cfg)
    assert isinstance(llm.model.transformer.blocks[0].q_proj, Fp8Linear)
    params = SamplingParams(gen_length=16, steps=8, block_length=16, seed=0)
    outs = [r.token_ids for r in llm.generate(["It is a truth", "Emma Woodhouse"], params)]
    again = [r.token_ids for r in llm.generate(["It is a truth", "Emma Woodhouse"], params)]
    assert outs == again and all(len(o) > 0 for o in outs)  # graph replays decode as the first run did
    bf16 = LLM.load(folder, EngineConfig(device="cuda", dtype="bfloat16", max_batch=4, max_prompt_tokens=32,
                                         max_gen_length=32))
    ref = [r.token_ids for r in bf16.generate(["It is a truth", "Emma Woodhouse"], params)]
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o, r)) / sum(len(r) for r in ref)
    print(f"fp8 vs bf16 served tokens: {same:.2f} agree")  # a figure, not a gate (random weights)


def test_packing_stays_on_the_device_and_halves_bf16_weights():
    from tests.helpers import random_model, tiny_config

    model = random_model(tiny_config(), seed=2).to("cuda", torch.bfloat16)
    summary = quantize_fp8(model)
    assert summary.bytes_after < summary.bytes_before / 1.8  # bf16 -> one byte a weight (+ a scale a row)
    assert all(b.is_cuda for b in model.buffers())


def test_served_fp8_diffusion_gemma_packs_its_experts_and_decodes(tmp_path):
    """DiffusionGemma through LLM.load with fp8 on the device: attention, GLUs and the 3-D experts
    packed (experts through torch._scaled_grouped_mm on Hopper), routers kept, requests decode."""
    pytest.importorskip("transformers")
    from celeris.engine.config import EngineConfig
    from celeris.engine.families.revise.sampler import ReviseParams
    from celeris.engine.families.revise.slots import generate
    from celeris.engine.llm import LLM
    from tests.unit.revise_references.gemma_checkpoint import write_checkpoint, write_tokenizer

    folder = write_tokenizer(write_checkpoint(tmp_path / "dg", canvas_length=8, seed=8))
    llm = LLM.load(folder, EngineConfig(device="cuda", dtype="bfloat16", quantization="fp8", max_batch=2,
                                        max_prompt_tokens=32, max_gen_length=16))
    layer = llm.model.layers[0]
    assert isinstance(layer.experts.gate_up_proj, Fp8Grouped) and isinstance(layer.self_attn.q_proj, Fp8Linear)
    assert type(layer.router.proj) is torch.nn.Linear
    p = ReviseParams(max_denoising_steps=4, entropy_bound=1.5, t_min=0.05, t_max=0.2, stability_threshold=1,
                     confidence_threshold=2.5)
    tokens = generate(llm.model, [2, 5, 6, 7], p, 0, 8)
    assert len(tokens) > 0 and all(0 <= t < llm.model.cfg.vocab_size for t in tokens)
