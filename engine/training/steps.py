"""The optimizer loop and the folder writer every training phase shares (`celeris train`'s main and
long-canvas phases, engine/training/train.py; the tool-use phase, engine/training/tools_phase.py)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

import torch

from celeris.engine.families import registry
from celeris.engine.families.checkpoint import save_model
from celeris.engine.models.transformer import MaskPredictor
from celeris.engine.training import data
from celeris.engine.training.objective import model_loss

# The shipped models' default frequency penalty: at 0.1 greedy prose has 88-93% distinct word
# 4-grams, at 0.2 95-97% (without: 62-68%), additions unchanged; see the model cards.
FREQUENCY_PENALTY = 0.2


def lr_at(step: int, total: int, peak: float, warmup: int = 200) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def run_steps(name: str, draw: Callable[[int], tuple[str, tuple]], gen: torch.Generator, steps: int, lr: float,
              warmup: int, model: MaskPredictor, save, checkpoint_every: int, log: Optional[TextIO] = None,
              log_every: int = 100) -> float:
    """`steps` AdamW steps on the batches `draw(step)` gives ((kind, (ids, real, maskable))), the
    learning rate warmed up then cosine to `lr`/10; saved every `checkpoint_every` steps; a
    line every `log_every` steps (mean loss per kind, tokens/s, ETA) on stdout and `log`.
    Returns the phase's wall minutes."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    family = registry.family_of(model.cfg)
    t0 = time.time()
    losses: dict[str, list[float]] = {}
    seen = 0
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, steps, lr, warmup)
        kind, (x, real, maskable) = draw(step)
        loss = model_loss(model, family, x, real, maskable, data.MASK_ID, gen)
        losses.setdefault(kind, []).append(loss.item())
        seen += int(real.sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % checkpoint_every == 0 and step < steps:  # something to evaluate while training goes on
            save()
        if step % log_every == 0 or step == steps:
            spent = time.time() - t0
            rate = step / spent
            parts = " ".join(f"{k} loss {_mean(v):.3f}" for k, v in sorted(losses.items()))
            line = (f"{name} step {step}/{steps} ({100 * step / steps:.0f}%) {parts} lr {opt.param_groups[0]['lr']:.2e} "
                    f"{rate:.2f} step/s {seen / spent:,.0f} tokens/s ETA {(steps - step) / rate / 60:.1f} min")
            print(line, flush=True)
            if log is not None:
                log.write(line + "\n")
                log.flush()
            losses = {}
    return round((time.time() - t0) / 60, 1)


def _save(model: MaskPredictor, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    data.save_tokenizer(tok, out)
    # Serving defaults: max_tokens 64, one token per step, in blocks (semi-autoregressive), so a
    # short answer is decided in the first block whatever the canvas length; a small frequency
    # penalty, without which greedy prose of a model this size loops (measured in the model card).
    block = registry.family_of(model.cfg).block_length or 8  # a canvas model's: blocks of 8
    defaults = {"gen_length": 64, "steps": 64, "block_length": block, "frequency_penalty": FREQUENCY_PENALTY}
    (out / "generation_config.json").write_text(json.dumps(defaults, indent=2) + "\n")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
