"""Runs one batched step of block-diffusion requests (SDAR, LLaDA2) over their exact KV caches.

Every slot owns a row of token ids and a row of keys/values at absolute positions (column =
position), so a request's cache is the prefix of its row: every block it has committed. A step
batches all running requests whatever block each is at:

- prefill rows: the next chunk of their prompt's whole blocks, block-causally (a query sees
  every key whose block is not after its own), keys/values stored; one part (a row of the
  forward) per block, each over its slot's keys up to its end;
- block rows: each request's current block over its cached prefix, bidirectional inside the
  block. A denoise row then commits tokens (`select_tokens`, the published rules); a
  store row (its block just finished) writes the block's keys/values to the cache.

On the per-row path (the CPU) both run in one forward where their blocks are as wide, and a
prompt's last chunk brings its first block's first denoise step along (`_parts`;
engine/families/block/chunked_prefill.py); the static path runs prefill rows, then block rows.

Fresh positions replace nothing: their keys/values are written in place at their columns of
the slot's cache (a prefill's and a store row's for good; a denoise row's are rewritten by its
block's store step), padded positions of shorter rows in scratch columns no real query sees, and
attention reads each row's prefix where it lies (`cache.BlockCache`). On CUDA the block forward
runs at static shapes (batch buckets, `attention.Spans` masks, the MoE's every-expert path) and
replays a CUDA graph where the bucket policy allows; prefill chunks run eager. Selection is the
full-canvas runner's (`families.selection.select_step`: `select_tokens` over a `SamplingBatch`)
under the family's rule; the contract is `runner_api.StepRunner`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence as Seq

import torch

from celeris.engine.models.attention import Spans
from celeris.engine.families.block.sequence import PREFILL, BlockSequence
from celeris.engine.models.cache import BlockCache, BlockKVStore
from celeris.engine.families.block.chunked_prefill import PrefillPacer, cap_prefill_chunks, prefill_tokens
from celeris.engine.families.block.levenshtein import edit_ids, joint_results
from celeris.engine.config import EngineConfig
from celeris.engine.families.family import Family
from celeris.engine.models.graphs import GraphCache, use_graph
from celeris.engine.models.transformer import MaskPredictor
from celeris.engine.models.moe import ROW_ALIGN, MoE
from celeris.engine.models.prefix_cache import slot_prefixes
from celeris.engine.families.selection import SelectionInput, constraint_work, select_step, structure_row
from celeris.engine.loop.runner_api import EMPTY, ConfigCosts, RowResult, StepStats, read_queued
from celeris.engine.sampling.batch import RowKnobs, SamplingBatch, Window


class BlockRunner(ConfigCosts):
    def __init__(self, model: MaskPredictor, config: EngineConfig, family: Family):
        self.model, self.config = model, config
        self.family = family
        self.device = next(model.parameters()).device
        self.mask_id = model.cfg.mask_token_id
        self.slots = config.max_batch
        # Prompt + canvas rounded up to whole blocks (a block is at most gen_length long).
        self.max_len = config.max_prompt_tokens + 2 * config.max_gen_length
        self.tokens = torch.full((self.slots + 1, self.max_len), self.mask_id, dtype=torch.long, device=self.device)
        # Scratch columns past max_len take padded fresh positions (a prefill chunk is the widest).
        scratch = max(config.prefill_chunk, config.max_gen_length) + ROW_ALIGN
        self.kv = model.kv_store(BlockKVStore, self.slots + 1, self.max_len, scratch=scratch)
        self.prefixes = slot_prefixes(config, self.kv, self.device)  # None: no prefix cache
        # The static-shape path (batch buckets, one masked kernel per layer, the MoE's static
        # experts) is what a CUDA graph captures; on CUDA it always runs, replayed from graphs
        # where the bucket policy says so. On the CPU rows attend one by one over views of the
        # cache (bits independent of the batch); set `static` to run the graph's path eagerly.
        # (A model split over ranks runs eager: its forward talks to the worker processes.)
        self.use_graphs = self.device.type == "cuda" and config.cuda_graphs and isinstance(model, MaskPredictor)
        self.static = self.device.type == "cuda"
        self._graphs = GraphCache()
        self._graphed = False
        self.pacer = PrefillPacer()  # prefill chunks beside decoding rows, from measured step times
        cfg = model.cfg  # a graphed MoE step computes every expert: E/k times the expert work
        self._graph_cost = max(1, cfg.num_experts // cfg.experts_per_token) if cfg.num_experts else 1

    @property
    def static(self) -> bool:
        return self._static

    @static.setter
    def static(self, on: bool) -> None:
        self._static = on
        # The MoE layers compute every expert at a static shape in a graph (its warm-up and
        # capture); on the CPU the static path does so eagerly, where tests compare it with the
        # expert loop. (An eager CUDA step keeps the loop: a launch per chosen expert.)
        self._set_moe_static(on and self.device.type == "cpu")

    def _set_moe_static(self, on: bool) -> None:
        if not hasattr(self, "_moes"):  # found once: a MoE model holds thousands of modules
            self._moes = [m for m in self.model.modules() if isinstance(m, MoE)]
        for m in self._moes:
            m.static = on

    @staticmethod
    def row_tokens(s: BlockSequence) -> int:
        """Fresh columns of this row's next forward, plus its cached context at a 1/32 weight
        (attention reads it): the scheduler's cost estimate."""
        start, end = s.window
        return end - start + start // 32

    @staticmethod
    def row_constraint_work(s: BlockSequence) -> int:
        """Masks only where the row denoises (a prefill chunk selects nothing)."""
        return constraint_work(s.constraint if s.denoising else None, s.params)

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
        seq.fuse_first_block = self.fuses  # (set again each step; read by its planned steps)
        seq.joint_ids = edit_ids(self.model.cfg, seq)  # LLaDA2.2's joint decode (None: the plain rule)
        if self.prefixes is not None:  # the prompt's cached blocks: prefill only the rest
            self.prefixes.load(seq)

    @property
    def overlaps_host(self) -> bool:
        """On an accelerator `step(during=...)` runs host work before the read of its results."""
        return self.device.type != "cpu"

    @property
    def fuses(self) -> bool:
        """Whether a step may put prefill and block rows in one forward, and a prompt's last chunk
        with its first block (`BlockSequence.fuse_first_block`): on the per-row path, where a
        row's bits do not depend on what shares its forward; the static path keeps them apart."""
        return not self.static

    @torch.no_grad()
    def step(self, seqs: Seq[BlockSequence], during: Optional[Callable[[], None]] = None
             ) -> tuple[list[RowResult], StepStats]:
        t0 = time.perf_counter()
        forwards, widest, graphed, reads = 0, (0, 0, 0), False, []
        cap_prefill_chunks(seqs, self.config.chunked_prefill, self.pacer.chunk())
        for s in seqs:
            s.fuse_first_block = self.fuses
        prompt = prefill_tokens(seqs)
        decoding = any(s.phase != PREFILL for s in seqs)
        for group in self._groups(seqs):
            rows = [seqs[i] for i in group]
            self._graphed = False
            read, B, Wq = self._forward(rows)
            reads.append((group, read))
            prefill = [s for s in rows if s.phase == PREFILL]
            if self.prefixes is not None and prefill:  # their chunks' keys/values are in the slots now
                self.prefixes.offer(prefill)
            forwards += 1
            graphed |= self._graphed
            widest = max(widest, (B * Wq, B, Wq))
        results, committed = read_queued(reads, len(seqs), during)
        seconds = time.perf_counter() - t0
        self.pacer.observe(seconds, prompt, decoding)
        return results, StepStats(len(seqs), widest[1], widest[2], widest[2], committed, seconds, graphed, forwards)

    def _groups(self, seqs: Seq[BlockSequence]) -> list[list[int]]:
        """The step's forwards, as row indices: prefill rows and block rows together where the
        runner `fuses` and their parts are as wide (no padding added), else apart."""
        prefill = [i for i, s in enumerate(seqs) if s.phase == PREFILL]
        block = [i for i, s in enumerate(seqs) if s.phase != PREFILL]
        if self.fuses and prefill and block and self._width(seqs, prefill) == self._width(seqs, block):
            return [prefill + block]
        return [g for g in (prefill, block) if g]

    @staticmethod
    def _width(seqs: Seq[BlockSequence], group: list[int]) -> int:
        """The padded width of a forward of these rows' parts (one block each)."""
        w = max(seqs[i].params.block_length for i in group)
        return w + -w % ROW_ALIGN

    @staticmethod
    def _parts(rows: list[BlockSequence]) -> list[tuple[int, int, int, int, bool]]:
        """(row, slot, start, width, selects) of one forward, selecting parts first: a block row
        is one part; a prefill row is one part per prompt block of its chunk, then its first
        block if it joins decoding. A prompt block's part attends, bidirectionally, over its
        slot's keys up to its end: block-causal prefill, the very call a block row makes, so its
        keys/values round alike in any chunk and beside any rows (and so the prefix cache is
        exact). Every part writes its keys/values before any part of the layer attends, so a
        part sees the blocks before it in the same forward."""
        parts = []
        for r, s in enumerate(rows):
            if s.phase != PREFILL:
                start, end = s.window
                parts.append((r, s.slot, start, end - start, True))
                continue
            b, (lo, hi) = s.params.block_length, s.prefill_window
            parts += [(r, s.slot, a, b, False) for a in range(lo, hi, b)]
            if s.joins_decode:
                parts.append((r, s.slot, hi, b, True))
        return [p for p in parts if p[4]] + [p for p in parts if not p[4]]

    def _forward(self, rows: list[BlockSequence]) -> tuple[Callable[[], list[RowResult]], int, int]:
        """One forward over the rows' parts (`_parts`); select where a row denoises. Every part's
        keys/values land in the cache in place, so those of a prefill, a store step and an editing
        block's last post step (`BlockSequence.stores_block`) are the ones kept. -> (the read of
        the rows' results, parts, padded width)."""
        parts = self._parts(rows)
        B, H = len(parts), sum(p[4] for p in parts)
        Wq, Lc = max(p[3] for p in parts), max(p[2] + p[3] for p in parts)
        if H < B or self.device.type == "cpu":  # B * Wq a multiple of ROW_ALIGN: a row's keys/values
            Wq += -Wq % ROW_ALIGN  # and logits round alike in any chunk and any batch (CPU GEMMs)
        static = self.static and H == B  # prefill parts run eager at their exact shape
        Bp = self.config.bucket_batch(B) if static else B
        geo = [[slot, start, width] for _, slot, start, width, _ in parts]
        geo += [[self.slots, 0, 0]] * (Bp - B)  # padding rows: the spare slot, nothing real
        slots, start, width = torch.tensor(geo, dtype=torch.long).T.contiguous().to(self.device)
        j = torch.arange(Wq, device=self.device)
        real = j[None, :] < width[:, None]  # (Bp, Wq)
        cols = torch.where(real, start[:, None] + j[None, :], self.max_len + j[None, :])  # padded -> scratch
        ids = torch.gather(self.tokens[slots], 1, cols.clamp(max=self.max_len - 1))
        ids = torch.where(real, ids, torch.full_like(ids, self.mask_id))
        positions = start[:, None] + j[None, :]
        if static:
            Lk = min(self.config.bucket_length(Lc), self.max_len)
            inputs = (ids, positions, slots, cols, width, (start + width).clamp_min(1))
            self._graphed = self.use_graphs and use_graph(Bp * Wq * self._graph_cost, self.config.graph_max_tokens)
            if self._graphed:
                self._set_moe_static(True)  # the warm-up runs the captured path too
                try:
                    logits = self._graphs.run((Bp, Wq, Lk), inputs, lambda *x: self._static_forward(Lk, *x),
                                              self._harmless(Bp, Wq))
                finally:
                    self._set_moe_static(self._static and self.device.type == "cpu")
            else:
                logits = self._static_forward(Lk, *inputs)
        else:
            spans = Spans(width, start + width)
            cache = BlockCache(self.kv, slots, cols, Lc, [(p[1], p[2] + p[3]) for p in parts])
            logits = self.model(ids, positions=positions, cache=cache, spans=spans.rows(), head_rows=H)
        if not H:
            return (lambda: [EMPTY] * len(rows)), B, Wq
        order = [p[0] for p in parts[:H]]  # a row has at most one selecting part
        read = self._select([rows[r] for r in order], logits[:H], ids[:H], real[:H], slots[:H], start[:H])

        def results() -> list[RowResult]:
            out = [EMPTY] * len(rows)
            for r, result in zip(order, read()):
                out[r] = result
            return out
        return results, B, Wq

    def _static_forward(self, Lk: int, ids, positions, slots, cols, q_len, k_end) -> torch.Tensor:
        """The block forward at a fixed shape: one masked attention kernel per layer over the
        first Lk cache columns, the MoE's static expert computation; what a CUDA graph captures."""
        return self.model(ids, positions=positions, cache=BlockCache(self.kv, slots, cols, Lk),
                          spans=Spans(q_len, k_end))

    def _harmless(self, B: int, Wq: int) -> tuple[torch.Tensor, ...]:
        """Inputs of a (B, Wq) bucket whose rows write only the spare slot's scratch columns."""
        dev, j = self.device, torch.arange(Wq, device=self.device)
        zeros = torch.zeros(B, dtype=torch.long, device=dev)
        return (torch.full((B, Wq), self.mask_id, device=dev), j.expand(B, Wq).clone(),
                torch.full((B,), self.slots, device=dev), (self.max_len + j).expand(B, Wq).clone(),
                zeros, zeros + 1)

    def _select(self, rows: list[BlockSequence], logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor,
                slots: torch.Tensor, start: torch.Tensor) -> Callable[[], list[RowResult]]:
        """Commit tokens in the denoise rows' blocks, as the published loops choose them: LLaDA2.2's
        joint decode row by row (block/levenshtein.py), the others in one selection; the call that
        reads the rows' results."""
        joint = [r for r, s in enumerate(rows) if s.joint_ids is not None and s.denoising]
        if not joint:
            return self._select_plain(rows, logits, ids, real, slots, start)
        done = joint_results([rows[r] for r in joint], logits[joint], ids[joint], self.tokens)
        rest = [r for r in range(len(rows)) if r not in joint]
        read_rest = (self._select_plain([rows[r] for r in rest], logits[rest], ids[rest], real[rest], slots[rest],
                                        start[rest]) if rest else list)

        def read() -> list[RowResult]:
            out = [EMPTY] * len(rows)
            for r, result in zip(rest, read_rest()):
                out[r] = result
            for r, result in zip(joint, done):
                out[r] = result
            return out
        return read

    def _select_plain(self, rows: list[BlockSequence], logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor,
                      slots: torch.Tensor, start: torch.Tensor) -> Callable[[], list[RowResult]]:
        """The selection of rows that decode by their family's rule (`select_step`)."""
        B, Wq = ids.shape
        dev = self.device
        denoise = torch.tensor([s.denoising for s in rows], device=dev)
        candidate = real & (ids == self.mask_id) & denoise[:, None]
        batch = SamplingBatch.build([RowKnobs(s.params, s.tokens_this_step, s.noise_step, s.stop_ids, edits=s.edits_now)
                                     for s in rows], B, self.model.cfg.vocab_size, dev)
        pos = start[:, None] + torch.arange(Wq, device=dev)[None, :]  # absolute positions key the noise
        prompt = torch.tensor([len(s.prompt) for s in rows], device=dev)
        canvas = self.tokens[slots] if batch.frequency is not None else None
        constraints = [structure_row(s.constraint if s.denoising else None, s.block_window[0] - len(s.prompt),
                                     s.block_window[1] - s.block_window[0], Wq, s.params) for s in rows]
        editable = None
        if batch.editing is not None:  # LLaDA2.1: written tokens of the block, never the prompt's tail
            editable = real & denoise[:, None] & (ids != self.mask_id) & (pos >= prompt[:, None])
        window = Window(ids, candidate, pos, pos - prompt[:, None], canvas, prompt)
        spans = [(s.params.block_length, 0) for s in rows]
        new, read = select_step(logits, SelectionInput(batch, window, self.family.rule, real & denoise[:, None],
                                                       constraints, spans, editable))
        for r, s in enumerate(rows):  # write committed tokens back into each slot's row
            a, e = s.block_window
            self.tokens[s.slot, a:e] = new[r, :e - a]
        return read
