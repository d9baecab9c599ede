"""DiffusionGemma's revising sampler against transformers' own pieces (issue #30).

The reference classes (`EntropyBoundSampler`, `LinearTemperatureScheduleLogitsProcessor`,
`StableAndConfidentStoppingCriteria`) are driven through the global CPU generator in the order
transformers' `_denoising_step` uses; Celeris' row functions use a per-request generator. A
stand-in denoiser (a fixed random map of the canvas) supplies logits, so this checks the sampler
and the random draw order, not the model.
"""

import pytest
import torch

from celeris.engine.families.revise.sampler import ReviseParams, RowNoise, StopRule, denoise_row

gen_dg = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")

V, L = 48, 12


def _denoiser(seed: int):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(V, V, generator=g) * 3.0
    pos = torch.randn(L, V, generator=g)
    return lambda canvas: table[canvas] + pos  # (L,) -> (L, V)


def _reference(seed, p, f):
    sampler = gen_dg.EntropyBoundSampler(gen_dg.EntropyBoundSamplerConfig(entropy_bound=p.entropy_bound), L, V,
                                         p.max_denoising_steps)
    temp = gen_dg.LinearTemperatureScheduleLogitsProcessor(p.t_min, p.t_max, p.max_denoising_steps)
    stop = gen_dg.StableAndConfidentStoppingCriteria(p.stability_threshold, p.confidence_threshold)
    torch.manual_seed(seed)
    canvas, trace = sampler.initialize_canvas(1, torch.device("cpu")), []
    for step in reversed(range(1, p.max_denoising_steps + 1)):
        scaled = temp(None, f(canvas[0])[None], cur_step=torch.tensor(step, dtype=torch.int32))
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
        drawn = torch.multinomial(probs.view(-1, V), num_samples=1).view(1, L)
        argmax = scaled.argmax(-1)
        canvas = sampler.renoise_canvas(sampler.accept_canvas(canvas, drawn, scaled, step), step)
        done = bool(stop(argmax, scaled)[0])
        trace.append((canvas[0].tolist(), argmax[0].tolist(), done))
        if done:
            break
    return trace


def _celeris(seed, p, f):
    noise, stop = RowNoise(seed, V, L), StopRule(p)
    canvas, trace = noise.uniform_canvas(), []
    for step in reversed(range(1, p.max_denoising_steps + 1)):
        r = denoise_row(f(canvas), canvas, step, p, noise)
        canvas = r.canvas
        done = stop(r.argmax, r.logits)
        trace.append((canvas.tolist(), r.argmax.tolist(), done))
        if done:
            break
    return trace


PARAMS = [
    ReviseParams(max_denoising_steps=12),
    ReviseParams(max_denoising_steps=20, entropy_bound=2.0, t_min=0.1, t_max=0.3, stability_threshold=2,
                 confidence_threshold=0.5),
    ReviseParams(max_denoising_steps=6, entropy_bound=0.5, stability_threshold=0, confidence_threshold=1.5),
]


@pytest.mark.parametrize("p", PARAMS)
@pytest.mark.parametrize("seed", [0, 1, 7, 1234])
def test_steps_match_the_reference_sampler(p, seed):
    f = _denoiser(seed + 100)
    ref, ours = _reference(seed, p, f), _celeris(seed, p, f)
    assert ours == ref


def test_both_stopping_reasons_are_exercised():
    reasons = set()
    for p in PARAMS:
        for seed in (0, 1, 7, 1234):
            trace = _celeris(seed, p, _denoiser(seed + 100))
            reasons.add("rule" if trace[-1][2] else "steps")
    assert reasons == {"rule", "steps"}


def test_a_row_draws_the_same_whatever_else_runs():
    p, f = PARAMS[0], _denoiser(5)
    alone = _celeris(3, p, f)
    torch.manual_seed(99)
    torch.rand(1000)  # the global generator is not the row's
    assert _celeris(3, p, f) == alone
