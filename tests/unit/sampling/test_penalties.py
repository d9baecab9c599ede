"""OpenAI's frequency / presence penalties on a diffusion canvas: what counts, exactness against
the reference loop with the same penalty, rows keeping their own settings, both model families."""

from __future__ import annotations

import pytest
import torch

from celeris.engine.errors import InvalidRequest
from celeris.engine.llm import LLM
from celeris.engine.sampling.params import SamplingParams, fit_lengths
from celeris.engine.sampling.reference import reference_generate
from celeris.engine.sampling.select import Penalties, penalize
from celeris.engine.training.evaluate import distinct_ngrams

MASK = 3


def test_counts_committed_response_tokens_only():
    # canvas: prompt [5, 5] | response [6, 6, MASK, 2(stop), 7]
    canvas = torch.tensor([[5, 5, 6, 6, MASK, 2, 7]])
    logits = torch.zeros(1, 1, 10)
    out = penalize(logits, canvas, torch.tensor([2]),
                   Penalties(torch.tensor([0.5]), torch.tensor([1.0]), exclude=torch.tensor([[2]])), mask_id=MASK)[0, 0]
    assert out[6].item() == pytest.approx(-(0.5 * 2 + 1.0))  # twice in the response
    assert out[7].item() == pytest.approx(-(0.5 + 1.0))
    assert out[5].item() == 0  # only in the prompt
    assert out[2].item() == 0 and out[MASK].item() == 0  # the stop token and masks never count


def test_negative_penalties_encourage_and_rows_keep_their_own():
    canvas = torch.tensor([[1, 4, 4], [1, 4, 4]])
    out = penalize(torch.zeros(2, 1, 6), canvas, torch.tensor([1, 1]),
                   Penalties(torch.tensor([-0.5, 0.0]), torch.tensor([0.0, 0.0]), exclude=torch.tensor([[6], [6]])),
                   mask_id=MASK)
    assert out[0, 0, 4].item() == pytest.approx(1.0) and out[1].abs().sum().item() == 0


@pytest.mark.parametrize("kw", [dict(frequency_penalty=2.5), dict(presence_penalty=-3.0),
                                dict(frequency_penalty=float("nan")), dict(presence_penalty=True)])
def test_bad_values_are_refused(kw):
    with pytest.raises(InvalidRequest, match=next(iter(kw))):
        SamplingParams(**kw).validate()


@pytest.fixture(scope="module")
def shipped():
    return LLM.load()  # celeris-tiny: real prose that loops under greedy decoding


def _reference(llm, prompt: str, p: SamplingParams) -> list[int]:
    ids = torch.tensor([llm.encode_prompt(prompt)])
    out, _ = reference_generate(lambda x, m: llm.model(x), ids, p, llm.tokenizer.mask_id,
                                stop_ids=sorted(llm.tokenizer.stop_ids))
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
@pytest.mark.parametrize("kw", [dict(frequency_penalty=0.5), dict(presence_penalty=1.0),
                                dict(frequency_penalty=0.3, presence_penalty=0.4, threshold=0.9)])
def test_engine_equals_the_reference_loop_with_the_same_penalty(shipped, kw):
    p = SamplingParams(gen_length=32, steps=32, block_length=8, seed=0, **kw).validate()
    prompt = "Edward had been staying several weeks in the"
    got = shipped.generate([shipped.encode_prompt(prompt)], p)[0]
    seq = shipped.sequence(shipped.encode_prompt(prompt), p)
    shipped.loop.add(seq)
    shipped.loop.run_to_completion()
    assert seq.canvas == _reference(shipped, prompt, p)
    assert got.token_ids  # and the public path runs the same request


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_a_penalty_breaks_the_greedy_loop_and_its_neighbour_is_untouched(shipped):
    prompt = shipped.encode_prompt("Edward had been staying several weeks in the")
    base = fit_lengths(shipped.defaults, {"gen_length": 64, "seed": 0, "frequency_penalty": 0.0,
                                          "presence_penalty": 0.0})
    plain_alone = shipped.generate([prompt], base)[0]
    seqs = [shipped.sequence(prompt, p) for p in (base, fit_lengths(base, {"frequency_penalty": 0.5}))]
    for s in seqs:
        shipped.loop.add(s)
    shipped.loop.run_to_completion()
    plain, penalised = (shipped.detokenize(s.generated()) for s in seqs)
    assert plain == plain_alone.text and distinct_ngrams(plain.split()) < 0.5  # "rest of the rest of the ..."
    assert distinct_ngrams(penalised.split()) >= 0.9  # the loop is broken (one 4-gram may recur)


@pytest.mark.slow  # over 1.5 s in CI (2026-12-06): out of the fast tier
def test_block_model_rows_follow_the_penalty(shipped):
    block = LLM.load("celeris-tiny-block")
    prompt = block.encode_prompt("Edward had been staying several weeks in the")
    base = fit_lengths(block.defaults, {"gen_length": 64, "seed": 0, "ignore_eos": True, "stop_at_eos": False,
                                        "frequency_penalty": 0.0, "presence_penalty": 0.0})
    plain, strong = (block.generate([prompt], p)[0].token_ids
                     for p in (base, fit_lengths(base, {"presence_penalty": 2.0})))
    counted = [t for t in strong if t not in block.tokenizer.stop_ids]
    assert plain != strong and len(set(counted)) > len(set(t for t in plain if t not in block.tokenizer.stop_ids))
