"""Model and engine configuration.

`ModelConfig` is the one architecture description the engine understands. It is read from a
Hugging Face style `config.json` in either LLaDA's own naming (`d_model`, `n_heads`, ...) or
Qwen2/Dream naming (`hidden_size`, `num_attention_heads`, ...), so both checkpoint families
load through the same model code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Optional

from celeris.engine.errors import ModelLoadError

Arch = Literal["llada", "dream", "sdar", "llada2"]
BLOCK_ARCHS = ("sdar", "llada2")  # block diffusion: causal across blocks, exact KV cache


@dataclass(frozen=True)
class ModelConfig:
    arch: Arch = "llada"
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
    token_editing: bool = False  # LLaDA2.1: its generate() may replace tokens already written (see from_dir)

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

    @property
    def family(self) -> str:
        """`block` (grows block by block over an exact cache) or `full` (denoises a whole canvas)."""
        return "block" if self.arch in BLOCK_ARCHS else "full"

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_dense_layers

    @property
    def rope_fp32(self) -> bool:
        """LLaDA rotates q/k in fp32 (`rope_full_precision`); Qwen2/Dream in the model dtype."""
        return self.arch == "llada"

    @property
    def logit_shift(self) -> bool:
        """Dream predicts token i from position i-1 (AR-initialised), so its logits shift right."""
        return self.arch == "dream"

    def to_json(self) -> dict[str, Any]:
        """LLaDA-style keys for full-canvas models, SDAR's published keys for SDAR models: the
        formats celeris writes (celeris-tiny and celeris-tiny-block)."""
        if self.arch == "sdar":
            return self._sdar_json()
        if self.family == "block":
            raise ModelLoadError("celeris writes block-diffusion models in SDAR's format only")
        d = {k: v for k, v in asdict(self).items() if k in _LLADA_KEYS}
        d["architectures"] = ["LLaDAModelLM"] if self.arch == "llada" else ["DreamModel"]
        return d

    def _sdar_json(self) -> dict[str, Any]:
        return {
            "architectures": ["SDARForCausalLM"], "model_type": "sdar", "name": self.name,
            "hidden_size": self.d_model, "num_attention_heads": self.n_heads, "num_key_value_heads": self.n_kv_heads,
            "num_hidden_layers": self.n_layers, "intermediate_size": self.mlp_hidden_size, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rope_theta": self.rope_theta, "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps, "mask_token_id": self.mask_token_id, "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": self.weight_tying, "attention_bias": self.qkv_bias, "hidden_act": "silu",
            "max_position_embeddings": self.max_sequence_length, "block_size": self.block_length,
            "use_sliding_window": False, "torch_dtype": "float32",
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], name: str = "model") -> ModelConfig:
        _refuse_unknown_architectures(raw)
        archs = [a.lower() for a in raw.get("architectures", [])]
        is_dream = raw.get("model_type") == "Dream" or any("dream" in a for a in archs)
        if raw.get("model_type") == "sdar" or "sdarforcausallm" in archs:
            return _sdar_config(raw, name)
        if raw.get("model_type") == "llada2_moe" or "llada2moemodellm" in archs:
            return _llada2_config(raw, name)
        if "d_model" in raw:  # LLaDA naming
            _refuse_unsupported(raw, _LLADA_SUPPORTED)
            vocab = int(raw["vocab_size"])
            return cls(
                arch="dream" if is_dream else "llada",
                d_model=int(raw["d_model"]),
                n_heads=int(raw["n_heads"]),
                n_kv_heads=int(raw.get("n_kv_heads") or raw["n_heads"]),
                n_layers=int(raw["n_layers"]),
                mlp_hidden_size=int(raw["mlp_hidden_size"]),
                vocab_size=vocab,
                embedding_size=int(raw.get("embedding_size") or vocab),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                mask_token_id=int(raw.get("mask_token_id", 126336)),
                eos_token_id=int(raw.get("eos_token_id", 126081)),
                weight_tying=bool(raw.get("weight_tying", False)),
                qkv_bias=bool(raw.get("qkv_bias", raw.get("include_qkv_bias", False))),
                input_emb_norm=bool(raw.get("input_emb_norm", False)),
                scale_logits=bool(raw.get("scale_logits", False)),
                max_sequence_length=int(raw.get("max_sequence_length", 4096)),
                name=str(raw.get("name", name)),
            )
        if "hidden_size" in raw:  # Qwen2 / Dream naming
            _refuse_unsupported(raw, _QWEN2_SUPPORTED)
            vocab = int(raw["vocab_size"])
            return cls(
                arch="dream",
                d_model=int(raw["hidden_size"]),
                n_heads=int(raw["num_attention_heads"]),
                n_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
                n_layers=int(raw["num_hidden_layers"]),
                mlp_hidden_size=int(raw["intermediate_size"]),
                vocab_size=vocab,
                embedding_size=vocab,
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                mask_token_id=int(raw.get("mask_token_id", 151666)),
                eos_token_id=int(raw.get("eos_token_id", 151643)),
                weight_tying=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=True,
                max_sequence_length=int(raw.get("max_position_embeddings", 32768)),
                name=str(raw.get("name", name)),
            )
        raise ModelLoadError("config.json has neither LLaDA ('d_model') nor Qwen2/Dream ('hidden_size') keys")

    @classmethod
    def from_dir(cls, folder: Path) -> ModelConfig:
        raw = read_json(folder, "config.json", required=True)
        cfg = cls.from_json(raw, name=Path(folder).resolve().name)
        return replace(cfg, token_editing=True) if cfg.arch == "llada2" and edits_tokens(folder) else cfg


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


def edits_tokens(folder: Path) -> bool:
    """Whether a LLaDA2.x folder is LLaDA2.1 (token editing). Its config.json is LLaDA2.0's
    (same architecture and keys); what differs is the `generate()` its remote-code modeling file
    ships, whose signature takes `editing_threshold`, and the editing knobs a generation_config.json
    may recommend. Either marks the folder; neither keeps LLaDA2.0's loop."""
    folder = Path(folder)
    try:
        if {"editing_threshold", "max_post_steps"} & set(read_json(folder, "generation_config.json")):
            return True
    except ModelLoadError:
        pass  # model_defaults reports a broken generation_config.json
    return any("editing_threshold" in f.read_text(errors="replace") for f in folder.glob("modeling_*.py"))


# Config keys that change the forward, with the values this model computes correctly. A
# checkpoint that sets one to anything else is refused rather than served wrongly; keys that
# only matter for training (dropout, init) or that the model implements are not listed.
_LLADA_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "activation_type": ("silu", "swiglu"),
    "block_type": ("llama",),
    "layer_norm_type": ("rms",),
    "layer_norm_with_affine": (True,),
    "bias_for_layer_norm": (False, None),
    "attention_layer_norm": (False, None),
    "include_bias": (False,),
    "alibi": (False,),
    "rope": (True,),
    "rope_full_precision": (True,),
    "clip_qkv": (None,),
    "multi_query_attention": (False, None),
    "block_group_size": (1,),
}
_QWEN2_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "use_sliding_window": (False,),
}


_LLADA_KEYS = ("arch", "d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size",
               "embedding_size", "rope_theta", "rms_norm_eps", "mask_token_id", "eos_token_id", "weight_tying",
               "qkv_bias", "input_emb_norm", "scale_logits", "max_sequence_length", "name")
_BLOCK_SUPPORTED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "use_sliding_window": (False, None),
}


def _ids(raw: dict[str, Any], key: str, default: int) -> int:
    v = raw.get(key, default)
    return int(v[0] if isinstance(v, list) else v)


def _sdar_config(raw: dict[str, Any], name: str) -> ModelConfig:
    """SDAR (JetAstra): the Qwen3 layout — q/k norms, GQA, explicit head_dim — trained in blocks."""
    _refuse_unsupported(raw, _BLOCK_SUPPORTED)
    heads = int(raw["num_attention_heads"])
    return ModelConfig(
        arch="sdar", d_model=int(raw["hidden_size"]), n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads), n_layers=int(raw["num_hidden_layers"]),
        mlp_hidden_size=int(raw["intermediate_size"]), vocab_size=int(raw["vocab_size"]),
        embedding_size=int(raw["vocab_size"]), rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), mask_token_id=_ids(raw, "mask_token_id", 151669),
        eos_token_id=_ids(raw, "eos_token_id", 151643), weight_tying=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", False)), out_bias=bool(raw.get("attention_bias", False)),
        explicit_head_dim=int(raw.get("head_dim") or 0), qk_norm=True,
        max_sequence_length=int(raw.get("max_position_embeddings", 32768)),
        block_length=int(raw.get("block_size", 4)), name=str(raw.get("name", name)))


def _llada2_config(raw: dict[str, Any], name: str) -> ModelConfig:
    """LLaDA2.x (inclusionAI): MoE with shared experts and a grouped sigmoid router, block 32.

    Its published generate() takes mask and EOS ids as arguments (156895, 156892); a config that
    records `mask_token_id` / `eos_token_id` overrides them.
    """
    _refuse_unsupported(raw, _BLOCK_SUPPORTED)
    heads = int(raw["num_attention_heads"])
    return ModelConfig(
        arch="llada2", d_model=int(raw["hidden_size"]), n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads), n_layers=int(raw["num_hidden_layers"]),
        mlp_hidden_size=int(raw.get("intermediate_size") or 0), vocab_size=int(raw["vocab_size"]),
        embedding_size=int(raw["vocab_size"]), rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)), mask_token_id=_ids(raw, "mask_token_id", 156895),
        eos_token_id=_ids(raw, "eos_token_id", 156892), weight_tying=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("use_qkv_bias", False)), out_bias=bool(raw.get("use_bias", True)),
        explicit_head_dim=int(raw.get("head_dim") or 0), qk_norm=bool(raw.get("use_qk_norm", True)),
        partial_rotary_factor=float(raw.get("partial_rotary_factor", 0.5)), logits_fp32=True,
        max_sequence_length=int(raw.get("max_position_embeddings", 16384)), block_length=32,
        num_experts=int(raw.get("num_experts") or 0), experts_per_token=int(raw.get("num_experts_per_tok", 2)),
        num_shared_experts=int(raw.get("num_shared_experts") or 0),
        moe_hidden_size=int(raw.get("moe_intermediate_size") or 0),
        first_dense_layers=int(raw.get("first_k_dense_replace", 0)), n_group=int(raw.get("n_group", 8)),
        topk_group=int(raw.get("topk_group", 4)), routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        name=str(raw.get("name", name)))


# The `architectures` names this engine serves. A config naming anything else is refused at load
# rather than guessed from its keys (a relabelled Qwen2-style config used to be served as Dream).
KNOWN_ARCHITECTURES = ("LLaDAModelLM", "DreamModel", "SDARForCausalLM", "LLaDA2MoeModelLM")


def _refuse_unknown_architectures(raw: dict[str, Any]) -> None:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelLoadError(f"config.json: 'architectures' must be a list, got {archs!r}")
    unknown = [a for a in archs if a not in KNOWN_ARCHITECTURES]
    if unknown:
        raise ModelLoadError(
            f"config.json names architecture {', '.join(map(repr, unknown))}, which celeris does not serve "
            f"(supported: {', '.join(KNOWN_ARCHITECTURES)})")


def _refuse_unsupported(raw: dict[str, Any], supported: dict[str, tuple[Any, ...]]) -> None:
    bad = [f"{k}={raw[k]!r} (supported: {', '.join(map(repr, ok))})"
           for k, ok in supported.items() if k in raw and raw[k] not in ok]
    if bad:
        raise ModelLoadError("config.json sets options this model does not implement: " + "; ".join(bad))


QUANTIZATIONS = ("fp8",)  # EngineConfig.quantization's methods (--quantization)


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
