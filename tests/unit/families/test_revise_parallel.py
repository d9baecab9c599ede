"""DiffusionGemma over tensor and expert parallelism (engine/families/revise/parallel.py, issue 62):
size 2 decodes what one process decodes, token for token, on gloo (float32), for a batch of mixed
requests (prompts, lengths, seeds, sampler settings, a whole-document schema), with the experts
split by hidden size (TP) or whole per rank (EP); the size checks and the split are checked without
processes.

A tiny random DiffusionGemma checkpoint written by transformers' classes with celeris-tiny's
byte-level BPE tokenizer: 4 query heads, 2 key/value heads on sliding layers, 1 on global ones
(replicated at size 2), 4 experts of hidden size 16.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.errors import ModelLoadError  # noqa: E402
from celeris.engine.families.revise.parallel import check_gemma_sizes, split  # noqa: E402
from celeris.engine.families.revise.rows import Packed  # noqa: E402
from celeris.engine.families.revise.weights import load_gemma  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.parallel.group import Plan  # noqa: E402
from celeris.engine.requests import Request  # noqa: E402
from celeris.engine.structured.constraint import Structured  # noqa: E402
from tests.unit.document_schemas import DOCUMENT_SCHEMAS  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint  # noqa: E402

ASKS = [("It was a", 16, 0, {}), ("Once upon a time there", 24, 1, {"t_max": 0.5, "entropy_bound": 0.5}),
        ("Q", 8, 2, {"max_denoising_steps": 2})]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_bpe_checkpoint(tmp_path_factory.mktemp("dg-tp"), canvas_length=8, seed=3)


def decode(folder, tp: int = 1, ep: bool = False) -> list[list[int]]:
    llm = LLM.load(folder, EngineConfig(max_batch=4, max_queue=8, max_prompt_tokens=64, max_gen_length=64,
                                        tensor_parallel_size=tp, expert_parallel=ep))
    try:
        seqs = [llm.build(Request(prompt=p, params=replace(llm.defaults, **(dict(
            gen_length=n, block_length=n, steps=1, seed=s, max_denoising_steps=4, ignore_eos=True) | kw))))
            for p, n, s, kw in ASKS]
        doc = replace(llm.defaults, gen_length=48, block_length=48, steps=1, seed=5, max_denoising_steps=3)
        seqs.append(llm.build(Request(prompt="JSON:", params=doc, structured=Structured(
            "json_schema", DOCUMENT_SCHEMAS["rows_of_pets"], "s"))))
        outs = llm.run(seqs)
        json.loads(outs[-1].text)  # the document still closes
        return [o.token_ids for o in outs]
    finally:
        llm.close()


@pytest.mark.slow  # three loads, two of them spawning a worker: tens of seconds on 2 loaded cores
def test_tp2_and_ep2_decode_what_one_process_decodes(folder):
    one = decode(folder)
    assert decode(folder, tp=2) == one
    assert decode(folder, tp=2, ep=True) == one


def test_sizes_that_do_not_divide_are_refused_by_name(folder):
    with pytest.raises(ModelLoadError, match="attention heads"):
        check_gemma_sizes(folder, Plan(3))
    check_gemma_sizes(folder, Plan(4))  # global layers' one key/value head: replicated on every rank
    with pytest.raises(ModelLoadError, match="expert-parallel"):
        check_gemma_sizes(folder, Plan(1, expert_parallel=True))
    check_gemma_sizes(folder, Plan(2, expert_parallel=True))
    with pytest.raises(ModelLoadError, match="attention heads"):  # refused before any worker starts
        LLM.load(folder, EngineConfig(tensor_parallel_size=3))


class _Kept:
    """A rank's collectives without processes: the all-reduce leaves its partial sum as it is."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial


@pytest.mark.parametrize("ep", [False, True])
def test_the_ranks_partial_sums_add_up_to_the_whole(folder, ep):
    """Without processes: each rank's slice of a layer's dense GLU, routed experts and attention
    output projection gives a partial sum; the two ranks' add up to one process's output."""
    whole = load_gemma(folder)
    shards = [split(load_gemma(folder), Plan(2, ep), _Kept(r, 2)) for r in range(2)]
    layer = whole.layers[0]
    torch.manual_seed(0)
    x = torch.randn(6, whole.cfg.d_model)  # (N, D)
    rows = Packed((6,))
    w, idx = layer.router(x)
    with torch.no_grad():
        experts = [s.layers[0].experts(x, w, idx, rows) for s in shards]
        dense = [s.layers[0].mlp(x[None], rows) for s in shards]
        heads = layer.self_attn.o_proj.weight.shape[1]
        attn_in = torch.randn(1, 6, heads)
        halves = attn_in.split(heads // 2, dim=-1)
        attn = [s.layers[0].self_attn.out([h]) for s, h in zip(shards, halves)]
        assert torch.allclose(experts[0] + experts[1], layer.experts(x, w, idx, rows), atol=1e-5)
        assert torch.allclose(dense[0] + dense[1], layer.mlp(x[None], rows), atol=1e-5)
        assert torch.allclose(attn[0] + attn[1], layer.self_attn.out([attn_in]), atol=1e-5)
    held = [s.layers[0].experts.gate_up_proj.shape for s in shards]
    assert held == [(2, 32, whole.cfg.d_model)] * 2 if ep else [(4, 16, whole.cfg.d_model)] * 2


class _Channel:
    def __init__(self):
        self.sent: list[tuple] = []

    def send(self, op: str, payload) -> None:
        self.sent.append((op, payload))


def test_the_leader_sends_each_forwards_inputs_and_the_caches_it_dropped(folder):
    """Without processes: each forward's message names its caches by number and carries the
    self-conditioning input as (L, D) rows; a cache the leader drops is named with the next call."""
    import gc

    from celeris.engine.families.revise.model import KVCache
    from celeris.engine.families.revise.parallel import GemmaMirror

    model, channel = load_gemma(folder), _Channel()
    mirror = GemmaMirror(model, channel, close=lambda: None)
    a, b = KVCache(model.cfg), KVCache(model.cfg)
    mirror.encode_rows([torch.tensor([1, 40, 41, 42]), torch.tensor([1, 50, 51, 52, 53])], [a, b])
    L, V = model.cfg.canvas_length, model.cfg.vocab_size
    sc = torch.softmax(torch.randn(L, V), -1)
    hidden = mirror.denoise_hidden(torch.zeros(2, L, dtype=torch.long), [a, b], [None, sc])
    assert torch.equal(hidden, model.denoise_hidden(torch.zeros(2, L, dtype=torch.long), [a, b], [None, sc]))
    (op1, (dropped1, _, (ids, numbers1))), (op2, (_, _, (canvas, numbers2, soft))) = channel.sent
    assert (op1, op2, dropped1, numbers1, numbers2) == ("encode", "denoise", [], [0, 1], [0, 1])
    assert soft[0] is None and soft[1].shape == (L, model.cfg.d_model)
    del a
    gc.collect()
    mirror.encode_rows([torch.tensor([1, 60, 61, 62])], [KVCache(model.cfg)])
    op3, (dropped3, _, (_, numbers3)) = channel.sent[-1]
    assert dropped3 == [0] and numbers3 == [2]
