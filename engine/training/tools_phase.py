"""celeris-tiny's tools phase: a fine-tune of trained weights on tool-use conversations.

    celeris train --phase tools --init engine/training/celeris-tiny --out /tmp/celeris-tiny-tools

It starts from a finished model folder (the main and long-canvas phases' weights and tokenizer,
unchanged), so it costs minutes, not the whole recipe. A fresh AdamW (peak `TOOLS_LR`, short
warm-up, cosine) runs `TOOLS_STEPS` steps in cycles of six batches: three of tool-use
conversations (`tool_tasks.py`: calls, two calls in parallel, plain answers with tools listed,
answers from a tool result), and the old mix once each (pretraining text, additions drawn mostly
at long canvases as the long-canvas phase does, supervised examples), so what the model wrote
before (prose, additions) is kept. Only responses are supervised (LLaDA's SFT).

Positions: the model's `max_sequence_length` rises to `MAX_LEN` (4,096 prompt tokens + 512 of
answer). RoPE has no learned table, so the architecture allows it; what the model has not seen
is attention at those distances, so every `LONG_EVERY`-th tool batch is one conversation of
1,024..`MAX_LEN` tokens, prose before the request, and the model learns to answer the request at
the end of an agent-sized prompt.

The phase is defined by its steps and seed (its own generators, `seed + TOOLS_SEED`), never by
the wall clock; weights are saved every `checkpoint_every` steps so a stopped run leaves some.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from tokenizers import Tokenizer as HFTokenizer

from celeris.engine.families.checkpoint import load_model
from celeris.engine.models.transformer import count_parameters
from celeris.engine.training import data, tasks
from celeris.engine.training.corpus import load_austen

TOOLS_STEPS = 4000
TOOLS_LR = 1e-3
TOOLS_SEED = 11  # the phase's generators: seed + TOOLS_SEED
MAX_LEN = 4608  # positions after the phase: 4,096 of prompt and 512 of answer
MIN_LONG = 1024
LONG_EVERY = 10  # every 10th tool batch is one long conversation
CYCLE = ("tools", "text", "tools", "additions", "tools", "supervised")


def tools_phase(init: Path, out: Path, steps: int = TOOLS_STEPS, seed: int = 0, threads: int = 1,
                tokens: int = 2048, seq_len: int = 128, max_len: int = MAX_LEN,
                cache_dir: Path = Path.home() / ".cache" / "celeris", checkpoint_every: int = 500,
                log: Optional[Path] = None) -> dict:
    """Fine-tune the model in `init` for tool calls into `out` (see the module docstring);
    returns what it writes to `out/training.json` (the init's record plus this phase's)."""
    from celeris.engine.training.steps import _save, run_steps

    torch.manual_seed(seed + TOOLS_SEED)
    torch.set_num_threads(threads)
    model = load_model(init).train().requires_grad_(True)  # loaded for serving: eval, frozen
    model.cfg = replace(model.cfg, max_sequence_length=max_len)
    tok = HFTokenizer.from_file(str(Path(init) / "tokenizer.json"))
    batches = data.make_batches(tok, load_austen(cache_dir), seed + TOOLS_SEED, tools=True)
    gen = torch.Generator().manual_seed(seed + TOOLS_SEED)
    print(f"tools phase from {init}: {count_parameters(model) / 1e6:.2f}M params, {steps} steps, "
          f"positions up to {max_len} ({threads} threads)", flush=True)
    tool_batches = 0

    def draw(step: int) -> tuple[str, tuple]:
        nonlocal tool_batches
        kind = CYCLE[(step - 1) % len(CYCLE)]
        if kind == "text":
            return "text", batches.text(max(1, tokens // seq_len), seq_len)
        if kind == "additions":
            return "sft", batches.additions(tokens, canvas_weights=tasks.LONG_CANVAS_WEIGHTS)
        if kind == "supervised":
            return "sft", batches.supervised(tokens)
        tool_batches += 1
        if tool_batches % LONG_EVERY == 0:
            return "long", batches.long_tool_call(batches.tasks.rng.randint(MIN_LONG, max_len))
        return "tools", batches.tool_calls(tokens)

    log_file = open(log, "a") if log else None
    try:
        minutes = run_steps("tools", draw, gen, steps, TOOLS_LR, 50, model, lambda: _save(model, tok, out),
                            checkpoint_every, log_file, log_every=25)
    finally:
        if log_file:
            log_file.close()
    _save(model, tok, out)
    before = Path(init) / "training.json"
    info = json.loads(before.read_text()) if before.exists() else {}
    info |= {"tools_steps": steps, "tools_minutes": minutes, "tools_seed": seed + TOOLS_SEED, "tools_threads": threads,
             "tools_lr": TOOLS_LR, "max_sequence_length": max_len}
    (Path(out) / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved {out} after {steps} tools steps ({minutes} min)", flush=True)
    return info
