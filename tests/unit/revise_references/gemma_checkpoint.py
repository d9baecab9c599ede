"""Tiny random DiffusionGemma folders written by transformers' own classes (save_pretrained), and its
generate() run on them: the reference celeris is compared against (issue #30)."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            sliding_window=6, layer_types=["sliding_attention", "full_attention", "full_attention"],
            num_experts=4, top_k_experts=2, moe_intermediate_size=16, max_position_embeddings=256,
            pad_token_id=0, eos_token_id=1, bos_token_id=2)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4)


def write_checkpoint(folder: Path, canvas_length: int = 8, seed: int = 0, embed_gain: float = 1.0,
                     sc_gain: float = 1.0, **text) -> Path:
    """`embed_gain` scales the (tied) embeddings: a sharper model, confident enough for the
    stable-and-confident rule to stop canvases early. `sc_gain` scales the self-conditioning GLU's
    projections: each step's logits then weigh heavily on the next, so a rounding difference in one
    step grows into different tokens (what batch-invariance tests want)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    cfg = DiffusionGemmaConfig(text_config={**TEXT, **text}, vision_config={"model_type": "gemma4_vision", **VISION},
                               canvas_length=canvas_length)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():  # random norms and scalars, so no weight sits at its identity value
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "scale")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            if name.endswith("embed_tokens.weight"):
                p.mul_(embed_gain)
            if "self_conditioning" in name and name.endswith("proj.weight"):
                p.mul_(sc_gain)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    model.save_pretrained(folder)
    return folder


def reference_model(folder: Path):
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(folder, attn_implementation="eager").eval()
    # from_pretrained leaves the weights in the safetensors mmap, at whatever byte offset the file
    # puts them; the CPU matmul kernels (MKL) round differently on operands that are not 64-byte
    # aligned, so the same reference would give other bits from another file layout. Fresh copies
    # are aligned, as celeris' own loaded weights are.
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def reference_generate(model, prompt: list[int], seed: int, max_new_tokens: int, **gen) -> list[int]:
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, **gen)
    return out.sequences[0, len(prompt):].tolist()


def write_tokenizer(folder: Path, vocab_size: int = 96) -> Path:
    """A word-level tokenizer for the tiny checkpoint's ids (pad 0, eos 1, bos 2): transformers'
    save_pretrained writes none, and serving needs one to decode."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(4, vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "add_bos_token": True}))
    return folder


def write_bpe_checkpoint(folder: Path, canvas_length: int = 16, seed: int = 1) -> Path:
    """A tiny checkpoint with celeris-tiny's byte-level BPE tokenizer (2,048 ids; pad 0, bos 1,
    eos 2), for what needs real text: JSON punctuation for structured outputs."""
    import json
    import shutil

    from celeris.engine.llm import EMBEDDED_MODELS

    write_checkpoint(folder, canvas_length=canvas_length, seed=seed, vocab_size=2048, pad_token_id=0,
                     eos_token_id=2, bos_token_id=1)
    tiny = EMBEDDED_MODELS["celeris-tiny"]
    shutil.copy(tiny / "tokenizer.json", folder)
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    config.pop("mask_token")  # DiffusionGemma's mask is past the vocabulary
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
