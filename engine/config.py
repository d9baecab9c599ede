"""Model and engine configuration.

`ModelConfig` is the one architecture description the engine understands. It is read from a
Hugging Face style `config.json` in either LLaDA's own naming (`d_model`, `n_heads`, ...) or
Qwen2/Dream naming (`hidden_size`, `num_attention_heads`, ...), so both checkpoint families
load through the same model code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from engine.errors import ModelLoadError

Arch = Literal["llada", "dream"]


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

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ModelLoadError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.embedding_size < self.vocab_size:
            raise ModelLoadError("embedding_size must be >= vocab_size")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rope_fp32(self) -> bool:
        """LLaDA rotates q/k in fp32 (`rope_full_precision`); Qwen2/Dream in the model dtype."""
        return self.arch == "llada"

    @property
    def logit_shift(self) -> bool:
        """Dream predicts token i from position i-1 (AR-initialised), so its logits shift right."""
        return self.arch == "dream"

    def to_json(self) -> dict[str, Any]:
        """LLaDA-style keys, which is the format celeris writes."""
        d = asdict(self)
        d["architectures"] = ["LLaDAModelLM"] if self.arch == "llada" else ["DreamModel"]
        return d

    @classmethod
    def from_json(cls, raw: dict[str, Any], name: str = "model") -> ModelConfig:
        archs = [a.lower() for a in raw.get("architectures", [])]
        is_dream = raw.get("model_type") == "Dream" or any("dream" in a for a in archs)
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
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in model folder {folder}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
        return cls.from_json(raw, name=Path(folder).resolve().name)


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


def _refuse_unsupported(raw: dict[str, Any], supported: dict[str, tuple[Any, ...]]) -> None:
    bad = [f"{k}={raw[k]!r} (supported: {', '.join(map(repr, ok))})"
           for k, ok in supported.items() if k in raw and raw[k] not in ok]
    if bad:
        raise ModelLoadError("config.json sets options this model does not implement: " + "; ".join(bad))


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
    kv_cache: Literal["none", "prefix", "dual"] = "none"
    extra: dict[str, Any] = field(default_factory=dict)

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
