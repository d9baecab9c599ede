"""Runs one batched step of Nemotron-Labs-Diffusion requests, whatever mode and phase each is in.

Every slot owns a row of keys/values at absolute columns (`cache.BlockKVStore`): a forward writes
its fresh keys/values in place at their columns and each row attends over its slot's columns up to
its window's end, causal or bidirectional, with or without the draft adapter (`model.Rows`). What
is written for good is what a causal forward writes (prefill, an ar step, a diffusion block's store
step, a verify pass); a denoise or draft forward's keys/values sit at columns the next causal
forward of the same window rewrites, and a rejected draft's tail at columns the next block
overwrites before anyone reads them (a row never reads past its window's end).

Rows are grouped into forwards of like width (`forward_kind`: prefill chunks together, then one
forward per window width: 1 for ar steps, the block length for denoise / store / draft / verify
rows of any mode). Each row's picks are computed where its phase reads them (sequence.py): the
argmax, or at a temperature a Gumbel-max draw keyed by (seed, step, position), so a seeded
request draws the same tokens alone or in any batch; its confidence is the softmax probability
of the pick. The contract is `runner_api.StepRunner`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence as Seq

import torch

from celeris.engine.config import EngineConfig
from celeris.engine.families.family import Family
from celeris.engine.families.nemotron.model import NemotronLM, Rows
from celeris.engine.families.nemotron.sequence import PREFILL, NemotronSequence
from celeris.engine.loop.runner_api import EMPTY, ConfigCosts, RowResult, StepStats
from celeris.engine.models.cache import BlockCache, BlockKVStore
from celeris.engine.models.moe import ROW_ALIGN
from celeris.engine.sampling.noise import position_hash, row_scores

_STREAM = 0x4E4C44  # the noise stream of this family's draws


class NemotronRunner(ConfigCosts):
    def __init__(self, model: NemotronLM, config: EngineConfig, family: Family):
        self.model, self.config, self.family = model, config, family
        self.device = next(model.parameters()).device
        self.mask_id = model.cfg.mask_token_id
        self.slots = config.max_batch
        # prompt + output + a draft block past the last token (a block is at most gen_length long)
        self.max_len = config.max_prompt_tokens + 2 * config.max_gen_length + 1
        scratch = max(config.prefill_chunk, config.max_gen_length) + 1
        self.kv = model.kv_store(BlockKVStore, self.slots + 1, self.max_len, scratch=scratch)

    @staticmethod
    def row_tokens(s: NemotronSequence) -> int:
        """Fresh columns of the row's next forward, plus its context at a 1/32 weight."""
        start, end = s.window
        return end - start + start // 32

    @staticmethod
    def forward_kind(s: NemotronSequence) -> object:
        start, end = s.window
        return PREFILL if s.phase == PREFILL else end - start

    def load(self, seq: NemotronSequence) -> None:
        """Nothing to write up front: a row's ids come from its sequence each step."""

    @torch.no_grad()
    def step(self, seqs: Seq[NemotronSequence], during: Optional[Callable[[], None]] = None
             ) -> tuple[list[RowResult], StepStats]:
        t0 = time.perf_counter()
        groups: dict[object, list[int]] = {}
        for i, s in enumerate(seqs):
            groups.setdefault(self.forward_kind(s), []).append(i)
        results, committed, widest = [EMPTY] * len(seqs), 0, (0, 0)
        for indices in groups.values():
            rows = [seqs[i] for i in indices]
            for i, r in zip(indices, self._forward(rows)):
                results[i] = r
                committed += len(r.tokens)
            widest = max(widest, (len(rows), max(s.window[1] - s.window[0] for s in rows)))
        return results, StepStats(len(seqs), widest[0], widest[1], widest[1], committed,
                                  time.perf_counter() - t0, False, len(groups))

    def _forward(self, rows: list[NemotronSequence]) -> list[RowResult]:
        """One forward over the rows' windows; the picks each row's phase reads."""
        dev, B = self.device, len(rows)
        windows = [s.window for s in rows]
        width = [e - a for a, e in windows]
        W = max(width)
        if self.device.type == "cpu":  # B * W a multiple of ROW_ALIGN: CPU GEMMs round a row alike in
            W += -W % ROW_ALIGN  # any batch and window (an ar step's token as in a verify pass)
        ids = torch.full((B, W), self.mask_id, dtype=torch.long)
        for r, s in enumerate(rows):
            ids[r, :width[r]] = torch.tensor(s.ids, dtype=torch.long)
        start = torch.tensor([a for a, _ in windows], dtype=torch.long)
        j = torch.arange(W)
        real = j[None, :] < torch.tensor(width)[:, None]  # (B, W)
        positions = start[:, None] + j[None, :]
        cols = torch.where(real, positions, self.max_len + j[None, :])  # padded -> scratch columns
        slots = torch.tensor([s.slot for s in rows], dtype=torch.long)
        spec = Rows(tuple(width), tuple(e for _, e in windows), tuple(s.causal for s in rows),
                    tuple(s.lora for s in rows))
        cache = BlockCache(self.kv, slots.to(dev), cols.to(dev), 0, [(s.slot, e) for s, (_, e) in zip(rows, windows)])
        head_at = None
        if all(s.phase == PREFILL for s in rows):  # a prefill reads at most its last position
            head_at = (torch.tensor(width) - 1)[:, None].to(dev)
        logits = self.model(ids.to(dev), positions.to(dev), cache, spec, head_at)  # (B, K, V)
        if head_at is not None:
            positions = positions.gather(1, head_at.cpu())
        return self._picks(rows, logits, positions)

    def _picks(self, rows: list[NemotronSequence], logits: torch.Tensor, positions: torch.Tensor
               ) -> list[RowResult]:
        """Per row: the pick and its confidence at each position its phase reads."""
        picks = logits.argmax(-1)  # (B, K)
        hot = [r for r, s in enumerate(rows) if s.params.temperature > 0 and (s.reads_all or s.reads_last)]
        for r in hot:  # seeded Gumbel-max draws at the row's absolute positions
            s = rows[r]
            seed = torch.tensor([int(s.params.seed or 0)], device=logits.device)
            step = torch.tensor([s.nfe], device=logits.device)
            h = position_hash(seed, step, positions[r:r + 1].to(logits.device), _STREAM)[0]  # (K,)
            temp = torch.full((logits.shape[1],), float(s.params.temperature), device=logits.device)
            picks[r] = row_scores(logits[r], h, temp).argmax(-1)
        conf = torch.softmax(logits, dim=-1).gather(-1, picks[..., None])[..., 0]  # (B, K), logits dtype
        picks_h, conf_h = picks.tolist(), conf.float().tolist()
        out = []
        for r, s in enumerate(rows):
            w = s.window[1] - s.window[0]
            if s.reads_all:
                out.append(RowResult(list(range(w)), picks_h[r][:w], conf_h[r][:w]))
            elif s.reads_last:
                k = 0 if len(picks_h[r]) == 1 else w - 1
                out.append(RowResult([w - 1], [picks_h[r][k]], [conf_h[r][k]]))
            else:
                out.append(EMPTY)
        return out


__all__ = ["NemotronRunner"]
