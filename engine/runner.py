"""Runs one batched denoising step over a shape bucket.

The canvases of all running requests live in one preallocated buffer, one row per slot, each
right-aligned so that a left-padded batch of any bucket length L is the buffer's last L
columns; RoPE positions are absolute buffer columns, so cached keys stay valid across buckets.
A step packs every row's settings into two small tensors (one host->device copy each), runs one
forward whose head is evaluated only on each row's current-block window, selects tokens with
`sampler.select_tokens`, writes them back by position, and copies the per-row result to the
host once. On CUDA the whole fixed-shape step is captured once per bucket as a CUDA graph and
replayed; on CPU it runs eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from engine.cache import KVCacheStore
from engine.config import EngineConfig
from engine.model import MaskPredictor
from engine.sampler import REMASK_CODE, select_tokens
from engine.sequence import Sequence

# Rows of the packed integer input.
IDX, LENGTH, GEN_LEN, BLOCK_START, BLOCK_LEN, K, REMASK, STEP, SEED = range(9)


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
    forwards: int = 1  # model calls this step (more than one when cache refresh groups differ)


@dataclass(frozen=True)
class Bucket:
    B: int
    L: int
    W: int
    sampling: bool  # any temperature > 0
    any_random: bool  # any random remasking
    tail: int = 0  # longest block-start-to-end span: the fresh width of a prefix-cache step


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
        # Dream's shifted logits read the hidden state left of the block, which a cache would
        # leave stale; such models run without the approximate cache.
        self.cache_mode = config.kv_cache if not model.cfg.logit_shift else "none"
        self.kv = None if self.cache_mode == "none" else KVCacheStore(
            model.cfg, self.slots + 1, self.max_len, self.device, model.dtype)
        self.use_graphs = self.device.type == "cuda" and config.cuda_graphs
        self._graphs: dict[Bucket, tuple] = {}
        self.forward_passes = 0

    def load(self, seq: Sequence) -> None:
        """Write a new request's prompt + masked canvas into its slot (right-aligned)."""
        row = torch.full((self.max_len,), self.mask_id, dtype=torch.long)
        row[self.max_len - seq.length:self.max_len - seq.params.gen_length] = torch.tensor(seq.prompt)
        self.canvas[seq.slot].copy_(row.to(self.device))

    # ------------------------------------------------------------------ host side

    def _pack(self, seqs: Seq[Sequence]) -> tuple[Bucket, torch.Tensor, torch.Tensor]:
        n = len(seqs)
        B = self.config.bucket_batch(n)
        L = min(self.config.bucket_length(max(s.length for s in seqs)), self.max_len)
        W = max(s.params.block_length for s in seqs)
        ints = [[s.slot, s.length, s.params.gen_length, s.block_start, s.params.block_length, s.tokens_this_step,
                 REMASK_CODE[s.params.remasking], s.nfe, s.params.seed or 0] for s in seqs]
        ints += [[self.slots, 1, 1, 0, 0, 0, 0, 0, 0]] * (B - n)  # padding rows: the spare slot, no block
        floats = [[s.params.temperature, s.params.threshold or 0.0, s.params.factor or 0.0] for s in seqs]
        floats += [[0.0, 0.0, 0.0]] * (B - n)
        bucket = Bucket(B, L, W, any(s.params.temperature > 0 for s in seqs),
                        any(s.params.remasking == "random" for s in seqs),
                        max(s.params.gen_length - s.block_start for s in seqs) if self.cache_mode == "prefix" else 0)
        return (bucket, torch.tensor(ints, dtype=torch.long).T.contiguous().to(self.device),
                torch.tensor(floats, dtype=torch.float64).T.contiguous().to(self.device))

    @torch.no_grad()
    def step(self, seqs: Seq[Sequence]) -> tuple[list[RowResult], StepStats]:
        """One denoising step for every sequence; cache refreshes and CFG rows form own groups."""
        t0 = time.perf_counter()
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(seqs):
            if s.params.cfg_scale > 0:
                mode = "cfg"
            elif self.kv is None:
                mode = "full"
            else:
                mode = "store" if s.step_in_block == 0 else "cached"
            groups.setdefault(mode, []).append(i)
        results: list[RowResult] = [RowResult([], [], [])] * len(seqs)
        committed, graphed, biggest = 0, False, None
        for mode, members in groups.items():
            group = [seqs[i] for i in members]
            bucket, ints, floats = self._pack(group)
            commit, new, conf, graphed_now = self._execute(mode, group, bucket, ints, floats)
            # The one host synchronisation of the step (per group).
            commit_h, new_h, conf_h = commit[:len(group)].cpu(), new[:len(group)].cpu(), conf[:len(group)].float().cpu()
            for r, i in enumerate(members):
                pos = commit_h[r].nonzero().flatten()
                results[i] = RowResult(pos.tolist(), new_h[r, pos].tolist(), conf_h[r, pos].tolist())
            committed += int(commit_h.sum())
            graphed |= graphed_now
            biggest = bucket if biggest is None or bucket.B * bucket.L > biggest.B * biggest.L else biggest
        self.forward_passes += 1
        return results, StepStats(len(seqs), biggest.B, biggest.L, biggest.W, committed,
                                  time.perf_counter() - t0, graphed, len(groups) + ("cfg" in groups))

    def _execute(self, mode: str, group: list[Sequence], b: Bucket, ints: torch.Tensor, floats: torch.Tensor):
        if mode == "full" and self.use_graphs:
            return (*self._replay(b, ints, floats), True)
        if mode == "cfg":
            scale = torch.tensor([s.params.cfg_scale for s in group] + [0.0] * (b.B - len(group)), device=self.device)
            return (*self._compute(b, ints, floats, cfg_scale=scale), False)
        return (*self._compute(b, ints, floats, mode=mode), False)

    # ------------------------------------------------------------------ device side

    def _compute(self, b: Bucket, ints: torch.Tensor, floats: torch.Tensor, mode: str = "full",
                 cfg_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward + selection + write-back for one bucket. Fixed shapes, no host sync."""
        B, L, W = b.B, b.L, b.W
        idx = ints[IDX]
        ids = self.canvas[idx, self.max_len - L:]  # (B, L) left-padded batch
        col = torch.arange(L, device=self.device)
        valid = col[None, :] >= (L - ints[LENGTH])[:, None]  # (B, L) False at padding
        start = L - ints[GEN_LEN] + ints[BLOCK_START]  # (B,) block start, batch coordinates
        w = torch.arange(W, device=self.device)
        in_block = w[None, :] < ints[BLOCK_LEN][:, None]  # (B, W)
        out_index = (start[:, None] + w[None, :]).clamp(max=L - 1)
        positions = (self.max_len - L + col).expand(B, L)  # absolute buffer columns

        if mode == "cached":
            logits = self._cached_logits(ids, idx, valid, start, in_block, out_index, positions, ints, b.tail)
        elif mode == "store":
            logits, kvs = self.model(ids, key_mask=valid, positions=positions, out_index=out_index, return_kv=True)
            self.kv.write(idx, kvs)
        else:
            logits = self.model(ids, key_mask=valid, positions=positions, out_index=out_index)
            if cfg_scale is not None:
                logits = self._guided(logits, ids, valid, positions, out_index, ints, cfg_scale)

        tokens = torch.gather(ids, 1, out_index)
        candidate = in_block & (tokens == self.mask_id)
        new, commit, conf = select_tokens(
            logits, tokens, candidate, k=ints[K], temperature=floats[0], remask=ints[REMASK],
            threshold=floats[1].float(), factor=floats[2].float(), seed=ints[SEED], step=ints[STEP],
            pos=ints[BLOCK_START][:, None] + w[None, :], sampling=b.sampling, any_random=b.any_random)
        # Write back by position. Window columns past the row's end are not clamped here (the
        # duplicates would race): they land in scratch columns. Padding rows touch the spare row.
        scratch = torch.cat([ids, ids.new_full((B, W), self.mask_id)], dim=1)  # (B, L + W)
        ids = scratch.scatter(1, start[:, None] + w[None, :], torch.where(in_block, new, tokens))[:, :L]
        self.canvas[idx, self.max_len - L:] = ids
        return commit, new, conf

    def _cached_logits(self, ids, idx, valid, start, in_block, out_index, positions, ints, tail: int) -> torch.Tensor:
        """Recompute only the block (dual) or block + suffix (prefix); the rest comes from the cache."""
        B, L = ids.shape
        col = torch.arange(L, device=self.device)
        if self.cache_mode == "dual":
            fresh_index, fresh_ok = out_index, in_block
            cached_ok = valid & ~((col[None, :] >= start[:, None])
                                  & (col[None, :] < (start + ints[BLOCK_LEN])[:, None]))
        else:  # prefix: the block and everything after it is fresh
            f = torch.arange(tail, device=self.device)
            fresh_index = (start[:, None] + f[None, :]).clamp(max=L - 1)
            fresh_ok = (start[:, None] + f[None, :]) < L
            cached_ok = valid & (col[None, :] < start[:, None])
        fresh_ids = torch.gather(ids, 1, fresh_index)
        fresh_pos = torch.gather(positions, 1, fresh_index)
        cache = self.kv.read(idx, L, cached_ok)
        logits = self.model(fresh_ids, key_mask=fresh_ok, positions=fresh_pos, cache=cache)  # (B, F, V)
        return logits[:, :out_index.shape[1]]  # the block opens the fresh window

    def _guided(self, logits, ids, valid, positions, out_index, ints, scale) -> torch.Tensor:
        """Classifier-free guidance: the same rows with their prompts masked, then un + (s+1)(c-un)."""
        L = ids.shape[1]
        in_prompt = torch.arange(L, device=self.device)[None, :] < (L - ints[GEN_LEN])[:, None]
        un_ids = torch.where(in_prompt, self.mask_id, ids)
        un = self.model(un_ids, key_mask=valid, positions=positions, out_index=out_index)
        return un + (scale.to(logits.dtype)[:, None, None] + 1) * (logits - un)

    # ------------------------------------------------------------------ CUDA graphs

    def _replay(self, b: Bucket, ints: torch.Tensor, floats: torch.Tensor):
        """Capture the bucket's step once, then replay it with fresh inputs copied in place."""
        if b not in self._graphs:
            static_ints = torch.zeros_like(ints)
            static_ints[IDX], static_ints[LENGTH], static_ints[GEN_LEN] = self.slots, 1, 1  # harmless rows
            static_floats = torch.zeros_like(floats)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the graph (allocator, kernels)
                for _ in range(2):
                    self._compute(b, static_ints, static_floats)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._compute(b, static_ints, static_floats)
            self._graphs[b] = (graph, static_ints, static_floats, out)
        graph, static_ints, static_floats, out = self._graphs[b]
        static_ints.copy_(ints)
        static_floats.copy_(floats)
        graph.replay()
        return out
