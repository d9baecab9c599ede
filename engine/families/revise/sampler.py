"""The revising sampler of DiffusionGemma: uniform-noise canvas, entropy-bound acceptance, re-noising,
and the stable-and-confident stopping rule — one row at a time, each row with its own random stream.

A revising model's canvas holds a token at every position from the first step (uniform noise, not
masks). Each step the model's logits are divided by a temperature that falls linearly from `t_max`
(first step) to `t_min` (last step); a token is drawn for every position; the lowest-entropy
positions are accepted while the sum of their entropies minus the largest stays within
`entropy_bound` (an upper bound on their joint mutual information, so the accepted tokens are
roughly independent); every other position is re-noised with a fresh uniform token. The text a
canvas commits is the argmax of the last step's tempered logits. A canvas stops early once that
argmax has been the same for `stability_threshold` steps and the mean entropy is under
`confidence_threshold`.

Random numbers: transformers draws them from torch's global CPU generator in a fixed order — per
canvas one `randint` for the initial noise; per step one `multinomial` over the canvas, then one
`randint` for re-noising (drawn even when every position was accepted). `RowNoise` keeps one
generator per request seeded as `torch.manual_seed(seed)` seeds the global one and draws in that
order, so a seed decodes the same text here as in the reference run alone, whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Optional

import torch

from celeris.engine.sampling.knobs import KNOBS
from celeris.engine.sampling.params import REVISE, SamplingParams


def _of(cls, p: SamplingParams):
    """The revising knobs of a request's parameters."""
    return cls(**{f: getattr(p, f) for f in cls.__dataclass_fields__})


# A DiffusionGemma request's diffusion settings: the knobs SamplingParams tags `only=REVISE`
# (max_denoising_steps, entropy_bound, t_min, t_max, stability_threshold, confidence_threshold),
# with their names, types and defaults, so the knob table is the one place they are written.
ReviseParams = make_dataclass(
    "ReviseParams", [(k.name, k.python_type, field(default=k.default)) for k in KNOBS if k.only == REVISE],
    frozen=True, namespace={"of": classmethod(_of), "__module__": __name__,
                            "__doc__": "A DiffusionGemma request's diffusion settings (the knob table's REVISE knobs)."})


class RowNoise:
    """One request's random stream, in the reference's draw order (module docstring)."""

    def __init__(self, seed: int, vocab_size: int, canvas_length: int):
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.vocab_size = vocab_size
        self.canvas_length = canvas_length

    def uniform_canvas(self) -> torch.Tensor:
        """A canvas of uniform tokens: the initial noise and the re-noising draw.  # (L,)"""
        return torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=self.gen)[0]

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per position from float32 probabilities.  (L, V) -> (L,)"""
        return torch.multinomial(probs, num_samples=1, generator=self.gen)[:, 0]


def tempered(logits: torch.Tensor, steps_left: int, p: ReviseParams) -> torch.Tensor:
    """Logits divided by the step's temperature; `steps_left` counts down from max_denoising_steps to 1.

    The temperature is formed in float32 from an int32 step, as the reference forms it, so the
    quotient is bit-identical to the reference's.
    """
    step = torch.tensor(steps_left, dtype=torch.int32)
    temperature = p.t_min + (p.t_max - p.t_min) * (step / p.max_denoising_steps)
    return logits / temperature


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits), normalised and clamped the way
    torch.distributions.Categorical computes it.  (..., V) -> (...)"""
    logp = logits - logits.logsumexp(dim=-1, keepdim=True)
    logp_finite = torch.clamp(logp, min=torch.finfo(logp.dtype).min)
    return -(logp_finite * torch.softmax(logp, dim=-1)).sum(-1)


def accept_mask(token_entropy: torch.Tensor, entropy_bound: float) -> torch.Tensor:
    """Accept the lowest-entropy positions while sum(entropies) - max(entropies) <= bound.  (L,) -> (L,) bool"""
    sorted_h, order = torch.sort(token_entropy, dim=-1)
    keep_sorted = torch.cumsum(sorted_h, dim=-1) - sorted_h <= entropy_bound  # ascending: max == current
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


@dataclass
class StepResult:
    canvas: torch.Tensor  # (L,) the next step's input: accepted tokens, the rest re-noised
    argmax: torch.Tensor  # (L,) what the canvas would commit now
    logits: torch.Tensor  # (L, V) tempered logits: the next step's self-conditioning input
    accepted: torch.Tensor  # (L,) bool
    mean_entropy: float
    raw: torch.Tensor  # (L, V) the model's own logits this step: log-probabilities are taken over them


def denoise_row(logits: torch.Tensor, canvas: torch.Tensor, steps_left: int, p: ReviseParams,
                noise: RowNoise) -> StepResult:
    """One step of one row, from the model's raw logits over its canvas.  logits: (L, V), canvas: (L,)"""
    scaled = tempered(logits, steps_left, p)
    drawn = noise.draw(torch.softmax(scaled, dim=-1, dtype=torch.float32))
    h = entropy(scaled)
    accepted = accept_mask(h, p.entropy_bound)
    kept = torch.where(accepted, drawn, canvas)
    fresh = noise.uniform_canvas()  # drawn even when every position was accepted
    return StepResult(canvas=torch.where(accepted, kept, fresh), argmax=scaled.argmax(-1), logits=scaled,
                      accepted=accepted, mean_entropy=float(h.mean()), raw=logits)


class StopRule:
    """Stable and confident: the argmax canvas equal to each of the last `stability_threshold` ones,
    and the mean entropy of the tempered logits below `confidence_threshold`."""

    def __init__(self, p: ReviseParams):
        self.p = p
        self.history: list[Optional[torch.Tensor]] = [None] * p.stability_threshold

    def __call__(self, argmax: torch.Tensor, tempered_logits: torch.Tensor) -> bool:
        stable = all(h is not None and torch.equal(h, argmax) for h in self.history)
        if self.history:
            self.history = self.history[1:] + [argmax.clone()]
        confident = bool(entropy(tempered_logits).mean(-1) < self.p.confidence_threshold)
        return stable and confident
