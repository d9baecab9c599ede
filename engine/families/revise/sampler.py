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
On a CUDA device the stream is a generator on that device seeded with the request's seed: a seed
decodes the same text alone or in any batch on that device, but not the CPU's text (the device's
random numbers are another sequence), and not necessarily another device model's.

Memory: the runner steps a row with `denoise_row_`, which works in the forward's own (L, V) float32
buffer (tempered in place, entropies a chunk of rows at a time, then softmax in place) and leaves it
holding the next step's self-conditioning input; `denoise_row` is the same step written plainly, the
reference the in-place one is tested against bit for bit.
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

    def __init__(self, seed: int, vocab_size: int, canvas_length: int, device: torch.device | str = "cpu"):
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.vocab_size = vocab_size
        self.canvas_length = canvas_length

    def uniform_canvas(self) -> torch.Tensor:
        """A canvas of uniform tokens: the initial noise and the re-noising draw.  # (L,)"""
        return torch.randint(0, self.vocab_size, (1, self.canvas_length), generator=self.gen,
                             device=self.gen.device)[0]

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per position from float32 probabilities.  (L, V) -> (L,)"""
        return torch.multinomial(probs, num_samples=1, generator=self.gen)[:, 0]

    def draw_(self, probs: torch.Tensor) -> torch.Tensor:
        """`draw`, as torch.multinomial makes one sample (argmax of probs / q, q ~ Exp(1), one
        exponential per entry from this stream), without its validity checks: each is a host sync
        on a device. Bit-identical to `draw` on the CPU (tested); one (L, V) temporary.  (L, V) -> (L,)"""
        q = torch.empty_like(probs).exponential_(generator=self.gen)
        return torch.div(probs, q, out=q).argmax(-1)


def tempered(logits: torch.Tensor, steps_left: int, p: ReviseParams) -> torch.Tensor:
    """Logits divided by the step's temperature; `steps_left` counts down from max_denoising_steps to 1.

    The temperature is formed in float32 from an int32 step, as the reference forms it, so the
    quotient is bit-identical to the reference's.
    """
    return logits / temperature(steps_left, p)


def temperature(steps_left: int, p: ReviseParams) -> torch.Tensor:
    """The step's temperature, a float32 scalar (on the CPU: a scalar operand on any device)."""
    step = torch.tensor(steps_left, dtype=torch.int32)
    return p.t_min + (p.t_max - p.t_min) * (step / p.max_denoising_steps)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits), normalised and clamped the way
    torch.distributions.Categorical computes it.  (..., V) -> (...)"""
    logp = logits - logits.logsumexp(dim=-1, keepdim=True)
    logp_finite = torch.clamp(logp, min=torch.finfo(logp.dtype).min)
    return -(logp_finite * torch.softmax(logp, dim=-1)).sum(-1)


ROW_CHUNKS = 32  # rows a chunk of full-vocabulary work covers: bounds its temporaries to (32, V)


def row_chunks(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of x in near-equal runs of at most ROW_CHUNKS rows (dim 0). Each run keeps >= 2 rows
    when x does: a reduction over one row sums in another order on the CPU (its two-pass path), over
    several each row sums as in the whole tensor, so chunked == whole, bit for bit (tested)."""
    return torch.tensor_split(x, max(1, -(-x.shape[0] // ROW_CHUNKS)))


def softmax_(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, -1) into x's own float32 buffer, a chunk of rows at a time.  (L, V) -> x"""
    for part in row_chunks(x):
        part.copy_(torch.softmax(part, dim=-1, dtype=torch.float32))
    return x


def entropy_chunked(logits: torch.Tensor) -> torch.Tensor:
    """`entropy` a chunk of rows at a time, bit for bit; logits unchanged.  (L, V) -> (L,)"""
    out = torch.empty(logits.shape[:-1], dtype=logits.dtype, device=logits.device)
    for part, o in zip(row_chunks(logits), row_chunks(out)):
        logp = part - part.logsumexp(dim=-1, keepdim=True)
        probs = torch.softmax(logp, dim=-1)
        o.copy_(-probs.mul_(logp.clamp_(min=torch.finfo(logp.dtype).min)).sum(-1))
    return out


def conditioning_input(probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the next forward mixes in (model.denoise's sc_probs): the probabilities in the weights'
    dtype, as the reference casts them; in float32 the buffer itself.  (L, V) -> (L, V)"""
    return probs if dtype == torch.float32 else probs.to(dtype)


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


@dataclass
class RowDraw:
    """One row's step as `denoise_row_` leaves it: on the row's device until the step's one transfer."""

    canvas: torch.Tensor  # (L,) the next step's input
    argmax: torch.Tensor  # (L,) what the canvas would commit now
    probs: Optional[torch.Tensor]  # (L, V) float32 softmax of the tempered logits: the forward's buffer, reused
    confidence: torch.Tensor  # (L,) probs' max per position
    mean_entropy: torch.Tensor  # () float32
    confident: torch.Tensor  # () bool: mean_entropy < confidence_threshold, compared as the reference does
    tempered: Optional[torch.Tensor] = None  # (L, V) kept only when asked (a structured row's commit)


def denoise_row_(logits: torch.Tensor, steps_left: int, p: ReviseParams, noise: RowNoise,
                 keep_tempered: bool = False) -> RowDraw:
    """`denoise_row` in the logits' own buffer, which it consumes: the same draws, acceptances and
    argmax bit for bit (a re-noised position never keeps its old token, so the old canvas is not
    read), with one (L, V) temporary (the draw's) and (ROW_CHUNKS, V) ones.  logits: (L, V)"""
    scaled = logits.div_(temperature(steps_left, p))  # (L, V) tempered, in place
    argmax = scaled.argmax(-1)
    h = entropy_chunked(scaled)  # (L,)
    kept_tempered = scaled.clone() if keep_tempered else None
    probs = softmax_(scaled)  # the same buffer, now the draw's probabilities
    drawn = noise.draw_(probs)
    accepted = accept_mask(h, p.entropy_bound)
    fresh = noise.uniform_canvas()  # drawn even when every position was accepted
    mean = h.mean(-1)
    return RowDraw(torch.where(accepted, drawn, fresh), argmax, probs, probs.amax(-1), mean,
                   mean < p.confidence_threshold, kept_tempered)


class StopRule:
    """Stable and confident: the argmax canvas equal to each of the last `stability_threshold` ones,
    and the mean entropy of the tempered logits below `confidence_threshold`."""

    def __init__(self, p: ReviseParams):
        self.p = p
        self.history: list[Optional[list[int]]] = [None] * p.stability_threshold

    def __call__(self, argmax: torch.Tensor, tempered_logits: torch.Tensor) -> bool:
        confident = bool(entropy(tempered_logits).mean(-1) < self.p.confidence_threshold)
        return self.decide(argmax.tolist(), confident)

    def decide(self, argmax: list[int], confident: bool) -> bool:
        """The rule over host values: this step's argmax and whether its mean entropy is under the bound."""
        stable = all(h == argmax for h in self.history)
        if self.history:
            self.history = self.history[1:] + [argmax]
        return stable and confident
