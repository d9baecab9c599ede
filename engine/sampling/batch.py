"""What token selection reads, as records built once per step (vLLM's `SamplingMetadata`).

- `SelectionRule`: how a model family's published sampler picks (decided once, at load).
- `SamplingBatch`: every row's sampling knobs as (B,) device tensors, packed into two host->device
  copies, plus host-known flags that let selection skip work no row asks for. Both runners build
  it with `SamplingBatch.build` from their rows; padding rows (a batch rounded up to its bucket)
  get neutral knobs.
- `Window`: the rows' state over the positions being decoded this step (tokens, candidates, the
  positions that key the noise and `min_tokens`, the canvas the penalties count over, and the
  structured-output token masks as an `Allowed`, None when no row is constrained).
- `Selection`: what `select.select_tokens` returns.

Adding a sampling knob: a field of `SamplingParams` (engine/sampling/params.py, with its table entry), a
column here, the proto field, and its use in `sampler.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence as Seq

import torch

from celeris.engine.sampling.params import FACTOR_RULES, REMASKING, SamplingParams

REMASK_CODE = {name: i for i, name in enumerate(REMASKING)}
FACTOR_RULE_CODE = {name: i for i, name in enumerate(FACTOR_RULES)}

# Columns of the packed knob tensors: one int64 and one float64 host->device copy a step.
INT_COLUMNS = ("k", "remask", "factor_rule", "seed", "step", "top_k", "min_tokens")
FLOAT_COLUMNS = ("temperature", "threshold", "factor", "top_p", "frequency", "presence", "min_p", "editing")
_NO_EDITS = 2.0  # an editing threshold no probability exceeds
_NEUTRAL_INTS = (0, 0, 0, 0, 0, 0, 0)
_NEUTRAL_FLOATS = (0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, _NO_EDITS)


@dataclass(frozen=True)
class SelectionRule:
    """A family's published sampler: the confidence dtype (None: the logits' own, as Dream),
    x0 as the argmax of the softmax rather than of the logits (Dream, SDAR, LLaDA2), and the
    block families' dynamic threshold (every candidate strictly above it if that is at least
    the schedule's k, else the top k), and confidences read from the top-k/top-p filtered
    distribution (Dream's sample_tokens) rather than the whole one. mask_id is never a candidate
    token."""

    mask_id: int
    conf_dtype: Optional[torch.dtype] = torch.float64
    x0_from_probs: bool = False
    block_threshold: bool = False
    conf_after_filter: bool = False


@dataclass(frozen=True)
class RowKnobs:
    """One real row's per-step inputs: its parameters, this step's fixed-schedule count and
    step index (keys the noise), its stop ids, and whether this is a first-only step (a fixed
    one-token step whatever the row's rule: Fast-dLLM's Dream block loop)."""

    params: SamplingParams
    k: int
    step: int
    stop_ids: frozenset[int]
    first_only: bool = False
    edits: bool = False  # LLaDA2.1 token editing applies to this row (params.editing_threshold)


@dataclass(frozen=True)
class SamplingBatch:
    k: torch.Tensor  # (B,) tokens the fixed schedule commits
    remask: torch.Tensor  # (B,) REMASK_CODE
    factor_rule: torch.Tensor  # (B,) FACTOR_RULE_CODE
    seed: torch.Tensor  # (B,) keys the noise with step and position
    step: torch.Tensor  # (B,)
    temperature: torch.Tensor  # (B,) float64
    threshold: torch.Tensor  # (B,) float64, > 0 switches a row to the threshold rule
    factor: torch.Tensor  # (B,) float64, > 0 switches a row to the factor rule
    top_k: Optional[torch.Tensor]  # (B,) 0 = off; None when no row filters (top_p likewise)
    top_p: Optional[torch.Tensor]  # (B,) 1 = off
    min_p: Optional[torch.Tensor]  # (B,) 0 = off
    stop_ids: Optional[torch.Tensor]  # (B, S) padded with V; None unless min_tokens or penalties
    min_tokens: Optional[torch.Tensor]  # (B,) no stop id drawn before; None when no row bans
    frequency: Optional[torch.Tensor]  # (B,) OpenAI penalties; None when no row has one
    presence: Optional[torch.Tensor]
    editing: Optional[torch.Tensor]  # (B,) LLaDA2.1 editing thresholds (2.0: no edits); None when no row edits
    # Host-side facts, known without a device sync: they skip work, never change results.
    rows: int  # real rows (the rest pad the bucket)
    sampling: bool  # any temperature > 0
    any_random: bool  # any random remasking
    measures: frozenset[str]  # the confidence measures (REMASKING names) real rows use
    thresholds: tuple[float, ...]  # per real row, for the published tie order on the host
    logprobs: tuple[Optional[int], ...]  # per real row: alternatives asked for, None: no logprobs
    provisional: tuple[bool, ...]  # per real row
    nucleus: bool = True  # any row with top_p < 1 (else top-k/min-p need only a partial sort)
    top_k_max: int = 0  # the largest top_k of a real row
    any_factor: bool = False  # any row under the factor rule this step

    @property
    def top_logprobs(self) -> int:
        """Most alternatives any row asks for; -1 when no row wants logprobs."""
        return max((n for n in self.logprobs if n is not None), default=-1)

    @classmethod
    def build(cls, rows: Seq[RowKnobs], B: int, vocab: int, device: torch.device) -> SamplingBatch:
        """The record of `rows`, padded to B rows with neutral knobs."""
        ps = [r.params for r in rows]
        ints = [(1 if r.first_only else r.k, REMASK_CODE[p.remasking], FACTOR_RULE_CODE[p.factor_rule],
                 p.seed or 0, r.step, p.top_k, p.min_tokens) for r, p in zip(rows, ps)]
        floats = [(p.temperature, 0.0 if r.first_only else p.threshold or 0.0,
                   0.0 if r.first_only else p.factor or 0.0, p.top_p, p.frequency_penalty, p.presence_penalty,
                   p.min_p, p.editing_threshold if r.edits and p.editing_threshold is not None else _NO_EDITS)
                  for r, p in zip(rows, ps)]
        pad = B - len(rows)
        i = torch.tensor(ints + [_NEUTRAL_INTS] * pad, dtype=torch.long).T.contiguous().to(device)
        f = torch.tensor(floats + [_NEUTRAL_FLOATS] * pad, dtype=torch.float64).T.contiguous().to(device)
        col = dict(zip(INT_COLUMNS, i)) | dict(zip(FLOAT_COLUMNS, f))
        filtered = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in ps)
        banning = any(p.min_tokens > 0 for p in ps)
        penalized = any(p.frequency_penalty or p.presence_penalty for p in ps)
        editing = any(row[-1] != _NO_EDITS for row in floats)
        stop_ids = _stop_table(rows, B, vocab, device) if banning or penalized else None
        return cls(col["k"], col["remask"], col["factor_rule"], col["seed"], col["step"], col["temperature"],
                   col["threshold"], col["factor"],
                   col["top_k"] if filtered else None, col["top_p"] if filtered else None,
                   col["min_p"] if filtered else None,
                   stop_ids, col["min_tokens"] if banning else None,
                   col["frequency"] if penalized else None, col["presence"] if penalized else None,
                   col["editing"] if editing else None,
                   rows=len(rows), sampling=any(p.temperature > 0 for p in ps),
                   any_random=any(p.remasking == "random" for p in ps),
                   measures=frozenset(p.remasking for p in ps),
                   thresholds=tuple(float(row[1]) for row in floats),
                   logprobs=tuple(p.logprobs for p in ps), provisional=tuple(p.provisional for p in ps),
                   nucleus=any(p.top_p < 1 for p in ps), top_k_max=max((p.top_k for p in ps), default=0),
                   any_factor=any(row[2] > 0 for row in floats))


def _stop_table(rows: Seq[RowKnobs], B: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Each row's stop ids (B, S), padded with `vocab` (an id no row draws or counts)."""
    width = max(1, max(len(r.stop_ids) for r in rows))
    ids = [sorted(r.stop_ids) + [vocab] * (width - len(r.stop_ids)) for r in rows]
    ids += [[vocab] * width] * (B - len(rows))
    return torch.tensor(ids, device=device)


@dataclass(frozen=True)
class Window:
    """The rows' state over the W positions decoded this step."""

    tokens: torch.Tensor  # (B, W) current ids
    candidate: torch.Tensor  # (B, W) True where masked and decodable this step
    noise_pos: torch.Tensor  # (B, W) position keying each row's noise
    canvas_pos: torch.Tensor  # (B, W) position in the generated region (min_tokens)
    canvas: Optional[torch.Tensor] = None  # (B, L) ids the penalties count (needed with penalties)
    response_from: Optional[torch.Tensor] = None  # (B,) column where each row's response starts in it
    allowed: Optional[Allowed] = None  # structured outputs' token masks; None when no row is constrained


@dataclass(frozen=True)
class Allowed:
    """The tokens a constrained row may commit at its candidate positions (engine/structured):
    rows N of (B * W) flattened window positions, each with its (V,) allowed set. The runner has
    already narrowed those rows' candidates to these positions."""

    flat: torch.Tensor  # (N,) long, b * W + w
    tokens: torch.Tensor  # (N, V) bool


@dataclass(frozen=True)
class Selection:
    """One step's pick over the window: x0 (B, W) candidate tokens, commit (B, W), the
    confidences ranked (B, W) (-inf but at candidates) and how many tokens each row commits (B,).
    When a row edits (LLaDA2.1): edit_x0 (B, W), the pick with the mask token allowed, and
    edit_conf (B, W), its confidence at every position."""

    x0: torch.Tensor
    commit: torch.Tensor
    conf: torch.Tensor
    n_commit: torch.Tensor
    edit_x0: Optional[torch.Tensor] = None
    edit_conf: Optional[torch.Tensor] = None
