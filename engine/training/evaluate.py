"""`celeris eval`: held-out masked-token loss and skill accuracy under several decoders.

The skill is two-digit addition on pairs never seen in training (`skill.heldout_pairs`). Each
decoder row reports exact-match accuracy and the mean forward passes per problem, so speed and
quality can be compared on the same footing.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from engine.params import SamplingParams
from engine.sampler import reference_generate
from engine.training import data, skill
from engine.training.corpus import load_austen

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


def skill_params(**kw) -> SamplingParams:
    g = data.SKILL_GEN_LENGTH
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
def heldout_loss(llm, paragraphs: list[str], seq_len: int = 128, windows: int = 64, seed: int = 0) -> float:
    """Mean cross-entropy (nats) per masked token, t ~ U(0,1) with a fixed seed, on held-out text."""
    tok = llm.tokenizer
    stream: list[int] = []
    for p in paragraphs:
        stream += [data.BOS_ID, *tok.encode(p)[1 if tok.add_bos else 0:], data.EOS_ID]
    x = torch.tensor(stream[: (len(stream) // seq_len) * seq_len]).view(-1, seq_len)[:windows]
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(x.shape[0], 1, generator=gen).clamp_min(0.05)
    masked = torch.rand(x.shape, generator=gen) < t
    logits = llm.model(torch.where(masked, tok.mask_id, x))
    return F.cross_entropy(logits[masked].float(), x[masked]).item()


def evaluate(llm, cache_dir: Path, decoders: Optional[dict[str, dict]] = None, limit: Optional[int] = None) -> dict:
    novels = load_austen(cache_dir)
    _, held = data.split_paragraphs(novels)
    pairs = skill.heldout_pairs()[:limit]
    scores = [skill_accuracy(llm, name, skill_params(**kw), pairs) for name, kw in (decoders or SKILL_DECODERS).items()]
    return {"heldout_masked_token_loss": heldout_loss(llm, held), "skill_problems": len(pairs),
            "scores": scores, "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
            "dtype": str(llm.model.dtype).replace("torch.", "")}


def format_report(report: dict) -> str:
    lines = [f"held-out masked-token loss: {report['heldout_masked_token_loss']:.3f} nats/token",
             f"skill: two-digit addition, {report['skill_problems']} held-out problems, "
             f"gen_length={data.SKILL_GEN_LENGTH}, block_length={data.SKILL_GEN_LENGTH}, temperature 0 "
             f"({report['machine']}, {report['dtype']})",
             "", "| decoder | accuracy | forward passes / problem |", "|---|---|---|"]
    for s in report["scores"]:
        lines.append(f"| {s.name} | {100 * s.accuracy:.1f}% | {s.forward_passes:.2f} |")
    return "\n".join(lines)
