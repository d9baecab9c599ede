"""DiffusionGemma prompts, sampler settings and transformers generate() arguments shared by its tests."""

from __future__ import annotations

from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

from celeris.engine.families.revise.sampler import ReviseParams


PROMPTS = ([2, 5, 6, 7], [2, 9, 10, 11, 12, 13, 14, 15, 16], [2, 40])  # the second outgrows the window (6)

PARAMS = {
    "steps": ReviseParams(max_denoising_steps=5),  # never confident: every canvas runs out of steps
    "rule": ReviseParams(max_denoising_steps=8, entropy_bound=1.5, t_min=0.05, t_max=0.2, stability_threshold=1,
                         confidence_threshold=2.5),
    "confident": ReviseParams(max_denoising_steps=7, entropy_bound=0.5, t_min=0.05, t_max=0.2,
                              stability_threshold=0, confidence_threshold=4.0),
}


def gen_kwargs(p: ReviseParams, **extra):
    return dict(max_denoising_steps=p.max_denoising_steps, sampler_config=EntropyBoundSamplerConfig(
        entropy_bound=p.entropy_bound), t_min=p.t_min, t_max=p.t_max, stability_threshold=p.stability_threshold,
        confidence_threshold=p.confidence_threshold, pad_token_id=0, **extra)
