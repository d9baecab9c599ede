"""The engine against the peers' published code, token for token, in float32 and bfloat16.

The references in tests/unit/references are written from the published LLaDA, Fast-dLLM and
Dream code (forward op order, samplers, caches) and read the checkpoints by their published
tensor names; nothing here shares code with the engine. Every engine run batches prompts of
different lengths together (left padding, one forward per step), and each row must equal its
own unpadded reference run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from celeris.engine.config import EngineConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from tests.unit.references.checkpoints import TINY_MASK, write_dream_checkpoint, write_llada_checkpoint
from tests.unit.references.dream_generate import dream_generate, dream_generate_cached
from tests.unit.references.dream_modeling import DreamReference
from tests.unit.references.llada_generate import factor_count, llada_generate
from tests.unit.references.llada_modeling import LLaDAReference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPTS = [[17, 301, 45, 999, 12], [88, 5, 640, 31, 77, 402, 15, 9, 250]]  # two lengths: a padded batch


@pytest.fixture(scope="module", params=list(DTYPES))
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llada_dirs(tmp_path_factory):
    return {name: write_llada_checkpoint(tmp_path_factory.mktemp(f"llada-{name}"), dtype=dt, seed=0)
            for name, dt in DTYPES.items()}


@pytest.fixture(scope="module")
def dream_dirs(tmp_path_factory):
    return {name: write_dream_checkpoint(tmp_path_factory.mktemp(f"dream-{name}"), dtype=dt, seed=0)
            for name, dt in DTYPES.items()}


def engine(folder, dtype: str, kv_cache: str = "none") -> LLM:
    return LLM.load(folder, EngineConfig(dtype=dtype, kv_cache=kv_cache, max_batch=4, max_prompt_tokens=32,
                                         max_gen_length=64))


def run_engine(llm: LLM, prompts, **params) -> list[tuple[list[int], int]]:
    """(generated canvas, forward passes) of each prompt, all decoded in one batch."""
    seqs = [llm.sequence(p, SamplingParams(stop_at_eos=False, seed=0, **params)) for p in prompts]
    for s in seqs:
        llm.loop.add(s)
    llm.loop.run_to_completion()
    return [(s.canvas, s.nfe) for s in seqs]


def assert_rows_equal(ours, reference_runs):
    for (canvas, nfe), (ref, ref_nfe, lp) in zip(ours, reference_runs):
        assert canvas == ref[0, lp:].tolist()
        assert TINY_MASK not in canvas
        if ref_nfe is not None:
            assert nfe == ref_nfe


# ---------------------------------------------------------------- forward, bit for bit

@pytest.mark.parametrize("variant", [{}, {"n_kv_heads": 2}, {"weight_tying": True, "include_qkv_bias": True,
                                                            "input_emb_norm": True, "scale_logits": True}])
def test_llada_logits_equal_published_forward_bit_for_bit(tmp_path, dtype, variant):
    folder = write_llada_checkpoint(tmp_path, dtype=DTYPES[dtype], seed=3, **variant)
    ids = torch.tensor([PROMPTS[1] + [TINY_MASK] * 11])
    ours = engine(folder, dtype).model(ids)
    theirs = LLaDAReference(folder, DTYPES[dtype])(ids).logits
    assert ours.dtype == DTYPES[dtype]
    assert torch.equal(ours, theirs)


def test_dream_logits_equal_published_forward_bit_for_bit(dream_dirs, dtype):
    ids = torch.tensor([PROMPTS[1] + [TINY_MASK] * 11])
    ours = engine(dream_dirs[dtype], dtype).model(ids)
    logits = DreamReference(dream_dirs[dtype], DTYPES[dtype])(ids).logits
    theirs = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # Dream's generate shifts them
    assert torch.equal(ours, theirs)


def test_left_padding_leaves_the_rows_logits_bit_for_bit(llada_dirs, dtype):
    model = engine(llada_dirs[dtype], dtype).model
    short, long = PROMPTS[0] + [TINY_MASK] * 4, PROMPTS[1] + [TINY_MASK] * 4
    pad = len(long) - len(short)
    batch = torch.tensor([[0] * pad + short, long])
    mask = torch.tensor([[False] * pad + [True] * len(short), [True] * len(long)])
    # On CPU each row attends alone over its real keys: the padded row is the solo call's bits.
    # One thread: with several, a GEMM may split its work by the batch's shape, and the order of
    # a float sum with it (measured on a 2-core AMD EPYC: 1e-5 apart at 2 threads, equal at 1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        together = model(batch, key_mask=mask)
        solo = model(torch.tensor([short]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together[0, pad:], solo[0])


# ---------------------------------------------------------------- LLaDA and Fast-dLLM loops

LLADA_CASES = [  # (engine params, reference kwargs)
    (dict(gen_length=8, steps=8, block_length=8), {}),
    (dict(gen_length=16, steps=8, block_length=4), {}),
    (dict(gen_length=12, steps=6, block_length=4), {}),
    (dict(gen_length=16, steps=16, block_length=8, threshold=0.2), dict(threshold=0.2)),
    (dict(gen_length=16, steps=16, block_length=8, threshold=0.05), dict(threshold=0.05)),
    (dict(gen_length=16, steps=16, block_length=8, factor=1.0), dict(factor=1.0)),
    (dict(gen_length=16, steps=16, block_length=16, factor=2.0, factor_rule="paper"),
     dict(factor=2.0, factor_rule="paper")),
]


def _llada_refs(folder, dtype, prompts, params, kw, cache=None):
    model = LLaDAReference(folder, DTYPES[dtype])
    runs = []
    for p in prompts:
        ref, nfe = llada_generate(model, torch.tensor([p]), steps=params["steps"], gen_length=params["gen_length"],
                                  block_length=params["block_length"], mask_id=TINY_MASK, cache=cache,
                                  return_nfe=True, **kw)
        runs.append((ref, nfe, len(p)))
    return runs


@pytest.mark.parametrize("params,kw", LLADA_CASES)
def test_llada_generate_and_fast_dllm_without_cache(llada_dirs, dtype, params, kw):
    ours = run_engine(engine(llada_dirs[dtype], dtype), PROMPTS, **params)
    assert_rows_equal(ours, _llada_refs(llada_dirs[dtype], dtype, PROMPTS, params, kw))


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("params,kw", [LLADA_CASES[1], LLADA_CASES[3], LLADA_CASES[5]])
def test_fast_dllm_prefix_and_dual_cache(llada_dirs, dtype, cache, params, kw):
    # The engine's default cache and a per-request choice reach the same loop.
    by_default = run_engine(engine(llada_dirs[dtype], dtype, kv_cache=cache), PROMPTS, **params)
    per_request = run_engine(engine(llada_dirs[dtype], dtype), PROMPTS, kv_cache=cache, **params)
    refs = _llada_refs(llada_dirs[dtype], dtype, PROMPTS, params, kw, cache=cache)
    assert_rows_equal(by_default, refs)
    assert_rows_equal(per_request, refs)


def test_confidences_saturated_in_float32_still_rank_like_float64(tmp_path):
    """Large weights put several fp32 confidences at exactly 1.0 (like a trained model's EOS
    tail); float64 keeps them apart, as the published float64 generate() does."""
    folder = write_llada_checkpoint(tmp_path, seed=2, std=4.0)
    llm = engine(folder, "float32")
    ids = torch.tensor([PROMPTS[1] + [TINY_MASK] * 16])
    probs = torch.softmax(llm.model(ids).float(), -1).amax(-1)[0, len(PROMPTS[1]):]
    assert (probs == 1.0).sum() >= 2  # the ties float32 would have to break
    params = dict(gen_length=16, steps=16, block_length=16)
    ours = run_engine(llm, PROMPTS, **params)
    assert_rows_equal(ours, _llada_refs(folder, "float32", PROMPTS, params, {}))
    in_float32 = _llada_refs(folder, "float32", PROMPTS, params, dict(confidence_dtype=None))
    assert any(c != r[0][0, r[2]:].tolist() for (c, _), r in zip(ours, in_float32))  # the dtype decides


def test_factor_rule_fast_dllm_commits_one_more_than_the_paper_when_only_the_last_fails():
    sorted_conf = torch.tensor([0.99, 0.9, 0.2], dtype=torch.float64)  # f=1: bounds -, 0.667, 0.75
    assert factor_count(sorted_conf, 1.0, "fast_dllm") == 3
    assert factor_count(sorted_conf, 1.0, "paper") == 2
    from celeris.engine.sampling.select import _factor_count

    n_cand = torch.tensor([3])
    f = torch.tensor([1.0], dtype=torch.float64)
    assert _factor_count(sorted_conf[None], f, n_cand, None).item() == 3
    assert _factor_count(sorted_conf[None], f, n_cand, torch.tensor([1])).item() == 2


# ---------------------------------------------------------------- Dream

DREAM_ALGS = {"maskgit_plus": "low_confidence", "topk_margin": "margin", "entropy": "entropy"}


@pytest.mark.parametrize("alg", list(DREAM_ALGS))
@pytest.mark.parametrize("steps,gen_length", [(8, 16), (5, 12)])
def test_dream_diffusion_generate(dream_dirs, dtype, alg, steps, gen_length):
    ours = run_engine(engine(dream_dirs[dtype], dtype), PROMPTS, gen_length=gen_length, steps=steps,
                      block_length=gen_length, schedule="dream", remasking=DREAM_ALGS[alg])
    model = DreamReference(dream_dirs[dtype], DTYPES[dtype])
    refs = [(dream_generate(model, torch.tensor([p]), steps=steps, gen_length=gen_length, mask_id=TINY_MASK,
                            alg=alg), steps, len(p)) for p in PROMPTS]
    assert_rows_equal(ours, refs)


@pytest.mark.parametrize("alg", list(DREAM_ALGS))
def test_dream_ranks_confidences_after_its_default_top_k(dream_dirs, dtype, alg):
    """Dream's diffusion_generate, called as published (top_k unset: transformers' 50), ranks the
    renormalised top-50 probabilities; a Dream folder's defaults do the same (top_k=50, and the
    family's rule reads confidences after the filter)."""
    llm = engine(dream_dirs[dtype], dtype)
    assert llm.defaults.top_k == 50
    ours = run_engine(llm, PROMPTS, gen_length=16, steps=8, block_length=16, schedule="dream",
                      remasking=DREAM_ALGS[alg], top_k=50)
    model = DreamReference(dream_dirs[dtype], DTYPES[dtype])
    refs = [(dream_generate(model, torch.tensor([p]), steps=8, gen_length=16, mask_id=TINY_MASK, alg=alg,
                            top_k=50), 8, len(p)) for p in PROMPTS]
    assert_rows_equal(ours, refs)


def test_top_50_changes_dream_confidences_but_not_its_picks():
    """What the filter does: x0 is the same token, its confidence the renormalised top-50 one."""
    from tests.unit.references.dream_generate import sample_tokens
    logits = torch.randn(6, 1024, generator=torch.Generator().manual_seed(0))
    full, x0 = sample_tokens(logits)
    top, x0_top = sample_tokens(logits, top_k=50)
    assert torch.equal(x0, x0_top) and (top > full).all()
    ent_full, _ = sample_tokens(logits, neg_entropy=True)
    ent_top, _ = sample_tokens(logits, neg_entropy=True, top_k=50)
    assert (ent_top > ent_full).all()  # less spread: a higher negative entropy


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [None, 0.2])
def test_fast_dllm_dream_block_cache(dream_dirs, dtype, cache, threshold):
    params = dict(gen_length=16, steps=8, block_length=8, schedule="dream")
    if threshold is None:
        params["remasking"] = "entropy"  # Fast-dLLM's Dream cache ranks by negative entropy
    else:
        params |= dict(threshold=threshold, remasking="low_confidence")
    ours = run_engine(engine(dream_dirs[dtype], dtype), PROMPTS, kv_cache=cache, **params)
    model = DreamReference(dream_dirs[dtype], DTYPES[dtype])
    refs = []
    for p in PROMPTS:
        ref = dream_generate_cached(model, torch.tensor([p]), steps=8, gen_length=16, block_length=8,
                                    mask_id=TINY_MASK, threshold=threshold, dual_cache=cache == "dual")
        refs.append((ref, None, len(p)))
    assert_rows_equal(ours, refs)


# ---------------------------------------------------------------- config strictness

@pytest.mark.parametrize("key,value", [("alibi", True), ("include_bias", True), ("block_type", "sequential"),
                                       ("attention_layer_norm", True), ("rope_full_precision", False)])
def test_llada_config_options_the_model_does_not_implement_are_refused(tmp_path, key, value):
    folder = write_llada_checkpoint(tmp_path, **{key: value})
    with pytest.raises(ModelLoadError, match=key):
        engine(folder, "float32")


def test_dream_config_options_the_model_does_not_implement_are_refused(tmp_path):
    folder = write_dream_checkpoint(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"rope_scaling": {"type": "linear", "factor": 2.0}}))
    with pytest.raises(ModelLoadError, match="rope_scaling"):
        engine(folder, "float32")


# ---------------------------------------------------------------- the command line

RUN_CASES = {  # name: (family, dtype, CLI flags, reference)
    "llada-fixed-fp32": ("llada", "float32", ["--steps", "8", "--block-length", "4"],
                         lambda m, ids: llada_generate(m, ids, steps=8, gen_length=16, block_length=4, mask_id=TINY_MASK)),
    "fast-dllm-dual-threshold-bf16": ("llada", "bfloat16", ["--steps", "16", "--block-length", "8", "--threshold", "0.2",
                                                            "--kv-cache", "dual"],
                                      lambda m, ids: llada_generate(m, ids, steps=16, gen_length=16, block_length=8,
                                                                    mask_id=TINY_MASK, threshold=0.2, cache="dual")),
    "dream-entropy-bf16": ("dream", "bfloat16", ["--steps", "8", "--block-length", "16", "--schedule", "dream",
                                                 "--remasking", "entropy"],
                           lambda m, ids: dream_generate(m, ids, steps=8, gen_length=16, mask_id=TINY_MASK,
                                                         alg="entropy", top_k=50)),  # Dream's default top_k
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RUN_CASES))
def test_celeris_run_json_equals_the_published_loops(llada_dirs, dream_dirs, case):
    family, dtype, flags, reference = RUN_CASES[case]
    folder = (llada_dirs if family == "llada" else dream_dirs)[dtype]
    prompt = "It is a truth universally acknowledged"
    out = subprocess.run(
        [sys.executable, "-m", "celeris.server.cli", "run", "--model", str(folder), "--dtype", dtype, "--prompt", prompt,
         "--gen-length", "16", "--temperature", "0", "--json", *flags], capture_output=True, text=True, timeout=300,
        check=True)
    got = json.loads(out.stdout)
    llm = engine(folder, dtype)
    ids = llm.encode_prompt(prompt)
    model = (LLaDAReference if family == "llada" else DreamReference)(folder, DTYPES[dtype])
    ref = reference(model, torch.tensor([ids]))
    assert got["token_ids"] == llm.tokenizer.until_stop(ref[0, len(ids):].tolist())
    assert got["kv_cache"] == ("dual" if "--kv-cache" in flags else "none")
