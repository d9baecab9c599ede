"""LLaDA2.2's joint decode rule (engine/families/block/levenshtein.py) against the reference loop
written from the published description (tests/unit/block_references/llada22.py), on scripted
logits: the edit scan's oracles and whole blocks, token for token and forward for forward."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from celeris.engine.families.block.levenshtein import EditIds, JointBlock, JointKnobs, consume_edits, joint_step
from tests.unit.block_references.llada22 import _consume, joint_decode_block

V, MASK, DEL, SPL = 24, 20, 21, 22
IDS = EditIds(MASK, DEL, SPL)
Script = Callable[[list[int]], torch.Tensor]


def logits_for(picks: list[int], prob: float | list[float]) -> torch.Tensor:
    """(L, V) float32 logits whose softmax gives picks[i] probability prob (or prob[i])."""
    probs = torch.tensor(prob if isinstance(prob, list) else [prob] * len(picks), dtype=torch.float64)
    rest = ((1 - probs) / (V - 1))[:, None].expand(len(picks), V).clone()
    rest[torch.arange(len(picks)), torch.tensor(picks)] = probs
    return rest.log().float()


# ------------------------------------------------------------------ the edit scan


@pytest.mark.parametrize("written,before,original,protected,tokens,flags", [
    ([5, DEL, 7, 8], [5, 6, 7, 8], [0, 0, 1, 0], 0, [5, 7, 8, MASK], [0, 1, 0, 0]),  # shift left, pad a new mask
    ([5, SPL, 7, 8], [5, 6, 7, 8], [0, 1, 0, 0], 0, [5, MASK, 6, 7], [0, 0, 1, 0]),  # mask + old token, cut
    ([5, 6, 7, 8], [1, 1, 1, 1], [1, 0, 1, 0], 0, [5, 6, 7, 8], [1, 0, 1, 0]),  # no edit token: unchanged
    ([DEL, 6, SPL, 8], [5, 6, 7, 8], [0, 0, 0, 0], 0, [6, MASK, 7, 8], [0, 0, 0, 0]),  # both, left to right
    ([DEL, DEL, DEL, 8], [5, 6, 7, 8], [1, 1, 1, 1], 0, [8, MASK, MASK, MASK], [1, 0, 0, 0]),
    ([SPL, SPL, 7, 8], [5, 6, 7, 8], [1, 0, 0, 0], 0, [MASK, 5, MASK, 6], [0, 1, 0, 0]),
    ([DEL, SPL, 7, 8], [DEL, SPL, 7, 8], [0, 0, 1, 1], 2, [DEL, SPL, 7, 8], [0, 0, 1, 1]),  # the prompt is opaque
])
def test_the_edit_scan(written, before, original, protected, tokens, flags):
    original, flags = [bool(o) for o in original], [bool(f) for f in flags]
    assert consume_edits(written, before, original, IDS, protected) == (tokens, flags)
    if not protected:  # the reference's scan agrees where it applies (no prompt in the block)
        assert _consume(written, before, original, MASK, DEL, SPL) == (tokens, flags)


# ------------------------------------------------------------------ whole blocks


def celeris_block(script: Script, tokens: list[int], knobs: JointKnobs, protected: int = 0
                  ) -> tuple[list[int], int, JointBlock]:
    state = JointBlock.enter(0, tokens, MASK, knobs.steps)
    forwards = 0
    while True:
        step = joint_step(script(tokens), tokens, state, knobs, IDS, protected)
        tokens, forwards = step.tokens, forwards + 1
        if step.done:
            return tokens, forwards, state
        assert forwards < 200


def reference_block(script: Script, prefix: list[int], tokens: list[int], knobs: JointKnobs
                    ) -> tuple[list[int], int, int]:
    x = torch.tensor(prefix + tokens)
    lo, hi = len(prefix), len(prefix) + len(tokens)
    r = joint_decode_block(lambda x, hi: script(x[lo:hi].tolist()), x, lo, hi, steps=knobs.steps,
                           threshold=knobs.threshold, editing_threshold=knobs.editing_threshold,
                           max_post_steps=knobs.max_post_steps, mask=MASK, delete=DEL, split=SPL)
    return x[lo:hi].tolist(), r.forwards, r.escapes


def fill(target: list[int]) -> Callable[[list[int]], list[int]]:
    return lambda block: [target[i] if t == MASK else t for i, t in enumerate(block)]


TARGET = [3, 4, 5, 6, 7, 8, 9, 10]


def plain(block):
    return logits_for(fill(TARGET)(block), 0.95)


def gradual(block):  # below the threshold: the schedule's floor decides
    return logits_for(fill(TARGET)(block), [0.30 + 0.01 * i for i in range(8)])


def rewrite(block):  # once written, position 2 is rewritten
    return logits_for([3, 4, 11, 6, 7, 8, 9, 10] if block == TARGET else fill(TARGET)(block), 0.95)


def delete(block):  # position 2 deleted; the padded mask becomes 12
    if block == TARGET:
        return logits_for(TARGET[:2] + [DEL] + TARGET[3:], 0.95)
    return logits_for(fill(TARGET[:2] + TARGET[3:] + [12])(block) if MASK in block[-1:] else fill(TARGET)(block),
                      0.95)


def split(block):  # a token inserted before position 2; the block's last token falls off
    if block == TARGET:
        return logits_for(TARGET[:2] + [SPL] + TARGET[3:], 0.95)
    return logits_for(fill([3, 4, 13] + TARGET[2:7])(block), 0.95)


def rotating(block):  # position 0 cycles through 14..17 forever: only the budget ends it
    if MASK in block:
        return logits_for(fill(TARGET)(block), 0.95)
    return logits_for([14 + (block[0] - 13) % 4] + block[1:], 0.95)


def flipping(block):  # position 7 flips between 10 and 18: the anti-loop's one changed position
    if MASK in block:
        return logits_for(fill(TARGET)(block), 0.95)
    return logits_for(block[:7] + [18 if block[7] == 10 else 10], 0.9)


SCENARIOS = {  # name: (script, knobs)
    "plain fill": (plain, JointKnobs(steps=8)),
    "gradual fill under the schedule": (gradual, JointKnobs(steps=4)),
    "token-to-token rewrite": (rewrite, JointKnobs(steps=8, editing_threshold=0.5)),
    "delete": (delete, JointKnobs(steps=8, editing_threshold=0.5)),
    "split": (split, JointKnobs(steps=8, editing_threshold=0.5)),
    "budget ends rotating edits": (rotating, JointKnobs(steps=8, editing_threshold=0.5, max_post_steps=3)),
    "no post steps": (plain, JointKnobs(steps=8, max_post_steps=0)),
    "anti-loop with one changed position": (flipping, JointKnobs(steps=8, max_post_steps=6)),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_scripted_block_is_the_reference(name):
    script, knobs = SCENARIOS[name]
    ours, forwards, state = celeris_block(script, [MASK] * 8, knobs)
    ref, ref_forwards, ref_escapes = reference_block(script, [1, 2], [MASK] * 8, knobs)
    assert ours == ref
    assert forwards == ref_forwards
    assert state.escapes == ref_escapes
    assert MASK not in ours and DEL not in ours and SPL not in ours


def test_the_scenarios_do_what_they_say():
    """Each scripted block exercises its rule (else the parity above would prove little)."""
    assert celeris_block(plain, [MASK] * 8, JointKnobs(steps=8))[0] == TARGET
    assert celeris_block(gradual, [MASK] * 8, JointKnobs(steps=4))[1] == 5  # 2 per step, then a stable step
    assert celeris_block(rewrite, [MASK] * 8, JointKnobs(editing_threshold=0.5))[0][2] == 11
    assert celeris_block(delete, [MASK] * 8, JointKnobs(editing_threshold=0.5))[0] == [3, 4, 6, 7, 8, 9, 10, 12]
    assert celeris_block(split, [MASK] * 8, JointKnobs(editing_threshold=0.5))[0] == [3, 4, 13, 5, 6, 7, 8, 9]
    _, forwards, state = celeris_block(rotating, [MASK] * 8, JointKnobs(editing_threshold=0.5, max_post_steps=3))
    assert forwards == 1 + 3 and state.post_steps == 3  # the fill, then 3 post steps, the last the final round
    assert celeris_block(plain, [MASK] * 8, JointKnobs(max_post_steps=0))[1] == 1  # the fill is the final round
    assert celeris_block(flipping, [MASK] * 8, JointKnobs(max_post_steps=6))[2].escapes > 0


def test_the_prompt_in_the_block_is_never_edited():
    """The first block holds the prompt's tail: never rewritten, deleted or moved, even when the
    model asks to and the prompt holds literal edit ids."""
    def script(block):
        return logits_for([DEL, SPL, 9] + fill([0, 0, 0, 5, 6, 7, 8, 9])(block)[3:], 0.99)
    out, _, _ = celeris_block(script, [DEL, SPL, 4, MASK, MASK, MASK, MASK, MASK], JointKnobs(), protected=3)
    assert out[:3] == [DEL, SPL, 4]
    assert out[3:] == [5, 6, 7, 8, 9]


def test_the_hard_cap_ends_a_block_resolved():
    """A model that splits forever: at the cap the step is a final round (no mask, no edit token)."""
    def script(block):
        return logits_for([SPL] + block[1:] if MASK not in block else fill(TARGET)(block), 0.95)
    out, forwards, _ = celeris_block(script, [MASK] * 8, JointKnobs(max_post_steps=50, max_steps=10))
    assert forwards == 10
    assert not set(out) & {MASK, DEL, SPL}


def test_the_anti_loop_draw_is_the_seeds():
    """Where several positions changed, the drawn one depends on the seed only: one seed gives one
    block every time; some other seed draws another position."""
    def script(block):  # two positions flip together between two states
        if MASK in block:
            return logits_for(fill(TARGET)(block), 0.95)
        flip = {10: 18, 18: 10, 9: 19, 19: 9}
        return logits_for(block[:6] + [flip.get(block[6], 10), flip.get(block[7], 9)], 0.9)
    runs = {seed: [celeris_block(script, [MASK] * 8, JointKnobs(seed=seed, max_post_steps=6))[0] for _ in range(2)]
            for seed in range(8)}
    assert all(a == b for a, b in runs.values())
    assert len({tuple(a) for a, _ in runs.values()}) > 1
