import random
import re

import pytest

from celeris.engine.training.skill import (
    OPERANDS,
    heldout_pairs,
    is_correct,
    is_heldout,
    make_addition,
    train_pairs,
)

_PROMPT = re.compile(r"(\d\d)\+(\d\d)=")


def _operands(prompt: str) -> tuple[int, int]:
    match = _PROMPT.fullmatch(prompt)
    assert match, prompt
    return int(match[1]), int(match[2])


def test_answers_are_exact_sums():
    for prompt, answer in train_pairs(2_000) + heldout_pairs():
        a, b = _operands(prompt)
        assert answer == str(a + b)
        assert is_correct(prompt, answer)


def test_splits_are_disjoint_even_when_commuted():
    train = {frozenset(_operands(p)) for p, _ in train_pairs()}
    heldout = {frozenset(_operands(p)) for p, _ in heldout_pairs()}
    assert train.isdisjoint(heldout)


def test_split_covers_every_pair_once_with_about_ten_percent_heldout():
    everything = {(a, b) for a in OPERANDS for b in OPERANDS}
    heldout = {_operands(p) for p, _ in heldout_pairs()}
    assert heldout == {pair for pair in everything if is_heldout(*pair)}
    assert 0.07 < len(heldout) / len(everything) < 0.13


def test_make_addition_draws_from_the_requested_split():
    rng = random.Random(0)
    assert not any(is_heldout(*_operands(p)) for p, _ in make_addition(rng, 500))
    assert all(is_heldout(*_operands(p)) for p, _ in make_addition(rng, 500, heldout=True))
    with pytest.raises(ValueError):
        make_addition(rng, -1)


def test_fixed_seed_gives_the_same_data():
    assert train_pairs(100) == train_pairs(100)
    assert heldout_pairs() == heldout_pairs()
    assert train_pairs(100) != train_pairs(100, seed=7)


def test_is_correct_rejects_wrong_answers():
    assert is_correct("37+45=", " 82 ")
    assert not is_correct("37+45=", "81")
    assert not is_correct("37+45=", "082")
