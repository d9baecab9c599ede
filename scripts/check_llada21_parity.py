"""Celeris' LLaDA2.1 token editing against the published `generate()` itself, token for token.

The published code is inclusionAI's `modeling_llada2_moe.py` (with its
`configuration_llada2_moe.py`) from a LLaDA2.1 Hugging Face folder; it is third-party code, so
Celeris neither ships nor fetches it: point this script at a folder that holds the two files.

    python scripts/check_llada21_parity.py --published path/to/LLaDA2.1-mini
    python scripts/check_llada21_parity.py --published DIR --quick      # one case, one prompt

It writes a tiny random LLaDA2 checkpoint (tests/unit/block_references/checkpoints.py: the
published tensor names, float32), loads it with the published class (eager attention), and
runs the cases of tests/unit/families/test_llada21.py (blocks 4 and 8 x six threshold / editing /
post-step settings x three prompts) through:

- `as published`: the published `generate()` unchanged;
- `mask as intended`: the same, with the block mask that reaches attention read as 0/-inf. The
  revision vendored in ZHZisZZ/dllm (5589aeb) builds it as 0/1 and adds it to the scores
  unconverted, which masks nothing (docs/revising-models.md). A 0/1 mask is converted; a mask
  already 0/-inf is passed through, and the report says which one the file sent;
- Celeris (`LLM.load` on the same folder, each case's prompts in one batch).

Celeris never fills a mask with the mask token; the published loop does when the model ranks it
first (a random checkpoint may), and under a threshold it may then never end. The report marks
the cases where the published model picked the mask token for a mask and stops a published
run after --max-forwards forwards.

Needs transformers 4.x (the 5589aeb revision asks for RoPE type "default", gone in 5.x).
Exits 1 if, with the mask as intended, Celeris differs in a case where the published model
never picked the mask token for a mask.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import types
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from celeris.engine.config import EngineConfig  # noqa: E402
from celeris.engine.llm import LLM  # noqa: E402
from celeris.engine.sampling.params import SamplingParams  # noqa: E402
from tests.unit.block_references.checkpoints import (EOS_ID, MASK_ID, cut,  # noqa: E402
                                                     write_llada21_checkpoint)

G = 16
PROMPTS = [[17, 301, 45], [88, 5, 640, 31, 77, 402, 15, 9], [12, 33, 999, 4, 58, 61, 700, 13, 90, 210, 6]]
# (threshold, editing_threshold, max_post_steps); editing None = off (1.0 for the published code).
SETTINGS = [(0.95, 0.9, 16), (0.7, 0.5, 16), (0.5, 0.0, 16), (0.5, 0.0, 2), (0.3, 0.0, 0), (0.5, None, 16)]
BLOCKS = (4, 8)


def import_folder(folder: Path, name: str = "published_llada21") -> types.ModuleType:
    """The folder's `modeling_llada2_moe` as a module of a package named `name`, so its relative
    import of `configuration_llada2_moe` resolves (a Hugging Face folder has no __init__.py)."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    package = types.ModuleType(name)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
    return importlib.import_module(f"{name}.modeling_llada2_moe")


class MaskSeen:
    """Wraps the module's eager attention: records the additive mask's kind ('0/1' or '0/-inf')
    and, when `intended`, converts a 0/1 mask to 0/-inf before the scores see it."""

    def __init__(self, inner: Callable, intended: bool):
        self.inner, self.intended, self.kinds = inner, intended, set()

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None:
            # A 0/-inf mask never holds a 1 (all zeros: everything visible); a 0/1 one always does.
            zero_one = bool(((attention_mask == 0) | (attention_mask == 1)).all() and (attention_mask == 1).any())
            self.kinds.add("0/1" if zero_one else "0/-inf")
            if self.intended and zero_one:
                attention_mask = torch.zeros_like(attention_mask).masked_fill(attention_mask == 0, float("-inf"))
        return self.inner(module, query, key, value, attention_mask, *args, **kwargs)


class Watch:
    """Counts one `generate()`'s forwards (raising `NoEnd` past `limit`) and notes whether the
    model picked the mask token for a position that is a mask: Celeris never fills a mask with
    the mask token (docs/models.md); the published loop may, and the position stays a mask, so
    under a threshold the loop may never end."""

    def __init__(self, model, mask_id: int, limit: int):
        self.limit, self.forwards, self.picked_mask, self.window = limit, 0, False, None
        forward, sample = model.forward, model._sample_with_temperature_topk_topp

        def counted(input_ids, *args, **kwargs):
            self.forwards += 1
            if self.forwards > self.limit:
                raise NoEnd
            self.window = input_ids
            return forward(input_ids, *args, **kwargs)

        def noted(*args, **kwargs):  # called on the logits of the window's last block
            x0, p = sample(*args, **kwargs)
            block = self.window[:, -x0.shape[1]:]
            self.picked_mask |= bool(((x0 == mask_id) & (block == mask_id)).any())
            return x0, p

        model.forward, model._sample_with_temperature_topk_topp = counted, noted

    def reset(self):
        self.forwards, self.picked_mask = 0, False


class NoEnd(Exception):
    """The published loop ran past the forward limit."""


def published_outputs(folder: Path, published: Path, intended: bool, cases, limit: int) -> tuple[list, list, set]:
    """Per case: the cut output (None if the loop did not end within `limit` forwards) and
    whether the model picked the mask token for a mask; the kinds of mask attention saw."""
    modeling = import_folder(published)
    seen = MaskSeen(modeling.eager_attention_forward, intended)
    modeling.eager_attention_forward = seen
    model = modeling.LLaDA2MoeModelLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    watch = Watch(model, MASK_ID, limit)
    outs, picked = [], []
    with torch.no_grad():
        for block, (thr, edit, post), prompt in cases:
            watch.reset()
            try:
                ids = model.generate(torch.tensor([prompt]), block_length=block, steps=G, gen_length=G,
                                     threshold=thr, editing_threshold=1.0 if edit is None else edit,
                                     max_post_steps=post, eos_id=EOS_ID, mask_id=MASK_ID)
                outs.append(cut(ids[0].tolist(), G))
            except NoEnd:
                outs.append(None)
            picked.append(watch.picked_mask)
    return outs, picked, seen.kinds


def celeris_outputs(folder: Path, cases) -> list[list[int]]:
    """Each case's prompts decode together in one batch, as the engine serves them."""
    llm = LLM.load(folder, EngineConfig(max_batch=8, max_prompt_tokens=64, max_gen_length=64))
    outs = []
    for block, (thr, edit, post) in dict.fromkeys((b, s) for b, s, _ in cases):
        prompts = [p for b, s, p in cases if (b, s) == (block, (thr, edit, post))]
        params = SamplingParams(seed=0, gen_length=G, block_length=block, steps=G, threshold=thr,
                                editing_threshold=edit, max_post_steps=post)
        seqs = [llm.sequence(p, params) for p in prompts]
        for s in seqs:
            llm.loop.add(s)
        llm.loop.run_to_completion()
        outs += [cut(s.generated(), G) for s in seqs]
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--published", type=Path, required=True,
                    help="folder with the published modeling_llada2_moe.py and configuration_llada2_moe.py")
    ap.add_argument("--seed", type=int, default=3, help="the random checkpoint's seed")
    ap.add_argument("--quick", action="store_true", help="one case (block 4, S mode, 2 post steps), one prompt")
    ap.add_argument("--max-forwards", type=int, default=400,
                    help="a published generate() still running after this many forwards is reported as not ending")
    args = ap.parse_args(argv)
    cases = [(b, s, p) for b in BLOCKS for s in SETTINGS for p in PROMPTS]
    if args.quick:
        cases = [(4, (0.5, 0.0, 2), PROMPTS[2])]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_llada21_checkpoint(Path(tmp) / "llada21", seed=args.seed)
        ours = celeris_outputs(folder, cases)
        runs = [(label, intended, published_outputs(folder, args.published, intended, cases, args.max_forwards))
                for label, intended in (("as published", False), ("mask as intended", True))]
    ok = True
    for label, intended, (theirs, picked, kinds) in runs:
        same = sum(a == b for a, b in zip(ours, theirs))
        explained = sum(a != b and m for a, b, m in zip(ours, theirs, picked))
        print(f"{label:17s} mask reaching attention: {', '.join(sorted(kinds)) or 'none'}; "
              f"Celeris identical in {same}/{len(cases)} cases"
              + (f" ({explained} of the others: the published model picked the mask token for a mask)"
                 if explained else ""),
              flush=True)
        for (block, s, p), a, b, m in zip(cases, ours, theirs, picked):
            if a != b:
                why = ("published loop did not end" if b is None else "differs") + (
                    "; the published model picked the mask token for a mask" if m else "")
                print(f"  block {block}, settings {s}, prompt length {len(p)}: {why}")
        # With the mask as intended, every case where the model never picked the mask token for a mask must agree.
        ok = ok and (not intended or all(a == b or m for a, b, m in zip(ours, theirs, picked)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
