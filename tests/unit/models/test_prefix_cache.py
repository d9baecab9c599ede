"""The prefix cache across requests and chunked prefill of the block families (engine/models/prefix_cache.py,
engine/families/block/chunked_prefill.py): exact, bounded, salted.

Exactness rests on one property, checked first and bitwise: a prompt block's keys/values do not
depend on the chunk that prefilled it. The rest follows from it and is checked token for token:
a 4-turn chat sharing a 400-token prefix decodes the same with the cache on and off, alone and
inside a batch of 8 other requests, on celeris-tiny-block and random SDAR / LLaDA2 checkpoints.
"""

from __future__ import annotations

import random
import resource

import pytest
import torch

from celeris.engine.families.block.runner import BlockRunner
from celeris.engine.families.block.sequence import PREFILL
from celeris.engine.config import EngineConfig
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams
from celeris.engine.models.prefix_cache import PrefixCache, chain
from tests.unit.block_references.checkpoints import write_llada2_checkpoint, write_sdar_checkpoint

PARAMS = dict(gen_length=16, block_length=4, steps=16, seed=0)


@pytest.fixture(scope="module", params=["celeris-tiny-block", "sdar", "llada2"])
def folder(request, tmp_path_factory):
    writers = {"sdar": write_sdar_checkpoint, "llada2": write_llada2_checkpoint}
    if request.param in writers:
        return writers[request.param](tmp_path_factory.mktemp(request.param), seed=0)
    return request.param


def engine(folder, cache_bytes: int = 64 << 20, chunk: int = 256, chunked: bool = True, batch: int = 9) -> LLM:
    return LLM.load(folder, EngineConfig(max_batch=batch, max_queue=256, max_prompt_tokens=512, max_gen_length=32,
                                         prefill_chunk=chunk, prefix_cache_bytes=cache_bytes, chunked_prefill=chunked))


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], salt: str = "", **params) -> list:
    seqs = [llm.sequence(p, SamplingParams(**{**PARAMS, **params})) for p in prompts]
    for s in seqs:
        s.cache_salt = salt
        llm.loop.add(s)
    llm.loop.run_to_completion()
    return seqs


def prefill_kv(llm: LLM, prompt: list[int]) -> list[torch.Tensor]:
    """Each layer's (2, Hk, P, Dh) keys/values of the prompt's whole blocks, prefilled cold."""
    s = llm.sequence(prompt, SamplingParams(**PARAMS))
    llm.loop.add(s)
    while s.phase == PREFILL:
        llm.loop.step()
    P = s.first_block * PARAMS["block_length"]
    kv = llm.runner.kv
    out = [torch.stack([k[s.slot, :, :P], v[s.slot, :, :P]]).clone() for k, v in zip(kv.keys, kv.values)]
    llm.loop.run_to_completion()
    return out


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_prompt_blocks_keys_and_values_are_bitwise_the_same_in_any_chunk(folder):
    prompt = ids(150, seed=1)
    whole = prefill_kv(engine(folder, cache_bytes=0, chunk=256), prompt)
    for chunk in (4, 12, 40):
        chunked = prefill_kv(engine(folder, cache_bytes=0, chunk=chunk), prompt)
        assert all(torch.equal(a, b) for a, b in zip(whole, chunked)), chunk


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_four_turn_chat_decodes_the_same_with_the_cache_alone_and_in_a_batch(folder):
    cold, warm, batched = engine(folder, cache_bytes=0), engine(folder), engine(folder)
    others = [ids(20 + 7 * i, seed=100 + i) for i in range(8)]
    history = ids(400, seed=2)  # the shared prefix: a system prompt and tool definitions
    for turn in range(4):
        prompt = history + ids(12, seed=10 + turn)  # the user's next message
        want = run(cold, [prompt], temperature=0.7)[0]  # seeded sampling: the noise is keyed by step too
        got = run(warm, [prompt], temperature=0.7)[0]
        inside = run(batched, others + [prompt], temperature=0.7)[-1]  # the turn joins 8 other requests' steps
        assert got.generated() == want.generated() == inside.generated(), turn
        assert want.cached_tokens == 0
        if turn:  # turn 1 prefilled the shared blocks: later turns reuse at least those
            assert got.cached_tokens >= 400 - 400 % 4 and inside.cached_tokens >= 400 - 400 % 4
            assert got.nfe < want.nfe  # fewer prefill forwards
        history = prompt + want.generated()  # the answer joins the history, as a chat client sends it
    stats = warm.runner.prefixes.cache.stats()
    assert 0 < stats.hit_tokens < stats.queried_tokens and stats.bytes_used <= stats.budget_bytes


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_budget_of_a_few_mb_holds_while_200_distinct_prompts_evict():
    budget = 3 << 20
    llm = engine("celeris-tiny-block", cache_bytes=budget, batch=8)
    cache = llm.runner.prefixes.cache
    peak = 0
    for start in range(0, 200, 8):
        run(llm, [ids(128, seed=1000 + i) for i in range(start, start + 8)])
        assert cache.bytes_used <= budget
        peak = max(peak, cache.bytes_used)
    stats = cache.stats()
    per_prompt = 128 * 4 * 2 * 4 * 32 * 4  # tokens x layers x (k, v) x heads x head_dim x fp32
    assert stats.evictions >= (200 * per_prompt - budget) // (per_prompt // 32)  # every block beyond the budget
    assert stats.entries * (per_prompt // 32) == stats.bytes_used  # the accounting matches what is held
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"prefix cache: budget {budget >> 20} MiB, peak {peak / 2**20:.2f} MiB, {stats.evictions} evictions "
          f"of {200 * 32} blocks inserted, process max RSS {rss:.0f} MiB")


def test_cache_salt_separates_tenants():
    llm = engine("celeris-tiny-block")
    cache = llm.runner.prefixes.cache
    prompt = ids(200, seed=3)
    first = run(llm, [prompt], salt="tenant-a")[0]
    hits = cache.stats().hit_tokens
    other = run(llm, [prompt], salt="tenant-b")[0]
    assert cache.stats().hit_tokens == hits and other.cached_tokens == 0  # b never sees a's blocks
    again = run(llm, [prompt], salt="tenant-a")[0]
    assert again.cached_tokens == 200 and cache.stats().hit_tokens == hits + 200
    assert first.generated() == other.generated() == again.generated()


def test_keys_chain_over_the_prefix_salt_and_block_length():
    a = chain(list(range(12)), 4)
    assert len(a) == 3 and chain(list(range(12)) + [1, 2], 4) == a  # only whole blocks
    assert chain([0, 1, 2, 3, 9, 5, 6, 7], 4)[0] == a[0] and chain([0, 1, 2, 3, 9, 5, 6, 7], 4)[1] != a[1]
    assert chain(list(range(12)), 4, "s")[0] != a[0] and chain(list(range(12)), 2)[1] != a[0]


def test_lru_evicts_the_least_recently_used_block():
    cache = PrefixCache(budget_bytes=3 * 16)
    for k in (b"a", b"b", b"c"):
        cache.insert(k, torch.zeros(4))
    assert len(cache.lookup([b"a"], 1)) == 1  # a is now the most recent
    cache.insert(b"d", torch.zeros(4))
    assert not cache.has(b"b") and cache.has(b"a") and cache.evictions == 1 and cache.bytes_used == 48


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_long_prompt_prefills_in_small_chunks_while_others_denoise_and_decodes_the_same(folder):
    others = [ids(16, seed=200 + i) for i in range(8)]
    long = ids(480, seed=4)
    capped, whole = engine(folder, cache_bytes=0), engine(folder, cache_bytes=0, chunk=512, chunked=False)
    seqs = [capped.sequence(p, SamplingParams(**PARAMS)) for p in others + [long]]
    for s in seqs[:-1]:
        capped.loop.add(s)
    capped.loop.step()  # the short ones are denoising when the long one arrives
    capped.loop.add(seqs[-1])
    chunks = []  # prompt tokens the long request prefilled in each step, while any other row runs
    while seqs[-1].phase == PREFILL:
        before = seqs[-1].prefilled
        capped.loop.step()
        if any(not s.finished for s in seqs[:-1]):
            chunks.append(seqs[-1].prefilled - before)
    assert chunks and max(chunks) <= 8 * 4  # at most the 8 denoising rows' tokens of the step
    capped.loop.run_to_completion()
    ref = run(whole, others + [long])
    assert [s.generated() for s in seqs] == [s.generated() for s in ref]


@pytest.mark.slow  # over 1.5 s in CI: out of the fast tier
def test_one_forward_a_step_decodes_what_separate_forwards_decode(folder, monkeypatch):
    """The per-row path runs a step's prefill parts beside its block rows in one forward, and a
    prompt's last chunk with its first block's first denoise step: every selecting forward's
    logits are bitwise those of separate forwards (prefill, then block rows; the first block a
    step later), and so are the tokens."""
    others = [ids(16, seed=300 + i) for i in range(8)]
    long = ids(130, seed=6)

    def decode(fuse: bool):
        monkeypatch.setattr(BlockRunner, "fuses", property(lambda self: fuse))
        llm = engine(folder, cache_bytes=0)
        seqs = [llm.sequence(p, SamplingParams(**{**PARAMS, "temperature": 0.7})) for p in others + [long]]
        index = {s.request_id: i for i, s in enumerate(seqs)}
        seen: dict[int, list[torch.Tensor]] = {}
        select = llm.runner._select

        def spy(rows, logits, *rest):
            for r, s in enumerate(rows):
                a, e = s.block_window
                seen.setdefault(index[s.request_id], []).append(logits[r, :e - a].clone())
            return select(rows, logits, *rest)
        llm.runner._select = spy
        for s in seqs[:-1]:
            llm.loop.add(s)
        llm.loop.step()  # the short ones denoise when the long one arrives
        llm.loop.add(seqs[-1])
        llm.loop.run_to_completion()
        return [s.generated() for s in seqs], [s.nfe for s in seqs], seen

    fused, fused_nfe, fused_logits = decode(True)
    apart, apart_nfe, apart_logits = decode(False)
    assert fused == apart
    # The short prompts prefill in one step: one forward less each. (The long one's chunks follow
    # how many rows denoise beside it, which the streams' one-step lead changes.)
    assert [n + 1 for n in fused_nfe[:-1]] == apart_nfe[:-1]
    assert fused_logits.keys() == apart_logits.keys()
    for i, want in apart_logits.items():
        assert len(fused_logits[i]) == len(want) and all(torch.equal(a, b) for a, b in zip(fused_logits[i], want)), i


def test_both_doors_pass_the_salt_and_report_cached_tokens():
    from celeris.engine.events import StepEvent
    from celeris.server.grpc.convert import engine_request
    from celeris.server.http.openai_api import engine_requests, parse_request
    from celeris.server.http.openai_responses import usage
    from celeris.v1 import generation_pb2 as pb

    defaults = SamplingParams()
    assert engine_request(pb.GenerateRequest(prompt="hi", cache_salt="t1"), defaults).cache_salt == "t1"
    assert engine_request(pb.GenerateRequest(prompt="hi"), defaults).cache_salt is None
    body = parse_request({"prompt": "hi", "cache_salt": "t2"}, defaults, chat=False)
    assert engine_requests(body, "r")[0].cache_salt == "t2"
    ev = StepEvent("r", 0, 1, 0, 1, (), (), (), (), 0, 0, 1, 1, 0, prompt_tokens=40, cached_tokens=32)
    assert usage(ev)["prompt_tokens_details"] == {"cached_tokens": 32}
