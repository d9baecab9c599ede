"""Which order keeps DiffusionGemma's documents valid at the least cost (issue 62), measured.

    python scripts/bench_gemma_documents.py --seeds 2 --json out.json

A revising canvas is re-sampled whole until its rule stops it, so a grammar cannot check it left to
right as it stands. Two orders, on the same requests (the 20 schemas of
tests/unit/document_schemas.py x seeds, max_tokens 96, on a tiny random DiffusionGemma checkpoint
with celeris-tiny's tokenizer, canvas 16, 3 denoising steps a canvas, 8 rows a batch):

- `final` (what serves, revise/slots.py): each canvas denoises free; the step that stops it commits
  it under the grammar in one pass left to right, each position its most likely allowed token.
- `guided`: the same commit, and at every step before it the accepted positions of the next input
  canvas (and the shown draft) take that pass's tokens over the step's logits, walked on a trial
  copy of the constraint: the model always denoises a canvas whose accepted text the grammar allows.

Per order: documents valid (jsonschema), denoising steps, the share of committed document tokens
that are the commit step's own argmax (how often the grammar overrode the model) and their mean
log-probability under the commit step's tempered logits, and the host time of the grammar passes.
On a random model the last two say little about quality; they show whether guiding moves the
model's own choice toward what the grammar commits, at what cost.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.families.revise.sampler import accept_mask, entropy_chunked  # noqa: E402
from celeris.engine.families.revise.slots import SlotState  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.requests import Request  # noqa: E402
from celeris.engine.structured.constraint import Constraint, Structured  # noqa: E402
from tests.unit.document_schemas import DOCUMENT_SCHEMAS  # noqa: E402
from tests.unit.revise_references.gemma_checkpoint import write_bpe_checkpoint  # noqa: E402


class Tally:
    def __init__(self):
        self.agree = self.tokens = self.steps = 0
        self.logprob = self.pass_s = 0.0


TALLY = Tally()
_constrained, _settle = SlotState._constrained, SlotState.settle


def trial(c: Constraint) -> Constraint:
    """A copy of the constraint's decoding state that the real one never sees."""
    t = copy.copy(c)
    t._matchers = [m.deep_copy() for m in c._matchers]
    t._ended, t._by_front, t._force, t._early = list(c._ended), dict(c._by_front), dict(c._force), dict(c._early)
    t._closers = {}
    for i, closer in c._closers.items():
        n = copy.copy(closer)
        n.scan, n._after, n._scratch = closer.scan.copy(), dict(closer._after), closer._scratch.copy()
        n.path = None if closer.path is None else list(closer.path)
        t._closers[i] = n
    return t


def counted_commit(self: SlotState, logits: torch.Tensor) -> list[int]:
    """The commit pass, tallied: agreement with the free argmax and log-probability, document tokens only."""
    t0 = time.perf_counter()
    block = _constrained(self, logits)
    TALLY.pass_s += time.perf_counter() - t0
    logp = torch.log_softmax(logits.float(), -1)
    for j, tok in enumerate(block):
        if tok in self.eos_ids:
            break
        TALLY.tokens += 1
        TALLY.agree += int(logits[j].argmax()) == tok
        TALLY.logprob += float(logp[j, tok])
    return block


def guided_settle(self: SlotState, pending, values):
    """`settle`, then (the canvas going on) its accepted positions set to the grammar's pass."""
    TALLY.steps += 1
    canvas_before = len(self.final)
    out = _settle(self, pending, values)
    tempered = pending.draw.tempered
    if self.constraint is None or self.finished or len(self.final) != canvas_before or tempered is None:
        return out
    t0 = time.perf_counter()
    real, self.constraint = self.constraint, trial(self.constraint)
    try:
        projected = _constrained(self, tempered)
    finally:
        self.constraint = real
    TALLY.pass_s += time.perf_counter() - t0
    accepted = accept_mask(entropy_chunked(tempered), self.params.entropy_bound)  # (L,) as the step accepted
    self.canvas = torch.where(accepted, torch.tensor(projected, device=self.device), self.canvas)
    self.draft = projected
    return out


def plain_settle(self: SlotState, pending, values):
    TALLY.steps += 1
    return _settle(self, pending, values)


def run(llm: LLM, order: str, seeds: int) -> dict:
    global TALLY
    TALLY = Tally()
    SlotState._constrained = counted_commit
    SlotState.settle = guided_settle if order == "guided" else plain_settle
    names = [n for n in DOCUMENT_SCHEMAS for _ in range(seeds)]
    seqs = []
    for k, name in enumerate(names):
        params = replace(llm.defaults, gen_length=96, block_length=96, steps=1, seed=k % seeds, max_denoising_steps=3)
        seqs.append(llm.build(Request(prompt="JSON:", params=params,
                                      structured=Structured("json_schema", DOCUMENT_SCHEMAS[name], "s"))))
    t0 = time.perf_counter()
    outs = llm.run(seqs)
    wall = time.perf_counter() - t0
    import jsonschema

    valid = 0
    for name, o in zip(names, outs):
        try:
            jsonschema.validate(json.loads(o.text), DOCUMENT_SCHEMAS[name])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    n = max(TALLY.tokens, 1)
    return {"order": order, "requests": len(outs), "valid": valid, "denoising_steps": TALLY.steps,
            "document_tokens": TALLY.tokens, "argmax_share": round(TALLY.agree / n, 4),
            "mean_logprob": round(TALLY.logprob / n, 4), "grammar_pass_s": round(TALLY.pass_s, 2),
            "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    folder = write_bpe_checkpoint(Path(tempfile.mkdtemp()), canvas_length=16)
    llm = LLM.load(folder, EngineConfig(max_batch=8, max_queue=64, max_prompt_tokens=64, max_gen_length=128))
    rows = [run(llm, order, args.seeds) for order in ("final", "guided")]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
