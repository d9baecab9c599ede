"""Lengths given alone: steps and block length fitted from the model's defaults."""

from __future__ import annotations

import pytest

from celeris.engine.sampling.params import SamplingParams, fit_lengths

DEFAULTS = SamplingParams(gen_length=64, steps=32, block_length=8)


@pytest.mark.parametrize("gen_length,steps,block", [(16, 8, 8), (12, 6, 6), (4, 2, 4), (5, 2, 5), (1, 1, 1),
                                                    (256, 128, 8), (64, 32, 8)])
def test_gen_length_alone_keeps_the_defaults_ratio_and_a_dividing_block(gen_length, steps, block):
    p = fit_lengths(DEFAULTS, {"gen_length": gen_length})
    assert (p.steps, p.block_length) == (steps, block)
    assert p.validate(4096) is p


def test_every_length_fits_with_any_defaults():
    for d in (SamplingParams(), SamplingParams(gen_length=64, steps=64, block_length=32),
              SamplingParams(gen_length=4, steps=4, block_length=4), SamplingParams(gen_length=96, steps=24, block_length=32)):
        for g in range(1, 300):
            fit_lengths(d, {"gen_length": g}).validate(4096)


def test_explicit_values_are_never_changed():
    p = fit_lengths(DEFAULTS, {"gen_length": 16, "steps": 3})
    assert p.steps == 3 and p.block_length == 8
    with pytest.raises(Exception, match="steps"):
        p.validate(4096)
    assert fit_lengths(DEFAULTS, {"steps": 16}) == SamplingParams(gen_length=64, steps=16, block_length=8)


def test_zero_gen_length_is_a_field_error_not_a_crash():
    # Found by the gRPC fuzz test: gen_length 0 with block_length 1 used to divide by zero blocks.
    from celeris.engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="gen_length"):
        SamplingParams(gen_length=0, steps=1, block_length=1).validate(256)
