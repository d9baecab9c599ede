"""Runs one batched denoising step over a shape bucket.

The canvases of all running requests live in one preallocated buffer, one row per slot, each
right-aligned so that a left-padded batch of any bucket length L is the buffer's last L
columns. A step gathers the active rows, runs one forward whose head is evaluated only on each
row's current-block window, selects tokens with `sampler.select_tokens`, writes them back by
position, and copies the small per-row result to the host once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from engine.config import EngineConfig
from engine.model import MaskPredictor
from engine.sampler import REMASK_CODE, select_tokens
from engine.sequence import Sequence


@dataclass(frozen=True)
class RowResult:
    """What one request got from one step: block-relative positions, tokens, confidences."""

    positions: list[int]
    tokens: list[int]
    confidences: list[float]


@dataclass(frozen=True)
class StepStats:
    batch: int  # requests served
    bucket_batch: int
    bucket_length: int
    window: int
    committed: int
    seconds: float
    cuda_graph: bool = False


class Runner:
    def __init__(self, model: MaskPredictor, config: EngineConfig):
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.mask_id = model.cfg.mask_token_id
        self.max_len = config.bucket_length(config.max_prompt_tokens + config.max_gen_length)
        self.slots = config.max_batch
        # One extra all-mask row serves as padding when a batch is rounded up to its bucket.
        self.canvas = torch.full((self.slots + 1, self.max_len), self.mask_id, dtype=torch.long, device=self.device)
        self.forward_passes = 0

    # ------------------------------------------------------------------ slots

    def load(self, seq: Sequence) -> None:
        """Write a new request's prompt + masked canvas into its slot (right-aligned)."""
        row = torch.full((self.max_len,), self.mask_id, dtype=torch.long)
        row[self.max_len - seq.length:self.max_len - seq.params.gen_length] = torch.tensor(seq.prompt)
        self.canvas[seq.slot].copy_(row.to(self.device))

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, seqs: Seq[Sequence]) -> tuple[list[RowResult], StepStats]:
        t0 = time.perf_counter()
        n = len(seqs)
        B = self.config.bucket_batch(n)
        L = min(self.config.bucket_length(max(s.length for s in seqs)), self.max_len)
        W = max(s.params.block_length for s in seqs)
        pad = [self.slots] * (B - n)
        rows = [s.slot for s in seqs] + pad
        lengths = [s.length for s in seqs] + [1] * (B - n)
        gen_lens = [s.params.gen_length for s in seqs] + [1] * (B - n)
        dev, i64 = self.device, torch.long

        idx = torch.tensor(rows, device=dev)
        ids = self.canvas[idx, self.max_len - L:]  # (B, L) left-padded batch
        col = torch.arange(L, device=dev)
        key_mask = col[None, :] >= (L - torch.tensor(lengths, device=dev))[:, None]  # (B, L)
        # Window = each row's current block, in batch coordinates.
        start = torch.tensor([L - g + s.block_start for g, s in zip(gen_lens, seqs)] + [L - 1] * (B - n), device=dev)
        blen = torch.tensor([s.params.block_length for s in seqs] + [0] * (B - n), device=dev)
        w = torch.arange(W, device=dev)
        in_block = w[None, :] < blen[:, None]  # (B, W)
        out_index = (start[:, None] + w[None, :]).clamp(max=L - 1)

        logits = self._logits(ids, key_mask, out_index, seqs, B)  # (B, W, V)
        tokens = torch.gather(ids, 1, out_index)
        candidate = in_block & (tokens == self.mask_id)

        f32 = torch.float32
        params = [s.params for s in seqs] + [seqs[0].params] * (B - n)
        new, commit, conf = select_tokens(
            logits, tokens, candidate,
            k=torch.tensor([s.tokens_this_step for s in seqs] + [0] * (B - n), device=dev),
            temperature=torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float64),
            remask=torch.tensor([REMASK_CODE[p.remasking] for p in params], device=dev),
            threshold=torch.tensor([p.threshold or 0.0 for p in params], device=dev, dtype=f32),
            factor=torch.tensor([p.factor or 0.0 for p in params], device=dev, dtype=f32),
            seed=torch.tensor([p.seed or 0 for p in params], device=dev, dtype=i64),
            step=torch.tensor([s.nfe for s in seqs] + [0] * (B - n), device=dev, dtype=i64),
            pos=torch.tensor([s.block_start for s in seqs] + [0] * (B - n), device=dev)[:, None] + w[None, :],
            sampling=any(p.temperature > 0 for p in params[:n]),
            any_random=any(p.remasking == "random" for p in params[:n]),
        )
        # Write back by position. Window columns past the row's end are not clamped here (the
        # duplicates would race), they land in scratch columns; padded rows only touch the spare row.
        scratch = torch.cat([ids, ids.new_full((B, W), self.mask_id)], dim=1)  # (B, L + W)
        ids = scratch.scatter(1, start[:, None] + w[None, :], torch.where(in_block, new, tokens))[:, :L]
        self.canvas[idx, self.max_len - L:] = ids
        self.forward_passes += 1

        # The one host synchronisation of the step.
        commit_h, new_h, conf_h = commit[:n].cpu(), new[:n].cpu(), conf[:n].float().cpu()
        results = []
        for r in range(n):
            pos = commit_h[r].nonzero().flatten()
            results.append(RowResult(pos.tolist(), new_h[r, pos].tolist(), conf_h[r, pos].tolist()))
        committed = int(commit_h.sum())
        return results, StepStats(n, B, L, W, committed, time.perf_counter() - t0)

    def _logits(self, ids: torch.Tensor, key_mask: torch.Tensor, out_index: torch.Tensor,
                seqs: Seq[Sequence], B: int) -> torch.Tensor:
        cfg_rows = [r for r, s in enumerate(seqs) if s.params.cfg_scale > 0]
        if not cfg_rows:
            return self.model(ids, key_mask=key_mask, out_index=out_index)
        # Classifier-free guidance: an extra row per guided request with its prompt masked.
        rows = torch.tensor(cfg_rows, device=ids.device)
        L = ids.shape[1]
        gen_start = torch.tensor([L - seqs[r].params.gen_length for r in cfg_rows], device=ids.device)
        in_prompt = torch.arange(L, device=ids.device)[None, :] < gen_start[:, None]
        un_ids = torch.where(in_prompt, self.mask_id, ids[rows])
        logits = self.model(torch.cat([ids, un_ids]), key_mask=torch.cat([key_mask, key_mask[rows]]),
                            out_index=torch.cat([out_index, out_index[rows]]))
        cond, un = logits[:B], logits[B:]
        scale = torch.tensor([seqs[r].params.cfg_scale for r in cfg_rows], device=ids.device, dtype=logits.dtype)
        guided = un + (scale[:, None, None] + 1) * (cond[rows] - un)
        return cond.index_copy(0, rows, guided)
