"""Typed decisions (engine/sampling/choice.py): a choice asked with logprobs gets a probability per
option, the softmax over the options of their tokens' summed log-probabilities in the forward that
commits the slot's first token (filler past each option's end, up to one past the longest). The
numbers sum to 1, match a hand computation, are the same alone and beside other requests, and
asking for them changes no token; they decide the option written (the most probable at temperature
0, a seeded draw from them when sampling: one decision, one computation); on DiffusionGemma too (its
first canvas's commit step)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import EMBEDDED_MODELS, LLM
from celeris.engine.requests import Request
from celeris.engine.sampling.choice import decide, option_probabilities
from celeris.engine.structured.constraint import Structured

OPTIONS = ["yes", "no", "maybe", "yesno"]  # one a prefix of another


def test_option_probabilities_match_a_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.3, 3.0, 1.0]])  # (H=2, V=4)
    ids = torch.tensor([[1, 2], [0, 3], [2, 2]])  # three options, filler 2 past the first's end
    p = option_probabilities(logits, ids)

    def lp(i, t):
        row = logits[i].tolist()
        return row[t] - math.log(sum(math.exp(x) for x in row))

    s = [lp(0, a) + lp(1, b) for a, b in ids.tolist()]
    want = [math.exp(x - max(s)) for x in s]
    want = [w / sum(want) for w in want]
    assert p.dtype == torch.float64 and p.tolist() == pytest.approx(want, abs=1e-12)
    assert abs(sum(p.tolist()) - 1) < 1e-12


def test_option_probabilities_sum_to_one_and_never_nan():
    torch.manual_seed(0)
    for K, H, V in ((2, 1, 7), (5, 4, 300), (256, 9, 1000)):
        p = option_probabilities(torch.randn(H, V) * 20, torch.randint(0, V, (K, H)))
        assert abs(p.sum().item() - 1) < 1e-9
    ninf = torch.full((2, 5), float("-inf"))
    ninf[:, 0] = 0.0
    assert option_probabilities(ninf, torch.tensor([[1, 2], [3, 4]])).tolist() == [0.5, 0.5]


@pytest.fixture(scope="module", params=["celeris-tiny", "celeris-tiny-block"])
def llm(request):
    return LLM.load(EMBEDDED_MODELS[request.param])


def _params(llm, **kw):
    """A short canvas, one block; a block model's first block also holds the prompt's tail."""
    n = 8 if llm.family.kind == "full" else 16
    return replace(llm.defaults, **{"gen_length": n, "steps": n, "block_length": n, "seed": 3, **kw})


def _choice(llm, params, prompt="Is it?"):
    return llm.build(Request(prompt=prompt, params=params, structured=Structured("choice", OPTIONS, "choice")))


def _others(llm, n):
    return [llm.build(Request(prompt="Once upon a time " * (k + 1), params=_params(llm, temperature=0.7, seed=k)))
            for k in range(n)]


def _alone_and_batched(llm, sizes):
    alone = llm.run([_choice(llm, _params(llm, logprobs=0))])[0]
    probs = alone.choice_probabilities
    assert list(probs) == OPTIONS and abs(sum(probs.values()) - 1) < 1e-6
    assert all(0 < v < 1 for v in probs.values())
    plain = llm.run([_choice(llm, _params(llm))])[0]
    assert plain.choice_probabilities is None and plain.text in OPTIONS  # not asked: none
    assert alone.text == max(probs, key=probs.get)  # asked: the option they rank first (temperature 0)
    for n in sizes:  # n + 1 rows in the forward
        others = _others(llm, n)
        mixed = llm.run(others[:1] + [_choice(llm, _params(llm, logprobs=0))] + others[1:])
        assert mixed[1].choice_probabilities == probs and mixed[1].token_ids == alone.token_ids  # bit for bit
        free = llm.run(_others(llm, n))
        assert [r.token_ids for r in free] == [r.token_ids for r in mixed[:1] + mixed[2:]]  # free rows untouched


def test_probabilities_sum_to_one_and_are_the_same_alone_and_batched(llm):
    _alone_and_batched(llm, (2,))


@pytest.mark.slow
def test_probabilities_are_the_same_in_batches_of_two_to_seven(llm):
    _alone_and_batched(llm, (1, 3, 4, 6))


PROMPTS = ["Is it?", "Yes or no?", "Maybe?", "Is the sky green?", "Do cats bark?"]


def test_the_option_written_is_the_most_probable_at_temperature_0_in_50_requests(llm):
    """50 requests (5 prompts x 10 seeds), ten to a batch beside a free request: each writes the
    option its probabilities rank first."""
    asked = [(prompt, seed) for prompt in PROMPTS for seed in range(10)]
    results = []
    for at in range(0, len(asked), 10):
        seqs = [_choice(llm, _params(llm, logprobs=0, temperature=0.0, seed=seed), prompt)
                for prompt, seed in asked[at:at + 10]]
        results += llm.run(seqs + _others(llm, 1))[:len(seqs)]
    assert len(results) == 50
    wrong = [(r.text, r.choice_probabilities) for r in results if r.text != max(r.choice_probabilities,
                                                                                  key=r.choice_probabilities.get)]
    assert not wrong


def test_sampling_draws_the_option_from_the_probabilities_with_the_seed(llm):
    """At temperature 1 the option is the seeded draw from the probabilities the answer reports:
    the same seed draws the same option, alone or batched, and other seeds draw others."""
    got = {}
    for seed in range(12):
        r = llm.run([_choice(llm, _params(llm, logprobs=0, temperature=1.0, seed=seed))])[0]
        probs = torch.tensor(list(r.choice_probabilities.values()), dtype=torch.float64)
        assert r.text == OPTIONS[decide(probs, 1.0, seed)]
        got[seed] = r.text
    batched = llm.run(_others(llm, 2) + [_choice(llm, _params(llm, logprobs=0, temperature=1.0, seed=5))])[-1]
    assert batched.text == got[5]


def test_decide_is_the_argmax_or_a_seeded_draw():
    p = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert decide(p, 0.0, 1) == 1 and decide(torch.tensor([0.5, 0.5]), 0.0, 9) == 0  # the first of equals
    draws = [decide(p, 1.0, s) for s in range(2000)]
    assert draws == [decide(p, 1.0, s) for s in range(2000)]  # seeded
    assert [round(draws.count(k) / 2000, 1) for k in range(3)] == [0.2, 0.5, 0.3]


def test_probabilities_are_scored_once_on_the_first_forwards_raw_logits(llm, monkeypatch):
    """Scored once, on the window logits of output positions [0, H) of the first decoding forward
    (every slot position masked), option tokens then the filler (EOS); for the full-canvas family
    those logits are the model's own over prompt + an all-mask canvas."""
    import celeris.engine.families.selection as api

    seq = _choice(llm, _params(llm, logprobs=0))
    ids, H = seq.constraint.choice_ids(), seq.constraint.choice_horizon
    assert ids.shape == (len(OPTIONS), H) and H == max(len(t) for _, t in seq.constraint.layout.choices) + 1
    assert (ids[OPTIONS.index("no")][len(seq.constraint.layout.choices[1][1]):] == llm.tokenizer.eos_id).all()
    calls = []
    real = api.option_probabilities
    monkeypatch.setattr(api, "option_probabilities",
                        lambda lg, i: calls.append((lg.clone(), i, seq.nfe)) or real(lg, i))
    res = llm.run([seq])[0]
    assert len(calls) == 1 and calls[0][2] == getattr(seq, "prefill_steps", 0)  # the first decoding forward
    logits, got_ids, _ = calls[0]
    assert torch.equal(got_ids, ids)
    if llm.family.kind == "full":
        canvas = torch.tensor([seq.prompt + [llm.tokenizer.mask_id] * seq.params.gen_length])
        with torch.inference_mode():
            want = llm.loop.runner.model(canvas)[0, len(seq.prompt):len(seq.prompt) + H]
        assert torch.allclose(logits.float(), want.float(), atol=1e-4)
    assert list(res.choice_probabilities.values()) == pytest.approx(real(logits, ids).tolist(), abs=0)


def test_options_beyond_the_first_block_are_refused_by_name(llm):
    long = ["a b c d e f", "b c d e f g"]
    p = replace(llm.defaults, gen_length=16, steps=16, block_length=4, logprobs=0)
    with pytest.raises(InvalidRequest) as e:
        llm.build(Request(prompt="x", params=p, structured=Structured("choice", long, "structured_outputs.choice")))
    assert e.value.violations[0].field == "structured_outputs.choice" and "block_length" in str(e.value)
    llm.build(Request(prompt="x", params=replace(p, logprobs=None),
                      structured=Structured("choice", long, "structured_outputs.choice")))  # without: served


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    pytest.importorskip("transformers")
    from celeris.engine.config import EngineConfig
    from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint

    return LLM.load(write_bpe_checkpoint(tmp_path_factory.mktemp("dg-choice"), canvas_length=16),
                    EngineConfig(max_batch=4, max_queue=8, max_prompt_tokens=64, max_gen_length=64))


def _gemma_choice(gemma, seed=1, **kw):
    p = replace(gemma.defaults, gen_length=16, block_length=16, steps=1, seed=seed, max_denoising_steps=3, **kw)
    return gemma.build(Request(prompt="Q:", params=p, structured=Structured("choice", OPTIONS, "choice")))


def test_diffusion_gemma_scores_its_options_on_the_commit_step(gemma, monkeypatch):
    """DiffusionGemma (revise/slots.py): scored once, on the model's own logits of the step that
    commits the first canvas (the forward whose logits commit the slot's first token); the numbers
    sum to 1, are the same beside free rows, and change no other row's tokens."""
    import celeris.engine.families.revise.slots as slots

    calls, real = [], slots.option_probabilities
    monkeypatch.setattr(slots, "option_probabilities", lambda lg, i: calls.append((lg.clone(), i)) or real(lg, i))
    seq = _gemma_choice(gemma, logprobs=0)
    alone = gemma.run([seq])[0]
    probs = alone.choice_probabilities
    assert len(calls) == 1 and torch.equal(calls[0][1], seq.constraint.choice_ids())
    assert calls[0][0].shape[0] == seq.constraint.choice_horizon
    assert list(probs.values()) == pytest.approx(real(*calls[0]).tolist(), abs=0)
    assert list(probs) == OPTIONS and abs(sum(probs.values()) - 1) < 1e-9 and all(0 < v < 1 for v in probs.values())
    assert alone.text in OPTIONS
    assert gemma.run([_gemma_choice(gemma)])[0].choice_probabilities is None
    def free():
        return [gemma.build(Request(prompt="Once upon", params=replace(
            gemma.defaults, gen_length=32, block_length=32, steps=1, seed=k, max_denoising_steps=3, ignore_eos=True)))
            for k in range(2)]
    want = [r.token_ids for r in gemma.run(free())]
    others = free()
    mixed = gemma.run(others[:1] + [_gemma_choice(gemma, logprobs=0)] + others[1:])
    assert mixed[1].choice_probabilities == probs and mixed[1].token_ids == alone.token_ids
    assert [mixed[0].token_ids, mixed[2].token_ids] == want


def test_diffusion_gemma_writes_the_option_its_probabilities_decide(gemma):
    """One decision on DiffusionGemma too: at t_min 0 the option written is the most probable one,
    for every seed (the greedy constrained pass alone disagreed with the numbers)."""
    for seed in range(6):
        r = gemma.run([_gemma_choice(gemma, seed=seed, logprobs=0, t_min=0.0)])[0]
        probs = r.choice_probabilities
        assert r.text == max(probs, key=probs.get), (seed, r.text, probs)
