"""LLaDA2.2 served by the engine against its generate() as the tests' reference loop (float32, CPU,
temperature 0), on a tiny random checkpoint with the released config keys and tensor names.

The reference (tests/unit/block_references/llada22.py) recomputes the whole window every forward
with the released block-routed gate; the engine decodes over its exact block cache, several
requests in one batch. The checkpoint's output head favours the two edit ids a little, so its
decodes delete and split. Where the reference's anti-loop draws at random the decodes are not
compared (the draw is torch.randint there, the request's seed here); how often that happens is
counted. Seeds reproduce alone and in a batch; the second stop id stops; block lengths that are
not whole routing blocks are refused by field.
"""

from __future__ import annotations

import pytest

from celeris.engine.errors import InvalidRequest
from celeris.engine.families.checkpoint import parse_config
from celeris.engine.families.registry import family_of
from celeris.engine.sampling.params import SamplingParams
from tests.unit.block_helpers import PROMPTS, engine, run_engine
from tests.unit.block_references.checkpoints import EOS_ID, MASK_ID, llada2_config
from tests.unit.block_references.llada22 import (DELETE_ID, ROLE_END_ID, SPLIT_ID, LLaDA22Model, llada22_generate,
                                                 write_llada22_checkpoint)

G = 32
# (threshold, editing_threshold, max_post_steps): the published defaults, LLaDA2.1's Q mode, a
# short budget, no post steps, token-to-token rewrites off.
SETTINGS = [(0.5, 0.0, 16), (0.95, 0.9, 16), (0.5, 0.0, 4), (0.3, 0.0, 0), (0.5, 1.0, 16)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_llada22_checkpoint(tmp_path_factory.mktemp("llada22"), seed=3, edit_scale=2.0, num_hidden_layers=2)


@pytest.fixture(scope="module")
def llm(folder):
    return engine(folder)


@pytest.fixture(scope="module")
def ref_model(folder):
    return LLaDA22Model(folder)


def _ref(ref_model, prompt, threshold, editing, post):
    return llada22_generate(ref_model, prompt, G, threshold=threshold, editing_threshold=editing,
                            max_post_steps=post, mask_id=MASK_ID, eos_ids=(EOS_ID, ROLE_END_ID), draw=lambda c: 0)


def cut(ids: list[int], n: int) -> list[int]:
    """The first n ids up to the first stop id (either) or mask, as the engine's output ends."""
    ends = [i for i, t in enumerate(ids[:n]) if t in (EOS_ID, ROLE_END_ID, MASK_ID)]
    return ids[:ends[0] if ends else n]


def _params(threshold, editing, post):
    return dict(gen_length=G, block_length=32, steps=G, threshold=threshold, editing_threshold=editing,
                max_post_steps=post)


def test_the_folder_is_llada22(llm):
    assert llm.model.cfg.arch == "llada2.2"
    assert (llm.model.cfg.delete_token_id, llm.model.cfg.split_token_id) == (DELETE_ID, SPLIT_ID)
    assert {EOS_ID, ROLE_END_ID} <= llm.tokenizer.stop_ids  # generation_config.json's list


def test_one_decode_with_edits_is_the_references(llm, ref_model):
    """The fast tier's case: deletes and splits happen, the anti-loop does not."""
    p = PROMPTS[1]
    ref = _ref(ref_model, p, 0.5, 0.0, 4)
    assert ref.edit_ops > 0 and ref.escapes == 0
    s = run_engine(llm, [p], **_params(0.5, 0.0, 4))[0]
    assert s.generated() == cut(ref.ids, G)
    assert not {DELETE_ID, SPLIT_ID, MASK_ID} & set(s.generated())


@pytest.mark.slow  # the reference recomputes the window every forward: minutes under load
def test_whole_decodes_are_the_references(llm, ref_model, capsys):
    identical = compared = fired = 0
    for setting in SETTINGS:
        seqs = run_engine(llm, PROMPTS, **_params(*setting))
        for p, s in zip(PROMPTS, seqs):
            ref = _ref(ref_model, p, *setting)
            if ref.escapes:
                fired += 1
                continue
            compared += 1
            identical += s.generated() == cut(ref.ids, G)
    with capsys.disabled():
        print(f"\nLLaDA2.2 whole decodes: {identical}/{compared} identical ({fired} left out: the anti-loop drew)")
    assert compared >= len(SETTINGS) * len(PROMPTS) // 2
    assert identical == compared


def _decode(llm, prompts, seed):
    seqs = [llm.sequence(p, SamplingParams(seed=seed, **_params(0.5, 0.0, 16))) for p in prompts]
    for s in seqs:
        llm.loop.add(s)
    llm.loop.run_to_completion()
    return [s.generated() for s in seqs]


def test_seeds_reproduce_alone_and_in_a_batch(llm):
    """PROMPTS[0] loops under these knobs (its reference draws: test_whole_decodes counts it), so
    its tokens depend on the seed's draws: the same alone and beside other requests."""
    alone = _decode(llm, [PROMPTS[0]], seed=7)[0]
    batched = _decode(llm, [PROMPTS[2], PROMPTS[0], PROMPTS[1]], seed=7)[1]
    assert alone == batched == _decode(llm, [PROMPTS[0]], seed=7)[0]


def test_an_edit_is_a_revision_in_the_stream(llm):
    events = []
    s = llm.sequence(PROMPTS[1], SamplingParams(seed=0, **_params(0.5, 0.0, 4)))
    llm.loop.add(s)
    llm.loop.run_to_completion(events.append)
    assert all(e.revising for e in events)
    # An edited position is provisional until its block ends (then every position of it is final).
    assert any(not e.is_final(i, MASK_ID) for e in events for i in e.revised)


def test_block_lengths_are_whole_routing_blocks(llm):
    family = family_of(llm.model.cfg)
    bad = family.violations(SamplingParams(gen_length=G, block_length=16, steps=G))
    assert [v.field for v in bad] == ["block_length"]
    with pytest.raises(InvalidRequest):
        llm.sequence(PROMPTS[0], SamplingParams(gen_length=G, block_length=16, steps=G))


def test_edits_on_a_checkpoint_without_edit_ids_are_refused_by_field():
    """A LLaDA2 config with the block-routed gate but no edit ids: routed per block, no editing."""
    raw = llada2_config(expert_capacity=4, block_size=32, num_experts=8, n_group=4, topk_group=2)
    cfg = parse_config(raw)
    family = family_of(cfg)
    assert (cfg.arch, cfg.expert_capacity, family.routing_block, family.edits) == ("llada2", 4, 32, False)
    bad = family.violations(SamplingParams(gen_length=G, block_length=32, steps=G, editing_threshold=0.5))
    assert [v.field for v in bad] == ["editing_threshold"]


@pytest.mark.slow  # three batched decodes: a minute under load
def test_the_static_path_decodes_what_the_per_row_path_decodes(folder):
    """The block runner's static shapes (what a CUDA graph captures: batch buckets, every expert
    at a static shape masked by the block-routed gate), run eagerly on the CPU."""
    out = {}
    for static in (False, True):
        llm = engine(folder)
        llm.runner.static = static
        out[static] = [s.generated() for s in run_engine(llm, PROMPTS, **_params(0.5, 0.0, 4))]
    assert out[True] == out[False]


def test_a_llada2_config_without_expert_capacity_keeps_the_grouped_gate():
    """block_size alone (LLaDA2.0/2.1 configs may carry it) changes nothing: grouped routing, any
    block length."""
    cfg = parse_config(llada2_config(block_size=32))
    assert (cfg.arch, cfg.expert_capacity, cfg.routing_block, family_of(cfg).routing_block) == ("llada2", 0, 0, 0)
