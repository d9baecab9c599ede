"""Train celeris-tiny (full-canvas, LLaDA format) or celeris-tiny-block (SDAR format) from scratch
on 2 CPU cores.

    celeris train --out engine/training/celeris-tiny                       # = python -m celeris.engine.training.train
    celeris train --arch sdar --out engine/training/celeris-tiny-block

Every third step is a pretraining step (random windows of the novels, every token maskable);
the others are supervised steps (`tasks.TaskMaker`: continuations, additions and chat turns,
responses EOS-padded to a drawn canvas length, only the response maskable). The losses are
LLaDA's (full canvas) and SDAR's block-diffusion loss (`objective.py`).

celeris-tiny then runs a long-canvas phase (`LONG_STEPS`): the same mix, from a fresh optimizer
and a short learning-rate schedule of its own, but its addition batches are drawn mostly at
canvases 128 and 256 (`tasks.LONG_CANVAS_WEIGHTS`). A full-canvas model decodes a short answer
beside every still-masked position of the canvas; the main phase sees too few 256-position
addition canvases (seven fit a 2,048-token batch) for the answer to survive 250 masks beside it.
The phase is seeded on its own (`seed + 7`), so it is a function of the main phase's weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

import torch

from celeris.engine.config import ModelConfig
from celeris.engine.families import registry
from celeris.engine.models.transformer import MaskPredictor, count_parameters
from celeris.engine.training import data, skill, tasks
from celeris.engine.training.corpus import corpus_source, load_austen, total_chars
from celeris.engine.training.steps import _save, run_steps

# (d_model, heads, layers, mlp) of the sizes tried; "base" is what ships (see the model card).
SIZES = {"small": (64, 2, 2, 128), "base": (128, 4, 4, 384), "wide": (192, 6, 4, 512), "deep": (128, 4, 8, 384)}
BLOCK = 4  # celeris-tiny-block's trained block size (SDAR's published models use 4)
NAMES = {"llada": "celeris-tiny", "sdar": "celeris-tiny-block"}
# Config fields each trained architecture sets beyond its card's traits (SDAR's are the Qwen3
# layout's q/k norms): celeris-tiny-block is trained and served in blocks of BLOCK.
RECIPES: dict[str, dict] = {"llada": {}, "sdar": {"rms_norm_eps": 1e-6, "block_length": BLOCK}}
# Default step counts: the shipped runs (2 threads: celeris-tiny 45.9 + 8.0 min, celeris-tiny-block
# 47.3 min). A block model reads every token twice (noisy and clean), so it gets half the steps.
STEPS = {"llada": 15000, "sdar": 7500}
# The long-canvas phase after the main one (see the docstring): steps, peak learning rate.
# celeris-tiny-block decodes in blocks of 4 whatever the canvas and needs none (95% at 256).
LONG_STEPS = {"llada": 3000, "sdar": 0}
LONG_LR = 5e-4


def model_config(vocab_size: int, size: str = "base", arch: str = "llada") -> ModelConfig:
    d, heads, layers, mlp = SIZES[size]
    common = dict(d_model=d, n_heads=heads, n_kv_heads=heads, n_layers=layers, mlp_hidden_size=mlp,
                  vocab_size=vocab_size, embedding_size=vocab_size, mask_token_id=data.MASK_ID,
                  eos_token_id=data.EOS_ID, rope_theta=10000.0, max_sequence_length=1024, name=NAMES[arch])
    return registry.card_named(arch).config(**common, **RECIPES[arch])


def train(out: Path, steps: int = STEPS["llada"], seed: int = 0, vocab_size: int = 2048, seq_len: int = 128,
          tokens: int = 2048, text_every: int = 3, lr: float = 2e-3, size: str = "base", arch: str = "llada",
          cache_dir: Path = Path.home() / ".cache" / "celeris", threads: int = 2,
          checkpoint_every: int = 2000, long_steps: Optional[int] = None) -> dict:
    """Defined by the seed and step counts (the wall clock never decides anything): every batch
    and mask is drawn from seeded generators. Not bit-exact across reruns on several threads
    (two runs of the same 120 steps ended with different weight bytes: parallel float
    accumulation), so a rerun reproduces the measured figures, not the file.
    Each step trains on about `tokens` tokens (a block model reads each twice: noisy and clean).
    `long_steps` (default `LONG_STEPS[arch]`) of the long-canvas phase follow the main `steps`."""
    long_steps = LONG_STEPS[arch] if long_steps is None else long_steps
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    novels = load_austen(cache_dir)
    train_pars, held_pars = data.split_paragraphs(novels)
    tok = data.train_tokenizer(train_pars + [p + a for p, a in skill.train_pairs(2000)], vocab_size)
    batches = data.make_batches(tok, novels, seed)
    cfg = model_config(tok.get_vocab_size(), size, arch)
    model = MaskPredictor(cfg)
    _init(model)
    print(f"{cfg.name} ({arch}, {size}): {count_parameters(model) / 1e6:.2f}M params, vocab {cfg.vocab_size}, "
          f"{len(batches.stream):,} text tokens, {steps} + {long_steps} steps ({threads} threads)", flush=True)
    phase = dict(model=model, tokens=tokens, seq_len=seq_len, text_every=text_every,
                 save=lambda: _save(model, tok, out), checkpoint_every=checkpoint_every)
    minutes = _phase("main", batches, torch.Generator().manual_seed(seed), steps, lr, warmup=200, **phase)
    long_minutes = 0.0
    if long_steps:
        long_minutes = _phase("long-canvas", data.make_batches(tok, novels, seed + 7), torch.Generator().manual_seed(seed + 7),
               long_steps, LONG_LR, warmup=50, canvas_weights=tasks.LONG_CANVAS_WEIGHTS, **phase)

    _save(model, tok, out)
    info = {"arch": arch, "size": size, "steps": steps, "long_steps": long_steps, "minutes": minutes,
            "long_minutes": long_minutes, "seed": seed,
            "threads": threads, "tokens_per_step": tokens, "parameters": count_parameters(model),
            "vocab_size": cfg.vocab_size, "text_tokens": len(batches.stream), "corpus": corpus_source(cache_dir),
            "corpus_chars": total_chars(novels), "heldout_paragraphs": len(held_pars)}
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved {out} after {steps} + {long_steps} steps", flush=True)
    return info


def _phase(name: str, batches: data.Batches, gen: torch.Generator, steps: int, lr: float, warmup: int,
           model: MaskPredictor, tokens: int, seq_len: int, text_every: int, save, checkpoint_every: int,
           canvas_weights: Optional[tuple[int, ...]] = None) -> float:
    """`steps` optimizer steps from a fresh AdamW, warmup then cosine to `lr`/10: every
    `text_every`-th step pretraining text, the one after it an addition batch (its canvas drawn
    by `canvas_weights`, default the supervised mix's), the others supervised examples.
    Returns the phase's wall minutes."""
    def draw(step: int) -> tuple[str, tuple]:
        if step % text_every == 0:
            return "text", batches.text(max(1, tokens // seq_len), seq_len)
        if step % text_every == 1:
            return "sft", batches.additions(tokens, canvas_weights=canvas_weights)
        return "sft", batches.supervised(tokens)

    return run_steps(name, draw, gen, steps, lr, warmup, model, save, checkpoint_every)


def _init(model: MaskPredictor) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        if name.endswith("attn_out.weight") or name.endswith("ff_out.weight") and "blocks" in name:
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * model.cfg.n_layers))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(ap)
    run(ap.parse_args(argv))
    return 0


def run(a: argparse.Namespace) -> dict:
    if a.phase == "tools":
        from celeris.engine.training.tools_phase import TOOLS_STEPS, tools_phase

        if a.init is None:
            raise SystemExit("--phase tools needs --init, the trained model folder it starts from")
        return tools_phase(a.init, a.out, a.steps or TOOLS_STEPS, seed=a.seed, threads=a.threads,
                           tokens=a.tokens_per_step, cache_dir=a.cache_dir, log=a.log)
    return train(a.out, a.steps or STEPS[a.arch], seed=a.seed, vocab_size=a.vocab_size, size=a.size, arch=a.arch,
                 tokens=a.tokens_per_step, cache_dir=a.cache_dir, threads=a.threads, long_steps=a.long_steps)


def add_train_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, required=True, help="output model folder")
    ap.add_argument("--arch", choices=sorted(NAMES), default="llada",
                    help="llada: celeris-tiny (full canvas); sdar: celeris-tiny-block (block diffusion)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"optimizer steps (default: {STEPS['llada']} for llada, {STEPS['sdar']} for sdar)")
    ap.add_argument("--long-steps", type=int, default=None,
                    help=f"steps of the long-canvas phase after the main one (default: {LONG_STEPS['llada']} for "
                         f"llada, {LONG_STEPS['sdar']} for sdar; 0: none)")
    ap.add_argument("--phase", choices=("all", "tools"), default="all",
                    help="all: the whole recipe from scratch; tools: only the tool-use phase, from --init's weights "
                         "(engine/training/tools_phase.py)")
    ap.add_argument("--init", type=Path, default=None, help="--phase tools: the trained model folder to start from")
    ap.add_argument("--log", type=Path, default=None, help="--phase tools: also append progress lines to this file")
    ap.add_argument("--size", choices=sorted(SIZES), default="base", help="model size (small: smoke tests)")
    ap.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size (default %(default)s)")
    ap.add_argument("--tokens-per-step", type=int, default=2048, help="training tokens per step (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "celeris",
                    help="where the corpus package is downloaded and unpacked")


if __name__ == "__main__":
    sys.exit(main())
