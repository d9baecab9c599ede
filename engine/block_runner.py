"""Runs one batched step of block-diffusion requests (SDAR, LLaDA2) over their exact KV caches.

Every slot owns a row of token ids and a row of keys/values at absolute positions (column =
position), so a request's cache is the prefix of its row: every block it has committed. A step
batches all running requests whatever block each is at, in at most two forwards:

- prefill rows: the next chunk of their prompt's whole blocks, block-causally (a query sees
  every key whose block is not after its own), keys/values stored;
- block rows: each request's current block over its cached prefix, bidirectional inside the
  block. A denoise row then commits tokens (`sampler.select_tokens`, the published rules); a
  store row (its block just finished) writes the block's keys/values to the cache.

Fresh positions replace nothing: their keys/values are scattered at their columns of a copy
of each row's cached prefix, padded positions of shorter rows land in scratch columns no real
query sees. Selection is the full-canvas runner's (`sampler.select_tokens` over a
`SamplingBatch`) under the family's rule; the contract is `runner_api.StepRunner`.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence as Seq

import torch

from celeris.engine.attention import RowSpan
from celeris.engine.block_sequence import DENOISE, PREFILL, STORE, BlockSequence
from celeris.engine.cache import BlockKVStore
from celeris.engine.config import EngineConfig
from celeris.engine.family import Family, family_of
from celeris.engine.model import KVCache, MaskPredictor
from celeris.engine.runner_api import EMPTY, RowResult, StepStats, row_results
from celeris.engine.sampler import published_order, select_tokens
from celeris.engine.sampling_batch import RowKnobs, SamplingBatch, Window
from celeris.engine.structured.constraint import window_masks


class BlockRunner:
    def __init__(self, model: MaskPredictor, config: EngineConfig, family: Optional[Family] = None):
        self.model, self.config = model, config
        self.family = family or family_of(model.cfg)
        self.device = next(model.parameters()).device
        self.mask_id = model.cfg.mask_token_id
        self.slots = config.max_batch
        # Prompt + canvas rounded up to whole blocks (a block is at most gen_length long).
        self.max_len = config.max_prompt_tokens + 2 * config.max_gen_length
        self.tokens = torch.full((self.slots + 1, self.max_len), self.mask_id, dtype=torch.long, device=self.device)
        self.kv = model.kv_store(BlockKVStore, self.slots + 1, self.max_len)
        self.use_graphs = False  # the MoE expert loop and per-row spans are data-dependent: eager

    @property
    def forward_overhead_tokens(self) -> int:
        return self.config.overhead_tokens

    @staticmethod
    def row_tokens(s: BlockSequence) -> int:
        """Fresh columns of this row's next forward, plus its cached context at a 1/32 weight
        (attention reads it): the scheduler's cost estimate."""
        start, end = s.window
        return end - start + start // 32

    @staticmethod
    def forward_kind(s: BlockSequence) -> bool:
        """Prefill rows and the others run as separate forwards of a step (see `step`)."""
        return s.phase == PREFILL

    def load(self, seq: BlockSequence) -> None:
        row = torch.full((self.max_len,), self.mask_id, dtype=torch.long)
        row[:len(seq.prompt)] = torch.tensor(seq.prompt)
        if seq.constraint is not None:  # structured outputs: the skeleton is committed from the start
            row[len(seq.prompt):len(seq.prompt) + len(seq.canvas)] = torch.tensor(seq.canvas)
        self.tokens[seq.slot].copy_(row.to(self.device))

    @torch.no_grad()
    def step(self, seqs: Seq[BlockSequence]) -> tuple[list[RowResult], StepStats]:
        t0 = time.perf_counter()
        results = [EMPTY] * len(seqs)
        committed, forwards, widest = 0, 0, (0, 0, 0)
        for group in ([i for i, s in enumerate(seqs) if s.phase == PREFILL],
                      [i for i, s in enumerate(seqs) if s.phase != PREFILL]):
            if not group:
                continue
            rows = [seqs[i] for i in group]
            for i, r in zip(group, self._forward(rows)):
                results[i] = r
                committed += len(r.positions)
            forwards += 1
            B, Wq = len(rows), max(s.window[1] - s.window[0] for s in rows)
            widest = max(widest, (B * Wq, B, Wq))
        return results, StepStats(len(seqs), widest[1], widest[2], widest[2], committed, time.perf_counter() - t0,
                                  False, forwards)

    def _forward(self, rows: list[BlockSequence]) -> list[RowResult]:
        """One forward over the rows' fresh windows; store and select as each row's phase asks."""
        windows = [s.window for s in rows]
        widths = [e - s for s, e in windows]
        B, Wq, Lc = len(rows), max(widths), max(e for _, e in windows)
        dev = self.device
        slots = torch.tensor([s.slot for s in rows], device=dev)
        j = torch.arange(Wq, device=dev)
        start = torch.tensor([s for s, _ in windows], device=dev)
        width = torch.tensor(widths, device=dev)
        real = j[None, :] < width[:, None]  # (B, Wq)
        cols = torch.where(real, start[:, None] + j[None, :], Lc + j[None, :])  # padded -> scratch
        ids = torch.gather(self.tokens[slots], 1, cols.clamp(max=self.max_len - 1))
        ids = torch.where(real, ids, torch.full_like(ids, self.mask_id))
        keys, values = self.kv.read_prefix(slots, Lc, scratch=Wq)
        spans = [RowSpan(0, w, 0, e, self._allowed(s, e, w) if s.phase == PREFILL else None)
                 for s, (_, e), w in zip(rows, windows, widths)]
        prefill = all(s.phase == PREFILL for s in rows)
        logits, kvs = self.model(ids, positions=start[:, None] + j[None, :], cache=KVCache(keys, values, None, cols),
                                 spans=spans, return_kv=True, head=not prefill)
        self._store([r for r, s in enumerate(rows) if s.phase in (PREFILL, STORE)], rows, windows, kvs)
        if prefill:
            return [EMPTY] * B
        return self._select(rows, logits, ids, real, slots, start)

    def _allowed(self, s: BlockSequence, n_keys: int, width: int) -> torch.Tensor:
        """Block-causal (width, n_keys) for a prefill chunk ending at n_keys."""
        b = s.params.block_length
        qb = torch.arange(n_keys - width, n_keys) // b
        kb = torch.arange(n_keys) // b
        return kb[None, :] <= qb[:, None]

    def _store(self, which: list[int], rows, windows, kvs) -> None:
        if not which:
            return
        slot_idx, col_idx, row_idx, w_idx = [], [], [], []
        for r in which:
            s, e = windows[r]
            slot_idx += [rows[r].slot] * (e - s)
            col_idx += list(range(s, e))
            row_idx += [r] * (e - s)
            w_idx += list(range(e - s))
        t = lambda x: torch.tensor(x, device=self.device)  # noqa: E731
        self.kv.write_columns(t(slot_idx), t(col_idx), t(row_idx), t(w_idx), kvs)

    def _select(self, rows: list[BlockSequence], logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor,
                slots: torch.Tensor, start: torch.Tensor) -> list[RowResult]:
        """Commit tokens in the denoise rows' blocks, as the published loops choose them."""
        B, Wq = ids.shape
        dev = self.device
        denoise = torch.tensor([s.phase == DENOISE for s in rows], device=dev)
        candidate = real & (ids == self.mask_id) & denoise[:, None]
        batch = SamplingBatch.build([RowKnobs(s.params, s.tokens_this_step, s.nfe, s.stop_ids) for s in rows], B,
                                    self.model.cfg.vocab_size, dev)
        pos = start[:, None] + torch.arange(Wq, device=dev)[None, :]  # absolute positions key the noise
        prompt = torch.tensor([len(s.prompt) for s in rows], device=dev)
        canvas = self.tokens[slots] if batch.frequency is not None else None
        front, allowed = window_masks([None if s.constraint is None or s.phase != DENOISE else (s.constraint, [
            s.window[0] + j - len(s.prompt) if j < s.window[1] - s.window[0] else -1 for j in range(Wq)])
            for s in rows], Wq, dev)
        if front is not None:  # structured rows: only their slots' fronts
            candidate = candidate & front
        window = Window(ids, candidate, pos, pos - prompt[:, None], canvas, prompt, allowed)
        sel = select_tokens(logits, batch, window, self.family.rule)
        if dev.type == "cpu":  # the published tie order: torch.topk over the block
            sel = published_order(sel, candidate, batch, self.family.rule, [(s.params.block_length, 0) for s in rows])
        new = torch.where(sel.commit, sel.x0, ids)
        for r, s in enumerate(rows):  # write committed tokens back into each slot's row
            w = s.window[1] - s.window[0]
            self.tokens[s.slot, s.window[0]:s.window[1]] = new[r, :w]
        return row_results(sel, new, candidate, batch, logits)
