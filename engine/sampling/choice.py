"""Typed decisions: a probability per option of a `choice` structured output.

A choice's options are scored in one forward, the row's first over the choice's slot (every slot
position still masked, the forward that commits its first token), on the window's logits: option
k, placed as the constraint would place it from the slot's first position (its canonical
tokenisation) and followed by the slot's filler (the stop id that ends a choice), scores

    s_k = sum over the first H output positions i of log softmax(logits[i])[ids_k[i]]

and the distribution is softmax(s) over the options. H is one past the longest option (at most
the canvas): every later position holds the filler whatever the option, so it adds the same term
to every s_k and cancels in the softmax; s_k is therefore the log-probability, under that one
forward's factorised (position-wise independent) distribution, of the whole canvas the option
would leave. The end position counts so that an option that is a prefix of another ("yes" and
"yesterday") is not favoured for having fewer terms: both are scored over the same positions.

What it is not: not calibrated (a mean-field product of one forward's marginals, not the
probability of the path the sampler takes, which commits one token a step and conditions each on
the last), not the probability of other tokenisations of the same text, and not affected by
temperature, penalties or top-k/top-p (the model's own logits, as `logprobs` reports them).
The option written is decided by these numbers (`decide`): the most probable at temperature 0,
one drawn from them when sampling, so the text and the probabilities never disagree.
docs/structured-outputs.md says the same to users.
"""

from __future__ import annotations

import torch


def option_probabilities(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits (H, V) of the output positions [0, H) of one row, ids (K, H) each option's tokens
    (filler past its end) -> (K,) float64 probabilities over the options, summing to 1.
    Computed in float64 over this row's logits only: its result depends on nothing else in the
    batch."""
    lp = torch.log_softmax(logits.double(), dim=-1)  # (H, V)
    scores = lp.gather(1, ids.T.to(logits.device)).sum(0)  # (H, K) -> (K,)
    # A model that gives every option -inf (it writes -inf for ids it never emits) has no
    # preference among them: uniform, not NaN.
    scores = torch.where(scores.isneginf().all(), torch.zeros_like(scores), scores)
    return torch.softmax(scores, dim=0)


def decide(probs: torch.Tensor, temperature: float, seed: int) -> int:
    """The option a choice writes, from its probabilities (K,): the most probable at temperature 0
    (the first of equals), else one drawn from them with a generator seeded by the request's seed
    (the same seed, the same option, alone or batched)."""
    if temperature <= 0:
        return int(torch.argmax(probs).item())
    gen = torch.Generator().manual_seed(seed & (2**63 - 1))
    return int(torch.multinomial(probs.double().cpu(), 1, generator=gen).item())
