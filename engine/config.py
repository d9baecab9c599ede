"""Model and engine configuration.

`ModelConfig` is the one model description the shared model code (engine/models) understands: the
shapes and switches of a mask model, never an architecture's rules. What an architecture's
`config.json` means, and which of these switches it sets, is its card's (engine/families/card.py:
`read_config` finds the card and parses a folder's config through it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from celeris.engine.errors import ModelLoadError


@dataclass(frozen=True)
class ModelConfig:
    # The architecture card's name (engine/families/*/cards.py); its family and rules are looked up
    # by it, never compared to a name. The defaults describe a LLaDA-shaped model (its card's traits).
    arch: str = "llada"
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 4
    n_layers: int = 4
    mlp_hidden_size: int = 768
    vocab_size: int = 2048
    embedding_size: int = 2048  # rows of the embedding table; >= vocab_size (LLaDA pads it)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    mask_token_id: int = 0
    eos_token_id: int = 1
    weight_tying: bool = False
    qkv_bias: bool = False  # Qwen2/Dream carry q/k/v biases, LLaDA's `include_qkv_bias` does too
    input_emb_norm: bool = False  # LLaDA: embeddings scaled by sqrt(d_model)
    scale_logits: bool = False  # LLaDA: logits scaled by 1/sqrt(d_model)
    max_sequence_length: int = 4096
    name: str = "model"
    # Block-diffusion families (SDAR: Qwen3 layout; LLaDA2: MoE).
    explicit_head_dim: int = 0  # config `head_dim` when it is not d_model / n_heads
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    partial_rotary_factor: float = 1.0  # LLaDA2 rotates only the first part of each head
    out_bias: bool = False  # bias on the attention output projection
    logits_fp32: bool = False  # LLaDA2 returns float32 logits
    block_length: int = 0  # the trained block size of a block-diffusion model
    num_experts: int = 0  # MoE layers (0: dense); see engine/models/moe.py
    experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_hidden_size: int = 0
    first_dense_layers: int = 0  # LLaDA2's first_k_dense_replace
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Block-routed gate (LLaDA2.2): each `routing_block` tokens of a row share their top
    # `expert_capacity` experts, then top-k per token within them (0: the grouped gate).
    expert_capacity: int = 0
    routing_block: int = 0
    # Levenshtein edit tokens (LLaDA2.2): ordinary vocabulary ids a step may write to delete a
    # position or split it in two (engine/families/block/levenshtein.py); -1: none.
    delete_token_id: int = -1
    split_token_id: int = -1
    eos_token_ids: tuple[int, ...] = ()  # further stop ids (generation_config.json may list several)
    rope_fp32: bool = True  # rotate q/k in fp32 (LLaDA's `rope_full_precision`), else in the model dtype
    logit_shift: bool = False  # position p is predicted from hidden state p-1 (Dream: AR-initialised)

    def __post_init__(self) -> None:
        if not self.explicit_head_dim and self.d_model % self.n_heads:
            raise ModelLoadError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.embedding_size < self.vocab_size:
            raise ModelLoadError("embedding_size must be >= vocab_size")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_dense_layers


def read_json(folder: str | Path, name: str, required: bool = False) -> dict[str, Any]:
    """A checkpoint folder's JSON file (`config.json`, `generation_config.json`,
    `tokenizer_config.json`, a safetensors index) as an object: {} when it is absent and not
    `required`. Every folder JSON is read here, so each problem has one message."""
    path = Path(folder) / name
    if not path.is_file():
        if required:
            raise ModelLoadError(f"no {name} in model folder {folder}")
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization's methods (--quantization)


# The most prompt tokens a server allows by default, whatever a model's own range
# (engine/llm.py `default_prompt_tokens`): the fixed per-slot buffers (and a block model's KV
# cache) are sized by the limits. A server's --max-prompt-tokens sets any other value.
PROMPT_ROOM_CAP = 4096


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits and runtime choices; everything a scheduler or runner needs to size itself."""

    device: str = "cpu"
    dtype: str = "float32"
    max_batch: int = 16  # requests decoded together in one forward
    max_queue: int = 64  # admitted-but-waiting requests; beyond this, submit() raises Overloaded
    max_prompt_tokens: int = 512
    max_gen_length: int = 512
    # Fine at the short end, where padding would otherwise dominate a step's compute.
    length_buckets: tuple[int, ...] = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    cuda_graphs: bool = True  # only used on CUDA
    # Graphs for forwards of at most this many fresh tokens (batch bucket x window, x E/k for a
    # MoE model, whose graphed step computes every expert); larger ones run eager at their exact
    # shape. LLaDA-8B graphs were slower than eager from batch 8 x 320 tokens on an H200; a first
    # guess until scripts/bench_gpu.py measures the crossover on the device (0: never graph).
    graph_max_tokens: int = 2048
    kv_cache: Literal["none", "prefix", "dual"] = "none"  # full-canvas models; block models keep an exact one
    prefill_chunk: int = 256  # block models: most prompt tokens one request prefills per step
    # Block models: while other rows denoise, a prefill chunk is capped to their tokens of the step
    # (engine/families/block/chunked_prefill.py), so a long prompt does not stall running streams.
    chunked_prefill: bool = True
    # Block models' prefix cache across requests (engine/models/prefix_cache.py), in bytes: None is the
    # default (DEFAULT_PREFIX_CACHE_BYTES on the CPU, where its exactness is tested; off on CUDA), 0 off.
    prefix_cache_bytes: Optional[int] = None
    # What one more forward costs, in tokens of padding: running requests of very different
    # lengths step in separate forwards when that is cheaper (engine/loop/batching.py). None: 256 on
    # CPU, 4096 on CUDA (a GPU forward costs about the same for a few rows as for a full bucket).
    forward_overhead_tokens: Optional[int] = None
    # The most tokens one forward computes (rows x their padded length; vLLM's
    # max_num_batched_tokens): a larger group of running rows steps part of its rows at a time,
    # those that waited longest first, so a short request never waits behind one long forward.
    # None: 2048 on CPU (its forward's time grows with its tokens); no limit on CUDA (a forward
    # of a few rows costs about what a full one does); 0: no limit.
    max_forward_tokens: Optional[int] = None
    # Structured outputs' host work a step (engine/loop/fair_share.py): while several clients run, a
    # step computes at most this many units of constraint masks (a constrained row's step is one unit
    # a round of its masks, `families.selection.constraint_work`), each client at most its share
    # (budget // clients, one row at least); its other rows wait a step, as over the token budget.
    # 0: no limit. One client alone is never limited (nobody waits on its masks).
    constraint_budget: int = 16
    # engine/parallel: ranks the model is split over (1: this process alone), experts whole per
    # rank instead of sliced, and how long a collective may wait before a rank counts as hung.
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    collective_timeout_s: float = 120.0
    # Weights packed to a low-precision format after they load (None: the model dtype): "fp8" is
    # E4M3 with per-channel scales and W8A8 matmuls (engine/models/fp8.py), vLLM's name.
    quantization: Optional[str] = None
    # A request decodes the same tokens alone and in any batch. The CPU's forwards keep that with rows
    # sharing them; on CUDA DiffusionGemma keeps it by running each row's forward alone, and False lets
    # its rows share one forward (faster; cuBLAS then rounds a row by the batch's shapes).
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ModelLoadError(f"quantization {self.quantization!r} is not supported (choices: "
                                 f"{', '.join(QUANTIZATIONS)}; leave it unset for the model dtype)")
        if self.quantization and (self.tensor_parallel_size != 1 or self.expert_parallel):
            raise ModelLoadError(f"quantization {self.quantization!r} runs on one process only, not with tensor or "
                                 "expert parallel (--tensor-parallel-size > 1, --expert-parallel): the workers would "
                                 "load unquantised shards")

    @property
    def forward_token_budget(self) -> Optional[int]:
        if self.max_forward_tokens is not None:
            return self.max_forward_tokens or None  # 0: no limit
        return 2048 if self.device == "cpu" else None

    @property
    def overhead_tokens(self) -> int:
        if self.forward_overhead_tokens is not None:
            return self.forward_overhead_tokens
        return 256 if self.device == "cpu" else 4096

    def bucket_length(self, n: int) -> int:
        for b in self.length_buckets:
            if n <= b:
                return b
        return n

    def bucket_batch(self, n: int) -> int:
        for b in self.batch_buckets:
            if n <= b:
                return b
        return n
