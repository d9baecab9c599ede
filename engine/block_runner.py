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
query sees. Same interface as `runner.Runner`: `load(seq)`, `step(seqs)`.
"""

from __future__ import annotations

import time
from typing import Sequence as Seq

import torch

from engine.attention import RowSpan
from engine.block_sequence import DENOISE, PREFILL, STORE, BlockSequence
from engine.cache import BlockKVStore
from engine.config import EngineConfig
from engine.model import KVCache, MaskPredictor
from engine.runner import RowResult, StepStats, penalty_rates, row_logprobs, row_provisional, stop_ban
from engine.sampler import FACTOR_RULE_CODE, REMASK_CODE, penalize, select_tokens, token_logprobs, topk_commit


class BlockRunner:
    def __init__(self, model: MaskPredictor, config: EngineConfig):
        self.model, self.config = model, config
        self.device = next(model.parameters()).device
        self.mask_id = model.cfg.mask_token_id
        self.slots = config.max_batch
        # Prompt + canvas rounded up to whole blocks (a block is at most gen_length long).
        self.max_len = config.max_prompt_tokens + 2 * config.max_gen_length
        self.tokens = torch.full((self.slots + 1, self.max_len), self.mask_id, dtype=torch.long, device=self.device)
        self.kv = BlockKVStore(model.cfg, self.slots + 1, self.max_len, self.device, model.dtype)
        self.use_graphs = False  # the MoE expert loop and per-row spans are data-dependent: eager
        self.forward_passes = 0

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
        self.tokens[seq.slot].copy_(row.to(self.device))

    @torch.no_grad()
    def step(self, seqs: Seq[BlockSequence]) -> tuple[list[RowResult], StepStats]:
        t0 = time.perf_counter()
        results = [RowResult([], [], [])] * len(seqs)
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
        self.forward_passes += 1
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
            return [RowResult([], [], [])] * B
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

    def _ban(self, rows: list[BlockSequence], start: torch.Tensor, Wq: int):
        if not any(s.params.min_tokens > 0 for s in rows):
            return None
        prompt = torch.tensor([len(s.prompt) for s in rows], device=self.device)
        canvas_pos = start[:, None] + torch.arange(Wq, device=self.device)[None, :] - prompt[:, None]
        return (*stop_ban(rows, len(rows), self.model.cfg.vocab_size, self.device), canvas_pos)

    def _filters(self, p) -> dict:
        if not any(q.top_k > 0 or q.top_p < 1 for q in p):
            return {}
        return {"top_k": torch.tensor([q.top_k for q in p], device=self.device),
                "top_p": torch.tensor([q.top_p for q in p], dtype=torch.float64, device=self.device)}

    def _penalized(self, rows: list[BlockSequence], logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`penalize` over each slot's committed response (logprobs keep the raw logits)."""
        if not any(s.params.frequency_penalty or s.params.presence_penalty for s in rows):
            return logits
        exclude = stop_ban(rows, len(rows), self.model.cfg.vocab_size, self.device)[0]
        prompt = torch.tensor([len(s.prompt) for s in rows], device=self.device)
        return penalize(logits, self.tokens[slots], prompt, *penalty_rates(rows, len(rows), self.device), exclude,
                        self.mask_id)

    def _select(self, rows, logits, ids, real, slots, start) -> list[RowResult]:
        """Commit tokens in the denoise rows' blocks, as the published loops choose them."""
        B, Wq = ids.shape
        dev = self.device
        denoise = torch.tensor([s.phase == DENOISE for s in rows], device=dev)
        candidate = real & (ids == self.mask_id) & denoise[:, None]
        p = [s.params for s in rows]
        ints = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        floats = lambda xs: torch.tensor(xs, dtype=torch.float64, device=dev)  # noqa: E731
        thresholds = [q.threshold or 0.0 for q in p]
        x0, commit, conf, n_commit = select_tokens(
            self._penalized(rows, logits, slots), ids, candidate, k=ints([s.tokens_this_step for s in rows]),
            temperature=floats([q.temperature for q in p]), remask=ints([REMASK_CODE[q.remasking] for q in p]),
            threshold=floats(thresholds), factor=floats([q.factor or 0.0 for q in p]),
            seed=ints([q.seed or 0 for q in p]), step=ints([s.nfe for s in rows]),
            pos=start[:, None] + torch.arange(Wq, device=dev)[None, :],
            sampling=any(q.temperature > 0 for q in p), any_random=any(q.remasking == "random" for q in p),
            factor_rule=ints([FACTOR_RULE_CODE[q.factor_rule] for q in p]), conf_dtype=torch.float32,
            x0_from_probs=True, block_threshold=True, mask_id=self.mask_id,
            ban=self._ban(rows, start, Wq), **self._filters(p))
        if dev.type == "cpu":  # the published tie order: torch.topk over the block
            commit = topk_commit(conf, candidate, n_commit.tolist(), [0.0] * B,
                                 [(s.params.block_length, 0) for s in rows], commit)
        new = torch.where(commit, x0, ids)
        for r, s in enumerate(rows):  # write committed tokens back into each slot's row
            w = s.window[1] - s.window[0]
            self.tokens[s.slot, s.window[0]:s.window[1]] = new[r, :w]
        commit_h, new_h, conf_h = commit.cpu(), new.cpu(), conf.float().cpu()
        top = max((q.logprobs for q in p if q.logprobs is not None), default=-1)
        extra = None if top < 0 else tuple(None if t is None else t.cpu() for t in token_logprobs(logits, new, top))
        guess = torch.where(candidate & ~commit, x0, -1).cpu() if any(q.provisional for q in p) else None
        out = []
        for r in range(B):
            pos = commit_h[r].nonzero().flatten()
            lps = row_logprobs(extra, r, pos) if p[r].logprobs is not None else ()
            prov = row_provisional(guess, conf_h, r) if p[r].provisional else ()
            out.append(RowResult(pos.tolist(), new_h[r, pos].tolist(), conf_h[r, pos].tolist(), lps, prov))
        return out
