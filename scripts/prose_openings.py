"""How varied celeris-tiny's prose openings are: greedy continuations of 50 held-out paragraphs'
first 8 words (as `celeris eval`'s prose check), with the model's default settings; reports the
share of distinct first-5-word openings and the most common one, then answers a few candidate
page prompts (completion mode) so the web page's default can be one the model answers.

    python scripts/prose_openings.py [--cache-dir DIR] [--threads 1]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from celeris.engine.llm import LLM
from celeris.engine.sampling.params import fit_lengths
from celeris.engine.threads import configure_threads
from celeris.engine.training import data
from celeris.engine.training.corpus import load_austen
from celeris.engine.training.evaluate import PROSE_WORDS

CANDIDATES = ("It is a truth universally acknowledged", "Mr. Darcy walked into the room and",
              "Elizabeth looked at her sister and said", "The morning was fine, and",
              "She had never seen so much", "Write a short poem about the sea.")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "celeris")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=50)
    a = ap.parse_args()
    configure_threads(a.threads)
    llm = LLM.load("celeris-tiny")
    _, held = data.split_paragraphs(load_austen(a.cache_dir))
    prompts = [" ".join(p.split()[:PROSE_WORDS]) for p in held[:a.prompts]]
    params = fit_lengths(llm.defaults, {"gen_length": 64, "seed": 0, "temperature": 0.0})
    results = llm.generate(prompts, params)
    openings = [" ".join(r.text.split()[:5]) for r in results]
    counts = collections.Counter(openings)
    report = {"prompts": len(prompts), "gen_length": 64, "params": "model defaults, greedy, seed 0",
              "distinct_first5": len(counts) / len(openings), "most_common": counts.most_common(3),
              "samples": [(p, r.text) for p, r in list(zip(prompts, results))[:3]],
              "candidates": [(c, r.text) for c, r in zip(CANDIDATES, llm.generate(list(CANDIDATES), params))]}
    print(json.dumps(report, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
