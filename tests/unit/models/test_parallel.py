"""Tensor and expert parallelism (engine/parallel, #32): size 2 decodes what size 1 decodes.

Every family's tiny random checkpoint (LLaDA, Dream, SDAR, LLaDA2-MoE) and both embedded models
decode a batch of prompts of different lengths at tensor-parallel size 1 and 2 (gloo, float32)
and must agree token for token; the MoE model also with expert parallelism, and the full-canvas
model with its approximate KV caches (the workers mirror the store). The size checks and split
rules are checked without processes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from celeris.engine.config import EngineConfig, ModelConfig
from celeris.engine.errors import ModelLoadError
from celeris.engine.llm import LLM
from celeris.engine.parallel.group import Plan, check_sizes
from celeris.engine.parallel.shard import COLUMN, KV, RANK0, ROW, WHOLE, how, shard_config
from tests.unit.block_references.checkpoints import write_llada2_checkpoint, write_sdar_checkpoint
from tests.unit.references.checkpoints import write_dream_checkpoint, write_llada_checkpoint

IDS = [[17, 301, 45], [88, 5, 640, 31, 77, 402, 15, 9], [12, 33, 999, 4, 58, 61, 700, 13, 90, 210, 6]]
TEXT = ["1 + 2 =", "The cat sat on the", "Once upon a time there was"]
PARAMETERS: dict[str, int] = {}
WRITERS = {"llada": write_llada_checkpoint, "dream": write_dream_checkpoint, "sdar": write_sdar_checkpoint,
           "llada2": write_llada2_checkpoint}


def decode(folder, tp: int = 1, ep: bool = False, prompts=IDS, **params) -> list[list[int]]:
    llm = LLM.load(folder, EngineConfig(max_batch=4, max_prompt_tokens=32, max_gen_length=16,
                                        tensor_parallel_size=tp, expert_parallel=ep))
    try:
        PARAMETERS.setdefault(str(folder), llm.parameter_count)
        assert llm.parameter_count == PARAMETERS[str(folder)]  # the whole model's at every size
        p = replace(llm.defaults, gen_length=16, block_length=8, steps=8, **params)
        return [r.token_ids for r in llm.generate(prompts, p)]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: write(root / name) for name, write in WRITERS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2"])
def test_tp2_decodes_what_tp1_decodes(checkpoints, family):
    one = decode(checkpoints[family])
    assert decode(checkpoints[family], tp=2) == one
    assert any(one)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["celeris-tiny", "celeris-tiny-block"])
def test_tp2_embedded_models(name):
    assert decode(name, tp=2, prompts=TEXT) == decode(name, prompts=TEXT)


@pytest.mark.slow
def test_ep2_decodes_what_one_rank_decodes(checkpoints):
    assert decode(checkpoints["llada2"], tp=2, ep=True) == decode(checkpoints["llada2"])


@pytest.mark.slow
def test_tp4_replicates_kv_heads_when_fewer_than_ranks(checkpoints):
    # LLaDA2 tiny: 4 query heads, 2 key/value heads, 8 experts; at size 4 each kv head lives on two ranks.
    assert decode(checkpoints["llada2"], tp=4, prompts=IDS[:2]) == decode(checkpoints["llada2"], prompts=IDS[:2])


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_tp2_with_kv_cache(checkpoints, cache):
    assert decode(checkpoints["dream"], tp=2, kv_cache=cache) == decode(checkpoints["dream"], kv_cache=cache)


def test_sizes_that_do_not_divide_are_refused_by_name():
    cfg = ModelConfig(n_heads=4, n_kv_heads=2, d_model=64, embedding_size=1024, vocab_size=1024, mlp_hidden_size=96)
    with pytest.raises(ModelLoadError, match="key/value heads"):
        check_sizes(replace(cfg, n_heads=6, n_kv_heads=3, d_model=60), Plan(2))
    check_sizes(cfg, Plan(4))  # 2 kv heads over 4 ranks: replicated
    with pytest.raises(ModelLoadError, match="vocabulary"):
        check_sizes(replace(cfg, embedding_size=1025), Plan(2))
    with pytest.raises(ModelLoadError, match="MLP hidden size"):
        check_sizes(replace(cfg, mlp_hidden_size=97), Plan(2))
    moe = replace(cfg, n_kv_heads=4, num_experts=6, experts_per_token=2, moe_hidden_size=32, n_group=3, topk_group=1)
    with pytest.raises(ModelLoadError, match="experts"):
        check_sizes(moe, Plan(4, expert_parallel=True))
    with pytest.raises(ModelLoadError, match="mixture-of-experts"):
        check_sizes(cfg, Plan(2, expert_parallel=True))
    check_sizes(moe, Plan(2, expert_parallel=True))


def test_load_refuses_before_starting_workers(checkpoints):
    with pytest.raises(ModelLoadError, match="attention heads"):  # 4 heads over 3 ranks
        LLM.load(checkpoints["llada"], EngineConfig(tensor_parallel_size=3))


@pytest.mark.slow
def test_a_worker_that_dies_before_joining_fails_the_load(checkpoints, monkeypatch):
    monkeypatch.setenv("CELERIS_WORKER_THREADS", "not-a-number")  # the worker raises before the rendezvous
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        LLM.load(checkpoints["llada"], EngineConfig(tensor_parallel_size=2))


def test_split_rules():
    tp, ep = Plan(2), Plan(2, expert_parallel=True)
    assert how("transformer.wte.weight", tp) == COLUMN
    assert how("transformer.ff_out.weight", tp) == COLUMN  # the head: vocabulary rows
    assert how("transformer.blocks.0.q_proj.bias", tp) == COLUMN
    assert how("transformer.blocks.0.k_proj.bias", tp) == KV
    assert how("transformer.blocks.0.attn_out.weight", tp) == ROW
    assert how("transformer.blocks.0.attn_out.bias", tp) == RANK0
    assert how("transformer.blocks.0.ff_out.weight", tp) == ROW
    assert how("transformer.blocks.1.mlp.experts.3.ff_out.weight", tp) == ROW
    assert how("transformer.blocks.1.mlp.experts.3.ff_out.weight", ep) == WHOLE
    assert how("transformer.blocks.1.mlp.shared_experts.up_proj.weight", ep) == WHOLE
    assert how("transformer.blocks.1.mlp.gate.weight", tp) == WHOLE
    assert how("transformer.blocks.0.q_norm.weight", tp) == WHOLE
    cfg = ModelConfig(n_heads=4, n_kv_heads=2, d_model=64, embedding_size=1024, vocab_size=1000)
    local = shard_config(cfg, tp)
    assert (local.n_heads, local.n_kv_heads, local.head_dim, local.embedding_size) == (2, 1, 16, 512)
