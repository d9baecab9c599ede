"""LLaDA2.1 token editing against its published generate(), token for token (float32, CPU).

The reference (tests/unit/block_references/generate.py `llada21_generate`) is written from the
published loop's description and recomputes the whole window every step, as published; the
engine decodes the prompts of a case in one batch over its exact block cache. A LLaDA2.0 folder
(no editing) keeps LLaDA2.0's loop; editing is refused there.
"""

from __future__ import annotations

import json

import pytest

from celeris.engine.families.checkpoint import read_config
from celeris.engine.families.registry import family_of
from celeris.engine.errors import InvalidRequest
from celeris.engine.sampling.params import SamplingParams
from tests.unit.block_references.checkpoints import (EOS_ID, MASK_ID, cut, write_llada2_checkpoint,
                                                     write_llada21_checkpoint)
from tests.unit.block_references.generate import llada21_generate
from tests.unit.block_references.modeling import load_block_model
from tests.unit.block_helpers import PROMPTS, engine, run_engine

G = 16
# (threshold, editing_threshold, max_post_steps): the published defaults, the model card's Q and
# S modes, a short post-step budget, none at all, and editing off (published: a threshold no
# probability exceeds).
SETTINGS = [(0.95, 0.9, 16), (0.7, 0.5, 16), (0.5, 0.0, 16), (0.5, 0.0, 2), (0.3, 0.0, 0), (0.5, None, 16)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_llada21_checkpoint(tmp_path_factory.mktemp("llada21"), seed=3)


@pytest.fixture(scope="module")
def llm(folder):
    return engine(folder)


@pytest.fixture(scope="module")
def ref_model(folder):
    return load_block_model(folder)


def _params(block_length, threshold, editing, post, per_step=1):
    return dict(gen_length=G, block_length=block_length, steps=G // per_step, threshold=threshold,
                editing_threshold=editing, max_post_steps=post)


def _ref(ref_model, prompt, block_length, threshold, editing, post, per_step=1):
    return llada21_generate(ref_model, prompt, G, block_length, threshold=threshold,
                            editing_threshold=1.0 if editing is None else editing, max_post_steps=post,
                            num_to_transfer=per_step, mask_id=MASK_ID, eos_id=EOS_ID)


@pytest.mark.slow  # ~30 s a case under load: the reference recomputes the whole window each step
@pytest.mark.parametrize("block_length", [4, 8])
@pytest.mark.parametrize("threshold,editing,post", SETTINGS)
def test_llada21_equals_its_published_loop(llm, ref_model, block_length, threshold, editing, post):
    seqs = run_engine(llm, PROMPTS, **_params(block_length, threshold, editing, post))
    for p, s in zip(PROMPTS, seqs):
        ref = _ref(ref_model, p, block_length, threshold, editing, post)
        assert MASK_ID not in ref.ids
        assert s.generated() == cut(ref.ids, G), (p, ref)
        assert s.finished


def test_one_prompt_with_edits_and_a_post_step_budget(llm, ref_model):
    """The fast tier's case: the longest prompt (two prefilled blocks, a tail in the first decoded
    block) in the S mode with 2 post steps, where blocks end on the budget and an edit writes
    the mask token back (the engine must let it, as published)."""
    p = PROMPTS[2]
    ref = _ref(ref_model, p, 4, 0.5, 0.0, 2)
    assert ref.edits > 0 and ref.post_forwards > 0
    s = run_engine(llm, [p], **_params(4, 0.5, 0.0, 2))[0]
    assert s.generated() == cut(ref.ids, G)


@pytest.mark.slow
def test_editing_happens_and_changes_the_output(llm, ref_model):
    """The comparison above is not vacuous: the S mode edits on this checkpoint, and its output
    differs from the same loop with editing off."""
    on = [_ref(ref_model, p, 4, 0.5, 0.0, 16) for p in PROMPTS]
    off = [_ref(ref_model, p, 4, 0.5, None, 16) for p in PROMPTS]
    assert sum(r.edits for r in on) > 0 and sum(r.post_forwards for r in on) > 0
    assert [r.ids for r in on] != [r.ids for r in off]
    assert sum(r.edits for r in off) == 0


@pytest.mark.slow
def test_two_masks_a_step(llm, ref_model):
    """num_to_transfer = 2: the block split over its steps (block 8, 4 steps a block)."""
    seqs = run_engine(llm, PROMPTS, **_params(8, 0.9, 0.5, 4, per_step=2))
    for p, s in zip(PROMPTS, seqs):
        assert s.generated() == cut(_ref(ref_model, p, 8, 0.9, 0.5, 4, per_step=2).ids, G)


@pytest.mark.slow
def test_batched_rows_match_their_solo_runs(llm):
    params = _params(4, 0.5, 0.0, 3)
    together = run_engine(llm, PROMPTS, **params)
    for p, s in zip(PROMPTS, together):
        assert run_engine(llm, [p], **params)[0].generated() == s.generated()


def test_events_name_the_revised_positions(llm):
    seq = llm.sequence(PROMPTS[1], SamplingParams(seed=0, **_params(4, 0.5, 0.0, 16)))
    llm.loop.add(seq)
    events = []
    while not seq.finished:
        events += [e for e in llm.loop.step()[0] if e.request_id == seq.request_id]
    shown: dict[int, int] = {}
    revised = settled = 0
    for e in events:
        assert e.revising and set(e.revised) <= set(e.committed)
        for pos in e.committed:
            assert (pos in shown) == (pos in e.revised)  # revised: it held a token before
            assert pos >= settled  # nothing an earlier event called settled changes
            shown[pos] = e.canvas[pos]
        revised += len(e.revised)
        settled = e.settled
    assert revised > 0
    assert events[-1].generated == tuple(seq.generated())


def test_the_folder_is_recognised_and_defaults_to_the_published_generate(folder, llm, tmp_path):
    assert family_of(read_config(folder)).edits and llm.family.edits
    d = llm.defaults
    assert (d.threshold, d.editing_threshold, d.max_post_steps) == (0.95, 0.9, 16)
    plain = write_llada2_checkpoint(tmp_path / "llada20", seed=3)
    assert not family_of(read_config(plain)).edits
    gen = json.loads((plain / "generation_config.json").read_text())
    (plain / "generation_config.json").write_text(json.dumps(gen | {"editing_threshold": 0.5}))
    assert family_of(read_config(plain)).edits  # a generation_config.json with editing knobs


def test_llada20_keeps_its_loop_and_refuses_editing(tmp_path):
    llm = engine(write_llada2_checkpoint(tmp_path / "llada20", seed=3))
    assert not llm.family.edits and llm.defaults.editing_threshold is None
    with pytest.raises(InvalidRequest, match="editing_threshold"):
        llm.sequence(PROMPTS[0], SamplingParams(gen_length=16, block_length=4, steps=16, editing_threshold=0.5))


def test_a_mask_token_in_the_prompts_tail_is_filled_as_published(llm, ref_model):
    """Both published loops take the block's masks as `x[block] == mask_id`, the prompt's tail
    included: a mask token there is filled (and then, being prompt, never edited), and the block
    does not end before it is. The engine fills it in its token row and keeps it out of the
    output (it once wrote it at canvas index -1, the canvas's last position)."""
    p = [12, 33, 999, 4, 58, MASK_ID]  # block 4: prompt positions 4, 5 share the first decoded block
    for editing in (0.0, None):
        ref = _ref(ref_model, p, 4, 0.5, editing, 2)
        s = run_engine(llm, [p], **_params(4, 0.5, editing, 2))[0]
        assert s.generated() == cut(ref.ids, G), (editing, ref)
        assert s.finished


def test_edits_that_keep_reopening_positions_end(llm, monkeypatch):
    """A model sure of the mask token everywhere: each step fills one mask (the mask token is
    never a fill) and edits every written position back to the mask token, so no block is ever
    full. The published loop would run forever; Celeris stops editing a block after
    EDIT_STEP_FACTOR x its planned steps, fills it, and the request ends with no mask in its
    output."""
    from celeris.engine.families.block.sequence import EDIT_STEP_FACTOR

    head = llm.model.head

    def mask_everywhere(h):
        logits = head(h)
        logits[..., MASK_ID] += 1e4
        return logits

    monkeypatch.setattr(llm.model, "head", mask_everywhere)
    b, post = 4, 2
    s = run_engine(llm, [PROMPTS[1]], **_params(b, 0.5, 0.0, post))[0]  # 8 tokens: 4 whole blocks to decode
    assert s.finished and len(s.output) == G and MASK_ID not in s.output
    capped = EDIT_STEP_FACTOR * (b + post)  # one mask a step, then the post steps
    # one prefill (none when an earlier test's request left the prompt's blocks in the prefix
    # cache); per block the capped steps, the b - 1 masks left, an edit-free post step
    assert s.prefill_steps == (0 if s.cached_tokens else 1)
    assert s.nfe == s.prefill_steps + s.decode_blocks * (capped + b - 1 + 1)
