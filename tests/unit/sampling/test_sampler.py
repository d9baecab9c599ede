"""Decoding: reference mode against LLaDA's algorithm, batched mode against reference mode."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.sampling.params import SamplingParams
from celeris.engine.sampling.params import SamplingParams as _P
from celeris.engine.sampling.reference import reference_generate
from celeris.engine.sampling.schedule import transfer_schedule
from celeris.engine.sampling.select import select_tokens
from celeris.engine.sampling.batch import RowKnobs, SamplingBatch, SelectionRule, Window
from tests.unit.llada_reference import llada_generate

COMBOS = [  # (steps, gen_length, block_length): one block, several blocks, uneven n % steps
    (8, 8, 8), (4, 8, 4), (16, 16, 4), (3, 8, 8), (6, 12, 4), (10, 20, 10), (4, 16, 16),
]


def fwd(model):
    return lambda ids, mask: model(ids, key_mask=None if mask is None else mask.bool())


def prompt_ids(llm, text="It is a truth universally acknowledged"):
    return llm.encode_prompt(text)


def test_transfer_schedule_matches_published_rule():
    assert transfer_schedule(8, 3) == [3, 3, 2]
    assert transfer_schedule(32, 32) == [1] * 32
    assert sum(transfer_schedule(13, 5)) == 13


@pytest.mark.parametrize("steps,gen_length,block_length", COMBOS)
def test_reference_mode_is_token_identical_to_llada(tiny_llm, steps, gen_length, block_length):
    p = torch.tensor([prompt_ids(tiny_llm)])
    params = SamplingParams(gen_length=gen_length, steps=steps, block_length=block_length, stop_at_eos=False)
    ours, nfe = reference_generate(fwd(tiny_llm.model), p, params, tiny_llm.tokenizer.mask_id)
    theirs = llada_generate(fwd(tiny_llm.model), p, steps, gen_length, block_length, tiny_llm.tokenizer.mask_id)
    assert torch.equal(ours, theirs)
    assert nfe == steps
    assert (ours != tiny_llm.tokenizer.mask_id).all()


@pytest.mark.parametrize("steps,gen_length,block_length", COMBOS)
def test_batched_mode_matches_llada(tiny_llm, steps, gen_length, block_length):
    ids = prompt_ids(tiny_llm)
    params = SamplingParams(gen_length=gen_length, steps=steps, block_length=block_length, stop_at_eos=False, seed=0)
    theirs = llada_generate(fwd(tiny_llm.model), torch.tensor([ids]), steps, gen_length, block_length,
                            tiny_llm.tokenizer.mask_id)
    seq = tiny_llm.sequence(ids, params)
    tiny_llm.loop.add(seq)
    tiny_llm.loop.run_to_completion()
    assert seq.canvas == theirs[0, len(ids):].tolist()
    assert seq.nfe == steps


def test_mixed_batch_each_row_matches_its_solo_reference(tiny_llm):
    """Different prompt lengths and different settings share every forward pass."""
    mask = tiny_llm.tokenizer.mask_id
    cases = [("It is a truth", (8, 16, 4)), ("Emma Woodhouse, handsome, clever, and rich", (12, 24, 8)),
             ("12+34=", (4, 8, 8)), ("must be in want of a wife", (16, 16, 16))]
    seqs, expected = [], []
    for text, (steps, g, b) in cases:
        ids = prompt_ids(tiny_llm, text)
        expected.append(llada_generate(fwd(tiny_llm.model), torch.tensor([ids]), steps, g, b, mask)[0, len(ids):])
        seqs.append(tiny_llm.sequence(ids, SamplingParams(gen_length=g, steps=steps, block_length=b,
                                                          stop_at_eos=False, seed=1)))
    for s in seqs:
        tiny_llm.loop.add(s)
    steps_run = 0
    while not tiny_llm.loop.idle:
        tiny_llm.loop.step()
        steps_run += 1
    for s, e in zip(seqs, expected):
        assert s.canvas == e.tolist()
    assert steps_run == max(c[1][0] for c in cases)  # one forward served all rows


def test_left_padded_reference_batch_matches_solo_runs(tiny_llm):
    mask, pad = tiny_llm.tokenizer.mask_id, tiny_llm.tokenizer.pad_id
    prompts = [prompt_ids(tiny_llm, t) for t in ("It is a truth", "Emma Woodhouse, handsome, clever")]
    width = max(map(len, prompts))
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    params = SamplingParams(gen_length=8, steps=8, block_length=4, stop_at_eos=False)
    together, _ = reference_generate(fwd(tiny_llm.model), batch, params, mask, attention_mask=attn)
    for row, p in enumerate(prompts):
        solo = llada_generate(fwd(tiny_llm.model), torch.tensor([p]), 8, 8, 4, mask)
        assert together[row, width:].tolist() == solo[0, len(p):].tolist()


@pytest.mark.parametrize("cfg_scale", [0.5, 2.0])
def test_classifier_free_guidance_matches_llada(tiny_llm, cfg_scale):
    ids = prompt_ids(tiny_llm)
    mask = tiny_llm.tokenizer.mask_id
    theirs = llada_generate(fwd(tiny_llm.model), torch.tensor([ids]), 8, 8, 4, mask, cfg_scale=cfg_scale)
    params = SamplingParams(gen_length=8, steps=8, block_length=4, cfg_scale=cfg_scale, stop_at_eos=False, seed=0)
    ours, _ = reference_generate(fwd(tiny_llm.model), torch.tensor([ids]), params, mask)
    assert torch.equal(ours, theirs)
    seq = tiny_llm.sequence(ids, params)
    plain = tiny_llm.sequence(ids, SamplingParams(gen_length=8, steps=8, block_length=4, stop_at_eos=False, seed=0))
    tiny_llm.loop.add(seq)
    tiny_llm.loop.add(plain)  # a guided and an unguided request in the same batch
    tiny_llm.loop.run_to_completion()
    assert seq.canvas == theirs[0, len(ids):].tolist()


@pytest.mark.parametrize("extra", [dict(threshold=0.3), dict(threshold=0.9), dict(factor=1.0),
                                   dict(temperature=0.9, seed=7), dict(remasking="random", seed=3),
                                   dict(remasking="margin"), dict(remasking="entropy")])
def test_batched_mode_matches_reference_mode_for_every_decoder(tiny_llm, extra):
    ids = prompt_ids(tiny_llm)
    params = SamplingParams(gen_length=16, steps=16, block_length=8, stop_at_eos=False, **({"seed": 0} | extra))
    ref, nfe = reference_generate(fwd(tiny_llm.model), torch.tensor([ids]), params, tiny_llm.tokenizer.mask_id)
    seq = tiny_llm.sequence(ids, params)
    tiny_llm.loop.add(seq)
    tiny_llm.loop.run_to_completion()
    assert seq.canvas == ref[0, len(ids):].tolist()
    assert seq.nfe == nfe


def _select(conf_logits, k=None, threshold=0.0, factor=0.0, rule=None):
    """Run select_tokens on one row whose x0 probabilities are given by conf_logits (W, V)."""
    logits = conf_logits[None]
    W = logits.shape[1]
    params = _P(threshold=threshold or None, factor=factor or None, factor_rule=rule or "fast_dllm")
    batch = SamplingBatch.build([RowKnobs(params, k or 0, 0, frozenset())], 1, logits.shape[-1], logits.device)
    pos = torch.arange(W)[None]
    window = Window(torch.full((1, W), 99), torch.ones(1, W, dtype=torch.bool), pos, pos)
    sel = select_tokens(logits, batch, window, SelectionRule(mask_id=3))  # V = 4: never the top-1
    return sel.x0, sel.commit, sel.conf


def peaked(probs):
    """Logits whose softmax top-1 probabilities are `probs` (V = 4)."""
    rows = []
    for p in probs:
        rest = (1 - p) / 3
        rows.append(torch.log(torch.tensor([p, rest, rest, rest])))
    return torch.stack(rows)


def test_threshold_commits_top1_plus_every_confident_token():
    _, commit, conf = _select(peaked([0.95, 0.5, 0.97, 0.6, 0.91]), threshold=0.9)
    assert commit[0].tolist() == [True, False, True, False, True]
    _, commit, _ = _select(peaked([0.4, 0.5, 0.3]), threshold=0.9)  # nobody clears it: top-1 alone
    assert commit[0].tolist() == [False, True, False]


def test_factor_rule_commits_largest_n_with_bound():
    # sorted confidences 0.99, 0.95, 0.8, 0.6: (n+1)(1-c_n) = 0.02, 0.15, 0.8, 1.6 -> n=2 for f=0.5
    _, commit, _ = _select(peaked([0.8, 0.99, 0.6, 0.95]), factor=0.5)
    assert commit[0].tolist() == [False, True, False, True]


def test_ties_break_towards_lower_positions():
    _, commit, _ = _select(peaked([0.7, 0.7, 0.9, 0.7, 0.7]), k=3)
    assert commit[0].tolist() == [True, True, True, False, False]


def test_seed_reproducible_alone_and_inside_any_batch(tiny_llm):
    ids = prompt_ids(tiny_llm)
    params = SamplingParams(gen_length=16, steps=8, block_length=8, temperature=1.0, seed=1234, stop_at_eos=False)
    alone = tiny_llm.generate([ids], params)[0]
    again = tiny_llm.generate([ids], params)[0]
    others = [prompt_ids(tiny_llm, t) for t in ("Emma", "12+34=", "must be in want")]
    batched = tiny_llm.generate(others[:2] + [ids] + others[2:], params)[2]
    assert alone.token_ids == again.token_ids == batched.token_ids
    other_seed = tiny_llm.generate([ids], SamplingParams(**{**params.__dict__, "seed": 99}))[0]
    assert other_seed.token_ids != alone.token_ids  # the seed really drives sampling


def test_unseeded_request_reports_the_seed_it_used(tiny_llm):
    ids = prompt_ids(tiny_llm)
    params = SamplingParams(gen_length=8, steps=8, block_length=8, temperature=1.0, stop_at_eos=False)
    first = tiny_llm.generate([ids], params)[0]
    replay = tiny_llm.generate([ids], SamplingParams(**{**params.__dict__, "seed": first.seed}))[0]
    assert replay.token_ids == first.token_ids


def test_nan_confidences_never_stall_a_request(tiny_llm):
    """Guidance that overflows to NaN logits (a huge but finite cfg_scale) still commits at least one
    token per step under every rule, so the request ends."""
    ids = prompt_ids(tiny_llm)
    for extra in (dict(factor=2.75), dict(threshold=0.9), {}):
        params = SamplingParams(gen_length=16, steps=8, block_length=2, cfg_scale=3.4e38, seed=0, **extra)
        seq = tiny_llm.sequence(ids, params)
        tiny_llm.loop.add(seq)
        for _ in range(64):
            if tiny_llm.loop.idle:
                break
            tiny_llm.loop.step()
        assert seq.finished and seq.nfe <= 16
