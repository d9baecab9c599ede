"""Runs one batched denoising step of full-canvas requests (LLaDA, Dream) over a shape bucket.

The canvases of all running requests live in one preallocated buffer, one row per slot, each
right-aligned so that a left-padded batch of any length L is the buffer's last L columns; RoPE
positions count from each row's first real token (as the published models see an unpadded
prompt), so a row's logits and cached keys do not depend on the batch it shares.
A step packs the rows' geometry into one small tensor and their sampling knobs into a
`SamplingBatch` (one host->device copy each), runs one forward whose head is evaluated only on
each row's current-block window, selects tokens (`families.selection.select_step`, the selection
tail the block runner ends with too), writes them back by position, and copies the per-row result to
the host once.
On CUDA the forward of a fixed-shape bucket is captured once as a CUDA graph and replayed, in
every mode (full, cfg, a cache block's store step, the prefix/dual cached steps over the
preallocated cache), where the bucket policy (`graphs.use_graph`) says so; selection runs after
the replay, so no sampling knob keeps a request off the graph. On CPU it runs eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence as Seq

import torch

from celeris.engine.models.cache import CanvasCache, KVCacheStore
from celeris.engine.config import EngineConfig
from celeris.engine.families.family import Family
from celeris.engine.models.graphs import GraphCache, use_graph
from celeris.engine.models.moe import ROW_ALIGN
from celeris.engine.models.transformer import MaskPredictor
from celeris.engine.families.selection import SelectionInput, constraint_work, select_step, structure_row
from celeris.engine.loop.runner_api import ConfigCosts, RowResult, StepStats, read_queued
from celeris.engine.sampling.batch import RowKnobs, SamplingBatch, Window
from celeris.engine.families.canvas.sequence import CanvasSequence

# Rows of the packed geometry input.
IDX, LENGTH, GEN_LEN, BLOCK_START, BLOCK_LEN, FIRST_ONLY = range(6)
SPREAD_KEEP = 64 << 20  # bytes of window logits a mode keeps between steps (`Runner._spread_buffer`)


def _row_aligned(n: int) -> int:
    """n rounded up to a multiple of ROW_ALIGN: an eager CPU forward pads its columns (left
    padding, repeated fresh columns, spare window columns) so that a row's bits do not depend on
    how many rows share its matmuls, nor on the batch's longest row (docs/architecture.md)."""
    return n + -n % ROW_ALIGN


@dataclass(frozen=True)
class Bucket:
    """The fixed shape of one forward: what a CUDA graph is captured for."""

    B: int
    L: int
    W: int
    padded: bool = True  # some row is shorter than L (else attention runs without a mask)
    fresh: int = 0  # fresh width of a cached step: the block (dual) or block-to-end (prefix)


class View(NamedTuple):
    """A bucket's rows as the forward and the selection see them (device tensors)."""

    ids: torch.Tensor  # (B, L) left-padded canvases
    valid: Optional[torch.Tensor]  # (B, L) False at padding; None when no row is padded
    positions: torch.Tensor  # (B, L) RoPE positions from each row's first real token
    start: torch.Tensor  # (B,) block start, batch coordinates
    in_block: torch.Tensor  # (B, W) window columns inside the row's block
    out_index: torch.Tensor  # (B, W) the window's columns


class Packed(NamedTuple):
    """One group's packed step as its selection reads it: the bucket, the rows' geometry (their
    `geo` columns), the view, the sampling columns, the rows' attention spans and the rows."""

    b: Bucket
    geo: torch.Tensor  # (6, B): IDX, LENGTH, GEN_LEN, BLOCK_START, BLOCK_LEN, FIRST_ONLY per row
    view: View
    batch: SamplingBatch
    spans: list[tuple[int, int]]
    group: Seq[CanvasSequence]


class Runner(ConfigCosts):
    def __init__(self, model: MaskPredictor, config: EngineConfig, family: Family):
        self.model = model
        self.config = config
        self.family = family
        self.device = next(model.parameters()).device
        self.mask_id = model.cfg.mask_token_id
        self.max_len = config.bucket_length(config.max_prompt_tokens + config.max_gen_length)
        self.slots = config.max_batch
        # One extra all-mask row serves as padding when a batch is rounded up to its bucket.
        self.canvas = torch.full((self.slots + 1, self.max_len), self.mask_id, dtype=torch.long, device=self.device)
        self.kv: KVCacheStore | None = None  # allocated on the first request that uses a cache
        if config.kv_cache != "none":
            self._cache_store()
        # (A model split over ranks runs eager: its forward talks to the worker processes.)
        self.use_graphs = self.device.type == "cuda" and config.cuda_graphs and isinstance(model, MaskPredictor)
        self._graphs = GraphCache()
        self.static = False  # run the graphs' bucket shapes eagerly (CPU tests of the graph path)
        self._spread: dict[str, torch.Tensor] = {}  # per mode: `_spread_buffer`

    def cache_mode(self, seq: CanvasSequence) -> str:
        """The request's KV cache mode: its own choice, else the engine's default."""
        return seq.params.kv_cache or self.config.kv_cache

    def _cache_store(self) -> KVCacheStore:
        if self.kv is None:  # normal tensors even when the first user runs under inference_mode
            with torch.inference_mode(False):
                self.kv = self.model.kv_store(KVCacheStore, self.slots + 1, self.max_len)
        return self.kv

    def row_tokens(self, s: CanvasSequence) -> int:
        """Columns this row's next forward computes (twice with CFG): the scheduler's cost estimate."""
        mode, _ = self._plan(s)
        if mode.startswith("cached-prefix"):
            return s.params.gen_length - s.block_start + 1
        if mode.startswith("cached-dual"):
            return s.params.block_length + 1
        return s.length * (2 if mode == "cfg" else 1)

    def row_constraint_work(self, s: CanvasSequence) -> int:
        return constraint_work(s.constraint, s.params)

    def forward_kind(self, s: CanvasSequence) -> str:
        """The forward this row's next step joins (`step` runs one per kind): the scheduler
        groups rows by length within a kind only."""
        return self._plan(s)[0]

    def load(self, seq: CanvasSequence) -> None:
        """Write a request's prompt + canvas into its slot (right-aligned): masks (and a structured
        output's skeleton) when new, where it stood when it was preempted (engine/loop/fair_share.py)."""
        row = torch.full((self.max_len,), self.mask_id, dtype=torch.long)
        row[self.max_len - seq.length:self.max_len - seq.params.gen_length] = torch.tensor(seq.prompt)
        row[self.max_len - seq.params.gen_length:] = torch.tensor(seq.canvas)
        self.canvas[seq.slot].copy_(row.to(self.device))

    def resumable(self, seq: CanvasSequence) -> bool:
        """Whether `load` into any slot continues `seq` exactly: its canvas is all the state a
        full forward reads, and a KV cache is rewritten at each block's first step ("store")."""
        return self._plan(seq)[0] in ("full", "cfg", "store")

    # ------------------------------------------------------------------ host side

    def _plan(self, s: CanvasSequence) -> tuple[str, bool]:
        """(mode, first_only) of a row this step.

        Modes: full forward (`full`, `cfg`), a cache block's first step (`store`) or a cached step
        (`cached-prefix`, `cached-dual`). A Dream model with a cache runs Fast-dLLM's Dream block
        loop where one exists (Dream's schedule or threshold/factor): a block's first step commits
        only its first position, whose logit needs the column before the block; later steps see
        the window from the block on. Otherwise (Dream with LLaDA's schedule) the cached window
        starts one column early (`-lead`) so that the block's first logit stays fresh.
        """
        cache, p = self.cache_mode(s), s.params
        if p.cfg_scale > 0:
            return "cfg", False
        if cache == "none":
            return "full", False
        dream_loop = self.model.cfg.logit_shift and (p.schedule == "dream" or p.adaptive)
        if s.step_in_block == 0:
            return "store", dream_loop and (p.adaptive or p.steps_per_block > 1)
        lead = self.model.cfg.logit_shift and not dream_loop
        return f"cached-{cache}" + ("-lead" if lead else ""), False

    def _bucket(self, seqs: Seq[CanvasSequence], mode: str) -> tuple[Bucket, bool]:
        """(shape, graphed): graphs run a bucket's shape where the policy allows (few shapes to
        capture); eager runs take the exact shape."""
        n, longest = len(seqs), max(s.length for s in seqs)
        W = max(s.params.block_length for s in seqs)
        fresh = 0
        if mode.startswith("cached-prefix"):
            fresh = max(s.params.gen_length - s.block_start for s in seqs)
        elif mode.startswith("cached-dual"):
            fresh = W
        fresh += mode.endswith("-lead")
        B, L = self.config.bucket_batch(n), min(self.config.bucket_length(longest), self.max_len)
        if mode.startswith("cached-prefix"):  # extra fresh columns repeat the row's last one
            bucket_fresh = min(self.config.bucket_length(fresh), L)
        else:
            bucket_fresh = fresh
        tokens = B * (bucket_fresh or L) * (2 if mode == "cfg" else 1)
        graph = self.use_graphs and use_graph(tokens, self.config.graph_max_tokens)
        if graph or self.static:
            fresh = bucket_fresh
        else:
            B, L = n, longest
            if self.device.type == "cpu":  # batch invariance: every matmul over a multiple of ROW_ALIGN rows
                L, W = min(_row_aligned(L), self.max_len), _row_aligned(W)
                fresh = _row_aligned(max(fresh, W + mode.endswith("-lead"))) if fresh else 0
        return Bucket(B, L, W, padded=B > n or any(s.length < L for s in seqs), fresh=fresh), graph

    def _pack(self, seqs: Seq[CanvasSequence], mode: str, first_only: Seq[bool]):
        """(bucket, geometry (6, B) on the device, sampling record, spans) of one forward's rows."""
        b, graph = self._bucket(seqs, mode)
        geo = [[s.slot, s.length, s.params.gen_length, s.block_start, s.params.block_length, int(first)]
               for s, first in zip(seqs, first_only)]
        geo += [[self.slots, 1, 1, 0, 0, 0]] * (b.B - len(seqs))  # padding rows: the spare slot, no block
        knobs = [RowKnobs(s.params, s.tokens_this_step, s.nfe, s.stop_ids, first) for s, first in zip(seqs, first_only)]
        batch = SamplingBatch.build(knobs, b.B, self.model.cfg.vocab_size, self.device)
        # The array each published loop ranks with torch.topk: (its length, the window's offset).
        if mode.startswith("cached-prefix"):
            spans = [(s.params.gen_length - s.block_start, 0) for s in seqs]
        elif mode.startswith("cached-dual"):
            spans = [(s.params.block_length, 0) for s in seqs]
        else:
            spans = [(s.length, len(s.prompt) + s.block_start) for s in seqs]
        spans += [(0, 0)] * (b.B - len(seqs))
        scale = torch.tensor([s.params.cfg_scale for s in seqs] + [0.0] * (b.B - len(seqs)), device=self.device)
        return b, graph, torch.tensor(geo, dtype=torch.long).T.contiguous().to(self.device), scale, batch, spans

    @property
    def overlaps_host(self) -> bool:
        """On an accelerator the step's work is queued, and `step(during=...)` runs host work
        before the one read of its results (runner_api.StepRunner)."""
        return self.device.type != "cpu"

    @torch.no_grad()
    def step(self, seqs: Seq[CanvasSequence], during: Optional[Callable[[], None]] = None
             ) -> tuple[list[RowResult], StepStats]:
        """One denoising step for every sequence; cache refreshes and CFG rows form own groups."""
        t0 = time.perf_counter()
        groups: dict[str, list[int]] = {}
        plans = [self._plan(s) for s in seqs]
        for i, (mode, _) in enumerate(plans):
            groups.setdefault(mode, []).append(i)
        graphed, biggest, reads = False, None, []
        for mode, members in groups.items():
            group = [seqs[i] for i in members]
            b, graph, geo, scale, batch, spans = self._pack(group, mode, [plans[i][1] for i in members])
            view = self._view(b, geo)
            logits = self._replay(mode, b, geo, scale) if graph else self._forward(mode, b, view, geo, scale)
            reads.append((members, self._select(Packed(b, geo, view, batch, spans, group), logits)))
            graphed |= graph
            biggest = b if biggest is None or b.B * b.L > biggest.B * biggest.L else biggest
        results, committed = read_queued(reads, len(seqs), during)
        return results, StepStats(len(seqs), biggest.B, biggest.L, biggest.W, committed,
                                  time.perf_counter() - t0, graphed, len(groups) + ("cfg" in groups))

    # ------------------------------------------------------------------ device side

    def _view(self, b: Bucket, geo: torch.Tensor) -> View:
        L, W = b.L, b.W
        ids = self.canvas[geo[IDX], self.max_len - L:]  # (B, L) left-padded batch
        col = torch.arange(L, device=self.device)
        pad = (L - geo[LENGTH])[:, None]  # (B, 1) padding columns of each row
        valid = col[None, :] >= pad if b.padded else None
        positions = (col[None, :] - pad).clamp_min(0)
        start = L - geo[GEN_LEN] + geo[BLOCK_START]
        w = torch.arange(W, device=self.device)
        in_block = w[None, :] < geo[BLOCK_LEN][:, None]
        return View(ids, valid, positions, start, in_block, (start[:, None] + w[None, :]).clamp(max=L - 1))

    def _forward(self, mode: str, b: Bucket, v: View, geo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The window's logits (B, W, V) of one bucket; a cache block's first step stores its
        keys/values. Fixed shapes, no host sync on CUDA: what a CUDA graph captures, every mode."""
        if mode.startswith("cached"):
            # A dual row's fresh columns stop at its own block: past it (a wider block in the
            # batch) they repeat its last block column, so the cached suffix stays as stored.
            last = (v.start + geo[BLOCK_LEN] - 1) if mode.startswith("cached-dual") else None
            return self._cached_logits(v, geo[IDX], b.fresh, b.W, mode.endswith("-lead"), last)
        live = self._live_columns(v)
        out_index = v.out_index if live is None else v.out_index.gather(1, live)
        if mode == "store":
            logits, kvs = self.model(v.ids, key_mask=v.valid, positions=v.positions, out_index=out_index,
                                     return_kv=True)
            self._cache_store().write(geo[IDX], kvs)
        else:
            logits = self.model(v.ids, key_mask=v.valid, positions=v.positions, out_index=out_index)
            if mode == "cfg":  # scale (B,): each row's guidance, 0 for padding rows
                logits = self._guided(logits, v._replace(out_index=out_index), geo, scale)
        if live is None:
            return logits
        B, K, V = logits.shape  # whole vocabulary rows copied back (index_copy_: a scatter goes element by element)
        full = self._spread_buffer(mode, b.B * b.W, V, logits.dtype)  # columns the selection never reads are 0
        rows = (live + torch.arange(B, device=live.device)[:, None] * b.W).reshape(-1)
        return full.index_copy_(0, rows, logits.reshape(B * K, V)).view(b.B, b.W, V)

    def _spread_buffer(self, mode: str, n: int, V: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed (n, V) buffer for one forward's window logits (CPU). One is kept per mode (a
        step runs one forward per mode and reads them all at its end) while it stays under
        SPREAD_KEEP bytes: a fresh allocation of that size is new pages from the system each
        step, and faulting them in cost a fifth of a small model's selection. Larger ones
        (wide vocabularies, big batches) are allocated per step, where their share is small."""
        size = n * V
        buf = self._spread.get(mode)
        if buf is not None and buf.dtype == dtype and buf.numel() >= size:
            return buf[:size].view(n, V).zero_()
        if size * dtype.itemsize > SPREAD_KEEP:
            return torch.zeros((n, V), dtype=dtype, device=self.device)
        with torch.inference_mode(False):  # a normal tensor: a later step may run outside inference mode
            buf = self._spread[mode] = torch.zeros(size, dtype=dtype, device=self.device)
        return buf.view(n, V)

    def _live_columns(self, v: View) -> Optional[torch.Tensor]:
        """CPU: the window columns (B, K) the head (and the last layer's queries and MLP,
        MaskPredictor.forward) need run on, or None for all W. A step reads
        logits only where a mask is still left in the row's block (committed and skeleton tokens
        stay as they are), and one token a step leaves the block's masks a little fewer each
        step: with one block of 128, half the window on average. Each row's still-masked
        columns come first, in order, then its others up to K, the most any row needs, rounded up
        to ROW_ALIGN (so a row's logits round as in the full window's GEMM: identical bits).
        On a GPU the window keeps its bucket's fixed shape (CUDA graphs)."""
        if self.device.type != "cpu" or self.static:
            return None
        W = v.out_index.shape[1]
        live = v.in_block & (torch.gather(v.ids, 1, v.out_index) == self.mask_id)  # (B, W)
        K = _row_aligned(max(int(live.sum(1).max()), 1))
        if K >= W:
            return None
        return torch.sort((~live).to(torch.uint8), dim=1, stable=True).indices[:, :K]

    def _select(self, p: Packed, logits: torch.Tensor) -> Callable[[], list[RowResult]]:
        """Select over the window and write the picks back by position; the call that reads the
        rows' results (the host's wait for the device)."""
        b, geo, v, batch, spans, group = p
        B, L, W = b.B, b.L, b.W
        tokens = torch.gather(v.ids, 1, v.out_index)
        w = torch.arange(W, device=self.device)
        candidate = v.in_block & (tokens == self.mask_id) & ((geo[FIRST_ONLY] == 0)[:, None] | (w == 0)[None, :])
        pos = geo[BLOCK_START][:, None] + w[None, :]  # generated-region positions key the noise
        constraints = [structure_row(s.constraint, s.block_start, s.params.block_length, W, s.params) for s in group]
        window = Window(tokens, candidate, pos, pos, v.ids, L - geo[GEN_LEN])
        new, read = select_step(logits, SelectionInput(batch, window, self.family.rule, v.in_block,
                                                       constraints + [None] * (B - len(group)), spans))
        # Write back by position. Window columns past the row's end are not clamped here (the
        # duplicates would race): they land in scratch columns. Padding rows touch the spare row.
        scratch = torch.cat([v.ids, v.ids.new_full((B, W), self.mask_id)], dim=1)  # (B, L + W)
        ids = scratch.scatter(1, v.start[:, None] + w[None, :], torch.where(v.in_block, new, tokens))[:, :L]
        self.canvas[geo[IDX], self.max_len - L:] = ids
        return read

    def _cached_logits(self, v: View, idx: torch.Tensor, fresh: int, W: int, lead: bool,
                       last: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Recompute only the fresh columns — the block (dual) or block to end (prefix) — over
        the row's cached keys/values, which hold the rest from the block's first step.

        Dream's logit at a column comes from the hidden state one column to its left; the model
        shifts inside the window, so the window's first logit is its own column's. With `lead`
        the window starts one column before the block so that the block's first logit is fresh.
        """
        L = v.ids.shape[1]
        lead = int(lead)
        f = torch.arange(fresh, device=self.device)
        first = v.start[:, None] - lead
        end = L - 1 if last is None else torch.maximum(last, v.start - lead).clamp(max=L - 1)[:, None]
        fresh_cols = torch.minimum(first + f[None, :], torch.as_tensor(end, device=self.device))  # (B, F)
        # Columns past a row's end (or its block, dual) repeat its last column; their duplicate
        # keys are written where that column's already are (same token, same position).
        fresh_ids = torch.gather(v.ids, 1, fresh_cols)
        fresh_pos = torch.gather(v.positions, 1, fresh_cols)
        rows = idx.tolist() if self.device.type == "cpu" else None  # CPU: attention over views, row by row
        cache = CanvasCache(self.kv, idx, fresh_cols, L, v.valid, rows)
        logits = self.model(fresh_ids, positions=fresh_pos, cache=cache)  # (B, F, V)
        return logits[:, lead:lead + W]  # the block opens the fresh window

    def _guided(self, logits: torch.Tensor, v: View, geo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance: the same rows with their prompts masked, then un + (s+1)(c-un)."""
        L = v.ids.shape[1]
        in_prompt = torch.arange(L, device=self.device)[None, :] < (L - geo[GEN_LEN])[:, None]
        un_ids = torch.where(in_prompt, self.mask_id, v.ids)
        un = self.model(un_ids, key_mask=v.valid, positions=v.positions, out_index=v.out_index)
        return un + (scale.to(logits.dtype)[:, None, None] + 1) * (logits - un)

    # ------------------------------------------------------------------ CUDA graphs

    def _replay(self, mode: str, b: Bucket, geo: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The bucket's forward in this mode, captured once as a CUDA graph (with its cache
        read and store), replayed with fresh geometry copied in place. Its logits are the
        graph's static output: read before the next replay."""
        harmless = torch.zeros_like(geo)
        harmless[IDX], harmless[LENGTH], harmless[GEN_LEN] = self.slots, 1, 1  # the spare row
        if mode not in ("full", "cfg"):
            self._cache_store()  # allocated outside the capture
        return self._graphs.run((mode, b), (geo, scale),
                                lambda g, sc: self._forward(mode, b, self._view(b, g), g, sc),
                                (harmless, torch.zeros_like(scale)))
