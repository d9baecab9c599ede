"""`celeris eval`: held-out loss, skill accuracy and repetition of a celeris-tiny model.

- Held-out NELBO (the model's own masked-diffusion bound) per token and per character.
- The skill, two-digit addition on pairs never seen in training (`skill.heldout_pairs`): with
  the default settings at max_tokens 4, 16, 64 and 256 (the answer must end in EOS), and under
  several decoders at gen_length 4 with the forward passes each spends, so speed and quality
  compare on one footing.
- Prose: greedy continuations of held-out paragraphs, scored by distinct word 4-grams.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from celeris.engine.sampling.params import SamplingParams, fit_lengths
from celeris.engine.sampling.reference import reference_generate
from celeris.engine.events import FinishReason
from celeris.engine.training import data, skill
from celeris.engine.training.corpus import load_austen
from celeris.engine.training.objective import model_loss

SKILL_DECODERS: dict[str, dict] = {
    "reference (steps=gen_length)": dict(steps=data.SKILL_GEN_LENGTH),
    "fewer steps (2)": dict(steps=2),
    "fewer steps (1)": dict(steps=1),
    "threshold 0.9": dict(threshold=0.9),
    "threshold 0.7": dict(threshold=0.7),
    "threshold 0.5": dict(threshold=0.5),
}


@dataclass(frozen=True)
class DecoderScore:
    name: str
    accuracy: float
    forward_passes: float  # mean per problem
    seconds: float


# Block models decode in their trained block size: steps count over the whole canvas.
BLOCK_DECODERS: dict[str, dict] = {
    "one token per step": {},
    "threshold 0.9": dict(threshold=0.9),
    "threshold 0.5": dict(threshold=0.5),
}


def skill_params(llm, **kw) -> SamplingParams:
    g = data.SKILL_GEN_LENGTH
    if llm.family.block:
        return fit_lengths(llm.defaults, {"gen_length": g, "seed": 0} | kw)
    return SamplingParams(**({"gen_length": g, "block_length": g, "steps": g, "seed": 0} | kw))


def skill_accuracy(llm, name: str, params: SamplingParams, pairs: list[tuple[str, str]]) -> DecoderScore:
    t0 = time.perf_counter()
    if name.startswith("reference"):  # the readable reference loop itself, on one left-padded batch
        ids = [llm.encode_prompt(p) for p, _ in pairs]
        width = max(map(len, ids))
        batch = torch.tensor([[llm.tokenizer.pad_id] * (width - len(i)) + i for i in ids])
        attn = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        canvas, nfe = reference_generate(lambda x, m: llm.model(x, key_mask=None if m is None else m.bool()),
                                         batch, params, llm.tokenizer.mask_id, attention_mask=attn)
        answers = [llm.tokenizer.decode(llm.tokenizer.until_stop(row[width:].tolist())) for row in canvas]
        passes = float(nfe)
    else:
        results = llm.generate([p for p, _ in pairs], params)
        answers = [r.text for r in results]
        passes = sum(r.steps for r in results) / len(results)
    correct = sum(skill.is_correct(p, a) for (p, _), a in zip(pairs, answers))
    return DecoderScore(name, correct / len(pairs), passes, time.perf_counter() - t0)


@torch.no_grad()
def heldout_loss(llm, paragraphs: list[str], seq_len: int = 128, windows: int = 64, seed: int = 0) -> tuple[float, float]:
    """(nats per token, nats per character) on held-out text: the model's own training objective
    (LLaDA's or SDAR's masked-diffusion bound on the negative log-likelihood, every token
    maskable) over windows of the packed held-out paragraphs, with a fixed seed. Per character,
    models with different tokenizers compare on one scale."""
    tok = llm.tokenizer
    stream: list[int] = []
    for p in paragraphs:
        stream += [data.BOS_ID, *tok.encode(p)[1 if tok.add_bos else 0:], data.EOS_ID]
    chars_per_token = sum(len(p) for p in paragraphs) / len(stream)
    x = torch.tensor(stream[: (len(stream) // seq_len) * seq_len]).view(-1, seq_len)[:windows]
    real = torch.ones_like(x, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    loss = model_loss(llm.model, llm.family, x, real, real, tok.mask_id, gen)
    return loss.item(), loss.item() / chars_per_token


SKILL_LENGTHS = (4, 16, 64, 256)  # canvas lengths (max_tokens) the skill is checked at
PROSE_WORDS = 8  # held-out prose prompts: a paragraph's first words


def skill_at_lengths(llm, pairs: list[tuple[str, str]], lengths=SKILL_LENGTHS) -> list[dict]:
    """Held-out additions with the model's default settings at each canvas length (what
    `max_tokens` N gives on every surface): exact answers, and exact answers that end in EOS."""
    rows = []
    for n in lengths:
        params = fit_lengths(llm.defaults, {"gen_length": n, "seed": 0})
        t0 = time.perf_counter()
        results = llm.generate([p for p, _ in pairs], params)
        ok = [skill.is_correct(p, r.text) for (p, _), r in zip(pairs, results)]
        ended = [k and r.finish_reason is FinishReason.STOP for k, r in zip(ok, results)]
        rows.append({"max_tokens": n, "block_length": params.block_length, "steps": params.steps,
                     "accuracy": sum(ok) / len(pairs), "accuracy_with_eos": sum(ended) / len(pairs),
                     "forward_passes": sum(r.steps for r in results) / len(results),
                     "seconds": time.perf_counter() - t0})
    return rows


def distinct_ngrams(words: list[str], n: int = 4) -> Optional[float]:
    """Share of distinct word n-grams in one output (None if it has fewer than n words)."""
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


NO_PENALTY = {"frequency_penalty": 0.0, "presence_penalty": 0.0}


def has_penalty(p: SamplingParams) -> bool:
    return bool(p.frequency_penalty or p.presence_penalty)


def prose_repetition(llm, paragraphs: list[str], gen_length: int = 64, **overrides) -> dict:
    """Greedy continuations of held-out paragraphs' first words with the default settings
    (and `overrides`): the mean share of distinct word 4-grams per output, how long outputs are
    and how many end."""
    prompts = [" ".join(p.split()[:PROSE_WORDS]) for p in paragraphs]
    params = fit_lengths(llm.defaults, {"gen_length": gen_length, "seed": 0, "temperature": 0.0} | overrides)
    results = llm.generate(prompts, params)
    ratios = [r for r in (distinct_ngrams(res.text.split()) for res in results) if r is not None]
    return {"prompts": len(prompts), "gen_length": gen_length, "scored": len(ratios),
            "distinct_4grams": sum(ratios) / max(1, len(ratios)),
            "mean_tokens": sum(len(r.token_ids) for r in results) / len(results),
            "ended_with_eos": sum(r.finish_reason is FinishReason.STOP for r in results) / len(results),
            "frequency_penalty": params.frequency_penalty, "presence_penalty": params.presence_penalty,
            "samples": [(p, r.text) for p, r in list(zip(prompts, results))[:3]]}


def evaluate(llm, cache_dir: Path, decoders: Optional[dict[str, dict]] = None, limit: Optional[int] = None,
             lengths=SKILL_LENGTHS, prose_limit: Optional[int] = None) -> dict:
    novels = load_austen(cache_dir)
    _, held = data.split_paragraphs(novels)
    pairs = skill.heldout_pairs()[:limit]
    table = decoders or (BLOCK_DECODERS if llm.family.block else SKILL_DECODERS)
    scores = [skill_accuracy(llm, name, skill_params(llm, **kw), pairs) for name, kw in table.items()]
    per_token, per_char = heldout_loss(llm, held)
    return {"heldout_nelbo_per_token": per_token, "heldout_nelbo_per_char": per_char, "skill_problems": len(pairs),
            "scores": scores, "lengths": skill_at_lengths(llm, pairs, lengths),
            "prose": prose_repetition(llm, held[:prose_limit]),
            # the model's own text, without the default penalties its generation_config sets
            "prose_unpenalised": prose_repetition(llm, held[:prose_limit], **NO_PENALTY)
            if has_penalty(llm.defaults) else None,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
            "dtype": str(llm.model.dtype).replace("torch.", "")}


def format_report(report: dict) -> str:
    g = data.SKILL_GEN_LENGTH
    lines = [f"held-out NELBO: {report['heldout_nelbo_per_token']:.3f} nats/token, "
             f"{report['heldout_nelbo_per_char']:.3f} nats/character",
             f"skill: two-digit addition, {report['skill_problems']} held-out problems, temperature 0 "
             f"({report['machine']}, {report['dtype']})", "",
             "| max_tokens (default settings) | block, steps | exact | exact and ended with EOS | forward passes |",
             "|---|---|---|---|---|"]
    for r in report["lengths"]:
        lines.append(f"| {r['max_tokens']} | {r['block_length']}, {r['steps']} | {100 * r['accuracy']:.1f}% "
                     f"| {100 * r['accuracy_with_eos']:.1f}% | {r['forward_passes']:.2f} |")
    lines += ["", f"| decoder (gen_length {g}) | accuracy | forward passes / problem |", "|---|---|---|"]
    for s in report["scores"]:
        lines.append(f"| {s.name} | {100 * s.accuracy:.1f}% | {s.forward_passes:.2f} |")
    lines.append("")
    for prose in (report["prose"], report.get("prose_unpenalised")):
        if prose is None:
            continue
        penalty = (f"frequency_penalty {prose['frequency_penalty']:g}, presence_penalty {prose['presence_penalty']:g}"
                   + (" (the defaults)" if prose is report["prose"] else " (the model alone)"))
        lines += [f"prose: {prose['prompts']} held-out paragraphs' first {PROSE_WORDS} words, greedy, "
                  f"max_tokens {prose['gen_length']}, {penalty}: distinct word 4-grams "
                  f"{100 * prose['distinct_4grams']:.1f}% (mean over {prose['scored']} outputs of 4+ words), "
                  f"mean {prose['mean_tokens']:.1f} tokens, {100 * prose['ended_with_eos']:.0f}% ended with EOS"]
        lines += [f"  {p!r} -> {t!r}" for p, t in prose["samples"]]
    return "\n".join(lines)
