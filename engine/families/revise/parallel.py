"""DiffusionGemma over tensor- and expert-parallel ranks (torch.distributed: gloo on the CPU, NCCL on CUDA).

Megatron's split, as the mask families' (engine/parallel/shard.py), on the revise model's modules:
- attention: query heads split by rank, key/value heads too (a layer with fewer key/value heads than
  ranks: each rank holds the one its queries use, replicated); the output projection row-parallel;
- the dense GLU and the self-conditioning GLU: gate/up column-parallel, down row-parallel;
- the routed experts: under tensor parallelism each expert's hidden size is split (gate/up rows,
  down columns); under expert parallelism (`--expert-parallel`) each rank holds E/N whole experts and
  computes only the (token, slot) pairs routed to them (experts.py);
- every row-parallel output is a partial sum, all-reduced (the modules' `reduce`); the embedding,
  router, norms, scalars and head are replicated, and the head runs on the leader only (selection and
  sampling are the leader's). Each rank reads the folder and keeps its slice: a rank's peak while it
  loads is the whole model (the mask families' sliced reads and vocabulary-parallel embedding are
  not done here).

The leader's `GemmaMirror` is called as a `DiffusionGemma` by the revise runner. Each encoder and
denoiser forward first sends its inputs to the workers (ids, canvases, which caches, and the
self-conditioning input as each row's (L, D) expected embedding, never its (L, V) probabilities);
`follow` runs the same forward on the worker's slice, meeting the leader's all-reduces. Each rank
keeps its own heads' KV cache per request, under a number the leader gives it; a cache the leader
drops is dropped on the workers with the next call.

Exactness: an all-reduce adds the ranks' partial sums, which one process adds in another order, so
logits differ from one process's in their last bits; the tokens are the same (TP2 and TP2 with
expert parallelism against one process on gloo, sampled: tests/unit/families/test_revise_parallel.py).
"""

from __future__ import annotations

import itertools
import pickle
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from celeris.engine.config import EngineConfig, read_json
from celeris.engine.errors import ModelLoadError
from celeris.engine.families.revise.config import GemmaConfig, gemma_config
from celeris.engine.families.revise.model import GLU, DiffusionGemma, KVCache
from celeris.engine.families.revise.weights import load_gemma
from celeris.engine.parallel.group import Group, Plan
from celeris.engine.parallel.launch import Ranks, start
from celeris.engine.parallel.mirror import Channel, to_device


def check_gemma_sizes(folder: Path, plan: Plan) -> None:
    """Refuse a size that does not divide what it must split, naming the quantity (before any rank starts)."""
    cfg = gemma_config(read_json(folder, "config.json", required=True))
    n = plan.size
    if plan.expert_parallel and n == 1:
        raise ModelLoadError("--expert-parallel splits experts over the tensor-parallel ranks: set "
                             "--tensor-parallel-size to 2 or more")
    checks = [("attention heads", cfg.n_heads), ("MLP hidden size", cfg.mlp_hidden_size),
              ("experts", cfg.num_experts) if plan.expert_parallel else ("expert hidden size", cfg.moe_hidden_size)]
    for what, value in checks:
        if n < 1 or value % n:
            raise ModelLoadError(f"tensor parallel size {n} does not divide the {what} ({value})")
    for i, layer in enumerate(cfg.layers):
        if layer.n_kv_heads % n and n % layer.n_kv_heads:
            raise ModelLoadError(f"tensor parallel size {n} neither divides nor is a multiple of layer {i}'s "
                                 f"key/value heads ({layer.n_kv_heads})")


def _keep(module: nn.Module, name: str, part: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(part.contiguous().clone(), requires_grad=False))


def _split_glu(glu: GLU, group: Group) -> None:
    n, r = group.size, group.rank
    h = glu.gate_proj.weight.shape[0] // n
    _keep(glu.gate_proj, "weight", glu.gate_proj.weight[r * h:(r + 1) * h])
    _keep(glu.up_proj, "weight", glu.up_proj.weight[r * h:(r + 1) * h])
    _keep(glu.down_proj, "weight", glu.down_proj.weight[:, r * h:(r + 1) * h])
    glu.reduce = group.all_reduce


def _split_attention(attn: nn.Module, cfg: GemmaConfig, group: Group) -> None:
    n, r = group.size, group.rank
    hd, kvh = attn.shape.head_dim, attn.shape.n_kv_heads
    q = cfg.n_heads // n * hd  # this rank's query heads, whole
    _keep(attn.q_proj, "weight", attn.q_proj.weight[r * q:(r + 1) * q])
    _keep(attn.o_proj, "weight", attn.o_proj.weight[:, r * q:(r + 1) * q])
    first, count = (r * kvh // n, kvh // n) if kvh % n == 0 else (r // (n // kvh), 1)  # else: replicated
    for proj in (attn.k_proj, attn.v_proj):
        if proj is not None:  # a global layer's values are its keys
            _keep(proj, "weight", proj.weight[first * hd:(first + count) * hd])
    attn.reduce = group.all_reduce


def _split_experts(experts: nn.Module, plan: Plan, group: Group) -> None:
    n, r = group.size, group.rank
    if plan.expert_parallel:  # E/N whole experts
        e = experts.n_experts // n
        experts.first = r * e
        _keep(experts, "gate_up_proj", experts.gate_up_proj[r * e:(r + 1) * e])
        _keep(experts, "down_proj", experts.down_proj[r * e:(r + 1) * e])
    else:  # each expert's hidden size: gate rows and up rows (fused as [gate; up]), down columns
        hidden = experts.down_proj.shape[2]
        h = hidden // n
        gate, up = experts.gate_up_proj[:, r * h:(r + 1) * h], experts.gate_up_proj[:, hidden + r * h:hidden + (r + 1) * h]
        _keep(experts, "gate_up_proj", torch.cat([gate, up], dim=1))
        _keep(experts, "down_proj", experts.down_proj[:, :, r * h:(r + 1) * h])
    experts.reduce = group.all_reduce


def split(model: DiffusionGemma, plan: Plan, group: Group) -> DiffusionGemma:
    """This rank's slice of a whole model, in place."""
    for layer in model.layers:
        _split_attention(layer.self_attn, model.cfg, group)
        _split_glu(layer.mlp, group)
        _split_experts(layer.experts, plan, group)
    _split_glu(model.self_conditioning, group)
    return model


def load_rank(folder: Path, plan: Plan, group: Group, dtype: str, device: str) -> DiffusionGemma:
    """One rank's model: the folder read whole, then cut to this rank's slice."""
    return split(load_gemma(folder, dtype=dtype, device=device), plan, group)


class GemmaMirror:
    """Rank 0's slice, called as a `DiffusionGemma`; every forward runs on all ranks."""

    def __init__(self, shard: DiffusionGemma, channel: Channel, close):
        self.shard, self.channel, self._close = shard, channel, close
        self.cfg = shard.cfg
        self._numbers = itertools.count()
        # Caches the leader let go since the last call: appended by the garbage collector from any
        # thread, so a deque (its append and popleft are atomic), never swapped for another.
        self._dropped: deque[int] = deque()

    def __getattr__(self, name: str) -> Any:  # embed, device, calls, head, ...: the leader's own
        return getattr(self.shard, name)

    @property
    def shared_forward(self) -> Optional[bool]:
        return self.shard.shared_forward

    @shared_forward.setter
    def shared_forward(self, value: Optional[bool]) -> None:
        self.shard.shared_forward = value

    def _number(self, cache: KVCache) -> int:
        number = getattr(cache, "rank_number", None)
        if number is None:
            number = cache.rank_number = next(self._numbers)
            weakref.finalize(cache, self._dropped.append, number)
        return number

    def _send(self, op: str, args: tuple) -> None:
        dropped = []
        while self._dropped:
            dropped.append(self._dropped.popleft())
        self.channel.send(op, (dropped, self.shard.shares_forwards, args))

    def _run(self, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as e:  # a collective failed: a peer died, or timed out
            raise self.channel.diagnose(e) from e

    @torch.no_grad()
    def encode_rows(self, ids: list[torch.Tensor], caches: list[KVCache]) -> None:
        self._send("encode", (ids, [self._number(c) for c in caches]))
        self._run(self.shard.encode_rows, ids, caches)

    def encode(self, ids: torch.Tensor, cache: KVCache) -> None:
        self.encode_rows([ids[0]], [cache])

    @torch.no_grad()
    def denoise_hidden(self, canvas: torch.Tensor, caches: list[KVCache],
                       sc_probs: list[Optional[torch.Tensor]]) -> torch.Tensor:
        soft = self.shard.soft_inputs(sc_probs)  # (L, D) each: what travels instead of (L, V)
        self._send("denoise", (canvas, [self._number(c) for c in caches], soft))
        return self._run(self.shard.denoise_hidden, canvas, caches, sc_probs, soft)

    def denoise(self, canvas: torch.Tensor, cache: KVCache, sc_probs: Optional[torch.Tensor]) -> torch.Tensor:
        """The reference loop's call (slots.generate).  canvas (1, L) -> logits (1, L, V)"""
        return self.shard.head(self.denoise_hidden(canvas, [cache], [None if sc_probs is None else sc_probs[0]]))

    def close(self) -> None:
        self._close()


def follow(conn, model: DiffusionGemma, device: str) -> None:
    """A worker's loop: repeat the leader's forwards on this rank's slice until 'stop' or the pipe closes."""
    caches: dict[int, KVCache] = {}
    while True:
        try:
            op, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the leader is gone
        if op == "stop":
            return
        if op == "ping":
            conn.send_bytes(pickle.dumps("pong"))
            continue
        dropped, shared, args = payload
        for number in dropped:
            caches.pop(number, None)
        model.shared_forward = shared  # the leader's packing: the same forwards, the same collectives
        args = to_device(args, device)
        if op == "encode":
            ids, numbers = args
            model.encode_rows(ids, [caches.setdefault(k, KVCache(model.cfg)) for k in numbers])
        elif op == "denoise":
            canvas, numbers, soft = args
            model.denoise_hidden(canvas, [caches[k] for k in numbers], [None] * len(numbers), soft)


def _parameters(folder: Path) -> int:
    from celeris.engine.parallel.shard import checkpoint_parameters

    return checkpoint_parameters(folder)


GEMMA_RANKS = Ranks(check_gemma_sizes, load_rank, follow, GemmaMirror, _parameters)


def start_gemma(folder: Path, config: EngineConfig) -> GemmaMirror:
    """A DiffusionGemma folder over `config.tensor_parallel_size` ranks (workers spawned here)."""
    return start(Path(folder), config, GEMMA_RANKS)
